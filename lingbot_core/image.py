"""TI2V first-frame preparation: the conditioning pixels and the picture the Qwen3-VL vision tower sees.

Both follow the reference bit for bit; the fixtures pin the uint8 rounding at every step.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

__all__ = [
    "load_image",
    "prepare_image_pixels",
    "smart_resize",
    "vision_image",
    "vision_patch_size",
]

MIN_IMAGE_TOKENS = 4
MAX_IMAGE_TOKENS = 16384
MAX_ASPECT_RATIO = 200
DEFAULT_PATCH_SIZE = 16
SPATIAL_MERGE_SIZE = 2


def _array_to_pil(array: torch.Tensor) -> Image.Image:
    """(H,W), (H,W,C) uint8 or float-in-[0,1] tensor -> RGB PIL image."""
    if array.ndim == 2:
        array = array.unsqueeze(-1)
    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
        raise ValueError(f"expected an image of shape [H,W,3] (or [B,H,W,3]), got {tuple(array.shape)}")
    if array.dtype != torch.uint8:
        # Round, not truncate: a float image that came from a file holds exact k/255 values, which both
        # choices map back to k; for anything else rounding is the closer 8-bit picture.
        array = array.float().clamp(0.0, 1.0).mul(255.0).round().to(torch.uint8)
    if array.shape[-1] == 1:
        array = array.expand(-1, -1, 3)
    elif array.shape[-1] == 4:
        array = array[..., :3]  # ComfyUI keeps alpha in a separate MASK; drop it like convert("RGB") would
    return Image.fromarray(array.contiguous().numpy(), mode="RGB")


def load_image(image: str | os.PathLike | Image.Image | torch.Tensor | np.ndarray) -> Image.Image:
    """Accept a path, PIL image, ComfyUI IMAGE tensor or array and return an RGB PIL image.

    Paths are opened like the reference CLI (``Image.open(...).convert("RGB")``, no EXIF rotation).
    Tensors may be ComfyUI ``[B,H,W,3]`` (first frame is used) or ``[H,W,3]``; floats are taken as 0..1 and
    quantised with ``round(clamp(x,0,1)*255)``.
    """
    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
        try:
            with Image.open(path) as opened:
                return opened.convert("RGB")
        except Exception as exc:  # PIL raises OSError, SyntaxError, EOFError, ... for bad files
            raise ValueError(f"cannot read image '{path}': {exc}") from exc
    if isinstance(image, np.ndarray):
        image = torch.from_numpy(np.ascontiguousarray(image))
    if isinstance(image, torch.Tensor):
        frame = image.detach().cpu()
        if frame.ndim == 4:
            if frame.shape[0] < 1:
                raise ValueError("image batch is empty")
            frame = frame[0]
        return _array_to_pil(frame)
    raise TypeError(f"unsupported image type {type(image).__name__}")


def prepare_image_pixels(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """First-frame conditioning pixels, (1,3,1,H,W) float32 in [0,1] on the CPU.

    Scales the uint8 image to cover H×W with bilinear interpolation *on the uint8 tensor* (so every pixel is
    re-quantised to 8 bits, as in the reference), then centre-crops. Runs on the CPU because the uint8
    bilinear kernel is what the fixtures pin down.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"target size must be positive, got {height}x{width}")
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    pixels = torch.from_numpy(np.array(rgb)).permute(2, 0, 1).unsqueeze(0).contiguous()
    src_h, src_w = pixels.shape[-2:]
    scale = max(height / src_h, width / src_w)
    cover_h = max(math.ceil(src_h * scale), height)
    cover_w = max(math.ceil(src_w * scale), width)
    covered = F.interpolate(pixels, size=(cover_h, cover_w), mode="bilinear", align_corners=False)
    top = int(round((cover_h - height) / 2.0))
    left = int(round((cover_w - width) / 2.0))
    crop = covered[:, :, top : top + height, left : left + width]
    return (crop.float() / 255.0).unsqueeze(2)


def smart_resize(
    height: int,
    width: int,
    factor: int = 32,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> tuple[int, int]:
    """Size for the vision tower: multiples of ``factor``, area within [min_pixels, max_pixels].

    Each side is rounded to the nearest multiple (Python ``round``, ties to even); if the area is out of range
    both sides are rescaled by a common factor (aspect ratio kept) and floored/ceiled to multiples.
    ``min_pixels``/``max_pixels`` default to 4 and 16384 tokens of ``factor``², as in the reference.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    min_pixels = MIN_IMAGE_TOKENS * factor * factor if min_pixels is None else min_pixels
    max_pixels = MAX_IMAGE_TOKENS * factor * factor if max_pixels is None else max_pixels
    if max_pixels < min_pixels:
        raise ValueError(f"max_pixels ({max_pixels}) must be >= min_pixels ({min_pixels})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio {width}x{height} exceeds {MAX_ASPECT_RATIO}:1")

    new_h = max(factor, round(height / factor) * factor)
    new_w = max(factor, round(width / factor) * factor)
    if new_h * new_w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        new_h = math.floor(height / shrink / factor) * factor
        new_w = math.floor(width / shrink / factor) * factor
    elif new_h * new_w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        new_h = math.ceil(height * grow / factor) * factor
        new_w = math.ceil(width * grow / factor) * factor
    return new_h, new_w


def vision_image(
    image_pixels: torch.Tensor, patch_size: int = DEFAULT_PATCH_SIZE, merge_size: int = SPATIAL_MERGE_SIZE
) -> Image.Image:
    """The picture the vision tower sees, derived from the conditioning pixels (not from the raw input).

    Reference steps: back to uint8 with a *truncating* cast of ``clamp(0,1)*255`` (exact for the k/255
    values :func:`prepare_image_pixels` produces), then :func:`smart_resize` with factor patch·merge and a
    PIL resize with PIL's default filter.
    """
    frame = image_pixels.detach().cpu()
    if frame.ndim == 5:  # (B,3,T,H,W)
        frame = frame[0, :, 0]
    elif frame.ndim == 4:  # (B,3,H,W)
        frame = frame[0]
    if frame.ndim != 3 or frame.shape[0] != 3:
        raise ValueError(f"expected image pixels shaped (1,3,1,H,W), got {tuple(image_pixels.shape)}")
    array = frame.float().clamp(0, 1).permute(1, 2, 0).mul(255).to(torch.uint8).numpy()
    picture = Image.fromarray(array, mode="RGB")
    width, height = picture.size
    new_h, new_w = smart_resize(height, width, factor=patch_size * merge_size)
    return picture.resize((new_w, new_h))


def vision_patch_size(text_encoder: Any, processor: Any) -> int:
    """Vision patch size, looked up where the reference looks (encoder config, then processor), else 16."""
    image_processor = getattr(processor, "image_processor", None)
    candidates = (
        getattr(getattr(text_encoder, "config", None), "vision_config", None),
        getattr(image_processor, "config", None),
        image_processor,
    )
    for source in candidates:
        patch = getattr(source, "patch_size", None)
        if patch is not None:
            return int(patch)
    return DEFAULT_PATCH_SIZE
