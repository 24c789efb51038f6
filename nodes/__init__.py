"""ComfyUI node classes for LingBot-Video: thin type translation over lingbot_core."""

from .conditioning import LingBotImageEncode, LingBotTextEncode
from .image_input import LingBotLoadImage
from .loader import LingBotLoader, LingBotMemoryReport, LingBotOffload, LingBotRelease
from .output import LingBotDecode, LingBotSaveVideo
from .sampling import LingBotDenoise, LingBotRefine

NODE_CLASS_MAPPINGS = {
    "LingBotLoader": LingBotLoader,
    "LingBotOffload": LingBotOffload,
    "LingBotTextEncode": LingBotTextEncode,
    "LingBotImageEncode": LingBotImageEncode,
    "LingBotDenoise": LingBotDenoise,
    "LingBotRefine": LingBotRefine,
    "LingBotDecode": LingBotDecode,
    "LingBotRelease": LingBotRelease,
    "LingBotSaveVideo": LingBotSaveVideo,
    "LingBotLoadImage": LingBotLoadImage,
    "LingBotMemoryReport": LingBotMemoryReport,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "LingBotLoader": "LingBot Loader",
    "LingBotOffload": "LingBot Offload",
    "LingBotTextEncode": "LingBot Text Encode",
    "LingBotImageEncode": "LingBot VAE Encode (first frame)",
    "LingBotDenoise": "LingBot Denoise",
    "LingBotRefine": "LingBot Refine (MoE)",
    "LingBotDecode": "LingBot Decode",
    "LingBotRelease": "LingBot Release",
    "LingBotSaveVideo": "LingBot Save Video",
    "LingBotLoadImage": "LingBot Load Image",
    "LingBotMemoryReport": "LingBot Memory Report",
}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
