"""ComfyUI's V3 node API when ComfyUI is there, our own subset of it otherwise.

Every node module imports `io`, `ui`, `ComfyExtension`, `InputImpl` and `Types` from here, never
from `comfy_api` directly, so the same classes load inside ComfyUI and in a headless run.
"""

from __future__ import annotations

try:
    from comfy_api.latest import ComfyExtension, InputImpl, Types, io, ui

    HAVE_COMFY_API = True
except ImportError:  # no ComfyUI (CI, the CLI), or a ComfyUI older than the V3 API (0.3.48)
    from .v3_fallback import ComfyExtension, InputImpl, Types, io, ui

    HAVE_COMFY_API = False

__all__ = ["HAVE_COMFY_API", "ComfyExtension", "InputImpl", "Types", "io", "ui"]
