"""An image source that works headless too (ComfyUI's LoadImage needs its server's input folder)."""

from __future__ import annotations

import torch

from . import paths
from .types import CATEGORY
from .v3 import io


def test_pattern(height: int = 256, width: int = 384) -> torch.Tensor:
    """Diagonal colour bands: a deterministic first frame for demos and tests, [1,H,W,3] in 0..1."""
    y = torch.linspace(0, 1, height).view(-1, 1)
    x = torch.linspace(0, 1, width).view(1, -1)
    phase = (x + y) * 6.0
    rgb = torch.stack([(torch.sin(phase * 3.1416 + k * 2.094) + 1) / 2 for k in range(3)], dim=-1)
    return rgb.unsqueeze(0).float()


class LingBotLoadImage(io.ComfyNode):
    """An image file (or a built-in test pattern) as IMAGE, without ComfyUI's upload folder."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LingBotLoadImage",
            display_name="LingBot Load Image",
            category=CATEGORY,
            description="Loads an image file as IMAGE for TI2V; with an empty path, a built-in colour test pattern. "
                        "Works headless too (core Load Image needs the server's input folder).",
            inputs=[io.String.Input("path", default="", tooltip="An image file; empty: a built-in test pattern. In "
                                    "ComfyUI a file in its input folder ('cat.png', or 'x.png [output]' / "
                                    "'[temp]'); headless any path")],
            outputs=[io.Image.Output(display_name="image", tooltip="The image [1,H,W,3] in 0..1")],
        )

    @classmethod
    def fingerprint_inputs(cls, path=""):
        if not path:
            return path
        try:
            return f"{path}@{paths.image_path(path).stat().st_mtime_ns}"
        except (ValueError, OSError):
            return path  # validation reports it

    @classmethod
    def validate_inputs(cls, path=""):
        # Inside ComfyUI only its input/output/temp folders; a file outside and a missing file get the
        # same answer, so validation cannot be used to probe the server's disk.
        if path:
            try:
                paths.image_path(path)
            except ValueError as err:
                return str(err)
        return True

    @classmethod
    def execute(cls, path=""):
        import numpy as np

        from lingbot_core.image import load_image

        if not path:
            return io.NodeOutput(test_pattern())
        array = np.asarray(load_image(paths.image_path(path)), dtype=np.float32) / 255.0
        return io.NodeOutput(torch.from_numpy(array).unsqueeze(0))
