"""ComfyUI entry point: drop this folder into ComfyUI/custom_nodes/."""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
try:
    import lingbot_core  # noqa: F401  (installed with pip)
except ImportError:
    # Appended, never prepended: ComfyUI's own top-level modules (such as `nodes`) must win.
    sys.path.append(_here)

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
