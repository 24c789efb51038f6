"""ComfyUI entry point: drop this folder into ComfyUI/custom_nodes/."""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
try:
    import lingbot_core  # installed with pip

    _core = os.path.dirname(os.path.dirname(os.path.realpath(lingbot_core.__file__)))
    if _core != os.path.realpath(_here) and os.path.isdir(os.path.join(_here, "lingbot_core")):
        import logging

        logging.getLogger("lingbot_nodes").warning(
            "lingbot-nodes: using the pip-installed lingbot_core from %s, not the copy in %s; "
            "`pip uninstall lingbot-nodes` if their versions differ", _core, _here)
except ImportError:
    # Appended, never prepended: ComfyUI's own top-level modules (such as `nodes`) must win.
    sys.path.append(_here)

if __package__:
    from . import nodes as _pack  # noqa: E402
else:  # imported as a plain module (a test runner collecting this folder): use the installed package
    import lingbot_nodes as _pack  # noqa: E402

# Frontend code: shows the text our nodes send (Memory Report, fit check, warnings) on the node itself.
WEB_DIRECTORY = "./web"

if _pack.HAVE_COMFY_API:
    # ComfyUI with the V3 node API (0.3.48+): register through the extension entry point only,
    # since ComfyUI ignores `comfy_entrypoint` when a module also has NODE_CLASS_MAPPINGS.
    comfy_entrypoint = _pack.comfy_entrypoint
    __all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
else:
    # Without `comfy_api` (an older ComfyUI, or no ComfyUI): the same classes, run as V1 nodes.
    NODE_CLASS_MAPPINGS = _pack.NODE_CLASS_MAPPINGS
    NODE_DISPLAY_NAME_MAPPINGS = _pack.NODE_DISPLAY_NAME_MAPPINGS
    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
