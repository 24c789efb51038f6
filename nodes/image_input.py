"""An image source that works headless too (ComfyUI's LoadImage needs its server's input folder)."""

from __future__ import annotations

import torch


def test_pattern(height: int = 256, width: int = 384) -> torch.Tensor:
    """Diagonal colour bands: a deterministic first frame for demos and tests, [1,H,W,3] in 0..1."""
    y = torch.linspace(0, 1, height).view(-1, 1)
    x = torch.linspace(0, 1, width).view(1, -1)
    phase = (x + y) * 6.0
    rgb = torch.stack([(torch.sin(phase * 3.1416 + k * 2.094) + 1) / 2 for k in range(3)], dim=-1)
    return rgb.unsqueeze(0).float()


class LingBotLoadImage:
    CATEGORY = "LingBot-Video"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("image",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"path": ("STRING", {"default": "", "tooltip": "empty: a built-in test pattern"})}}

    @classmethod
    def IS_CHANGED(cls, path=""):
        import os

        return os.path.getmtime(path) if path and os.path.isfile(path) else path

    @classmethod
    def VALIDATE_INPUTS(cls, path=""):
        import os

        if path and not os.path.isfile(path):
            return f"image file not found: {path}"
        return True

    def load(self, path=""):
        import numpy as np

        from lingbot_core.image import load_image

        if not path:
            return (test_pattern(),)
        array = np.asarray(load_image(path), dtype=np.float32) / 255.0
        return (torch.from_numpy(array).unsqueeze(0),)
