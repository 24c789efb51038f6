"""An image source that works headless too (ComfyUI's LoadImage needs its server's input folder)."""

from __future__ import annotations

import torch

from . import paths
from .types import CATEGORY, Choice
from .v3 import io

TEST_PATTERN = "(test pattern)"
"""The Load Image choice (like an empty path) for the built-in test pattern."""


def is_test_pattern(path: str) -> bool:
    """An empty path or the `(test pattern)` choice: the built-in pattern, no file (Load Image and Load Video)."""
    return not path or path == TEST_PATTERN


def input_fingerprint(path: str, what: str = "image") -> str:
    """What ComfyUI compares to decide a loader must run again: the path and its file's mtime (the path
    alone for the pattern, or when the file is missing or refused: validation reports that)."""
    if is_test_pattern(path):
        return path
    try:
        return f"{path}@{paths.image_path(path, what).stat().st_mtime_ns}"
    except (ValueError, OSError):
        return path


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
            description="Loads an image file as IMAGE for TI2V (ComfyUI's input folder, with an upload button); "
                        f"{TEST_PATTERN}: a built-in colour test pattern. "
                        "Works headless too (core Load Image needs the server's input folder).",
            # ComfyUI's upload combo over its input folder (the widget keeps its name `path`, so saved
            # workflows load; validate_inputs checks the value, so a typed path or '' still works)
            inputs=[Choice("path", options=[TEST_PATTERN, *paths.input_images()], default=TEST_PATTERN,
                           upload=io.UploadType.image, image_folder=io.FolderType.input,
                           tooltip="An image in ComfyUI's input folder (choose one, or upload one with the "
                                   "button; 'x.png [output]' / '[temp]' for ComfyUI's other folders); "
                                   f"{TEST_PATTERN} or empty: a built-in colour test pattern. Headless any image "
                                   "path")],
            outputs=[io.Image.Output(display_name="image", tooltip="The image [1,H,W,3] in 0..1")],
        )

    @classmethod
    def fingerprint_inputs(cls, path=""):
        return input_fingerprint(path)

    @classmethod
    def validate_inputs(cls, path=""):
        # Inside ComfyUI only its input/output/temp folders; a file outside and a missing file get the
        # same answer, so validation cannot be used to probe the server's disk.
        if not is_test_pattern(path):
            try:
                paths.image_path(path)
            except ValueError as err:
                return str(err)
        return True

    @classmethod
    def execute(cls, path=""):
        import numpy as np

        from lingbot_core.image import load_image

        if is_test_pattern(path):
            return io.NodeOutput(test_pattern())
        array = np.asarray(load_image(paths.image_path(path)), dtype=np.float32) / 255.0
        return io.NodeOutput(torch.from_numpy(array).unsqueeze(0))
