"""The pack's node registry (re-exported by the `lingbot_nodes` package on first use).

The nodes are V3 (`io.ComfyNode`): inside ComfyUI they are registered through `comfy_entrypoint`,
headless (no `comfy_api`) they run on the pack's own V3 subset (`v3_fallback`) in our engine.
`NODE_CLASS_MAPPINGS` is the registry the headless engine, the CLI and the tests use.
"""

from __future__ import annotations

from .caption import LingBotCaption
from .conditioning import LingBotImageEncode, LingBotTextEncode
from .extend import LingBotExtendVideo
from .files import LingBotLoaderFiles
from .image_input import LingBotLoadImage
from .loader import LingBotLoader, LingBotMemoryReport, LingBotOffload, LingBotRelease
from .lora import LingBotLoRA
from .output import LingBotDecode, LingBotSaveVideo
from .parallel import LingBotParallel
from .rewrite import LingBotRewrite
from .sampling import LingBotDenoise, LingBotRefine
from .v3 import HAVE_COMFY_API, ComfyExtension
from .video_input import LingBotLoadVideo

NODES = [
    LingBotLoader,
    LingBotLoaderFiles,
    LingBotOffload,
    LingBotLoRA,
    LingBotTextEncode,
    LingBotImageEncode,
    LingBotDenoise,
    LingBotRefine,
    LingBotDecode,
    LingBotRelease,
    LingBotParallel,
    LingBotSaveVideo,
    LingBotLoadImage,
    LingBotLoadVideo,
    LingBotExtendVideo,
    LingBotMemoryReport,
    LingBotCaption,
    LingBotRewrite,
]


def _schema(cls):
    return cls.define_schema()


NODE_CLASS_MAPPINGS = {_schema(cls).node_id: cls for cls in NODES}
NODE_DISPLAY_NAME_MAPPINGS = {_schema(cls).node_id: _schema(cls).display_name for cls in NODES}


class LingBotExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)


async def comfy_entrypoint() -> LingBotExtension:
    """What ComfyUI (0.3.48 and newer, the V3 node API) calls to register the pack."""
    return LingBotExtension()


__all__ = ["HAVE_COMFY_API", "NODES", "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "comfy_entrypoint"]
