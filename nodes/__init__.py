"""ComfyUI node classes for LingBot-Video: thin type translation over lingbot_core.

The registry (`NODES`, `NODE_CLASS_MAPPINGS`, `NODE_DISPLAY_NAME_MAPPINGS`, `HAVE_COMFY_API`,
`comfy_entrypoint`) lives in `registry.py` and is loaded on first access. Importing the package itself
stays light (no torch), so `python -m lingbot_nodes` can catch a Ctrl-C pressed while torch imports: the
package is imported before `__main__` runs, outside any `try` there.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["HAVE_COMFY_API", "NODES", "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "comfy_entrypoint"]


def __getattr__(name: str) -> Any:
    if name not in __all__:  # submodules and everything else: the normal import machinery
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.registry"), name)
    globals()[name] = value
    return value
