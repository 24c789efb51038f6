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
    "cover_crop",
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


def _uint8_batch(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> (1, 3, H, W) uint8 tensor."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    return torch.from_numpy(np.array(rgb)).permute(2, 0, 1).unsqueeze(0).contiguous()


def _covering_size(source: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """The source size scaled, aspect kept, by the least factor that makes it cover `target`.

    Each side is rounded up and never falls below the target (float error in the ratio could
    otherwise leave it one pixel short).
    """
    ratio = max(want / have for want, have in zip(target, source))
    return tuple(max(math.ceil(have * ratio), want) for have, want in zip(source, target))  # type: ignore[return-value]


def _centred_start(have: int, want: int) -> int:
    """Offset of a centred `want`-long window in `have` (an odd surplus splits by Python's round)."""
    return int(round((have - want) / 2.0))


def prepare_image_pixels(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """First-frame conditioning pixels, (1, 3, 1, H, W) float32 in [0, 1] on the CPU.

    The picture is scaled to cover H×W and centre-cropped. The scaling is bilinear (no corner
    alignment) applied to the *uint8* tensor, so every resampled pixel is re-quantised to 8 bits
    before the division by 255; that rounding is part of what the fixtures pin, and the uint8
    kernel used is the CPU one.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"the conditioning image needs a positive target size, got {height}x{width}")
    return cover_crop(_uint8_batch(image), height, width).float().div(255.0)[:, :, None]


def cover_crop(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(N,3,h,w) uint8 -> (N,3,H,W) uint8: scaled (aspect kept) to cover H×W, then centre-cropped.

    The one resize rule of the pack's inputs: a TI2V first frame and every frame of a loaded video
    go through it, so a video's first frame matches that frame loaded as an image.
    """
    cover_h, cover_w = _covering_size(tuple(frames.shape[-2:]), (height, width))
    scaled = F.interpolate(frames, size=(cover_h, cover_w), mode="bilinear", align_corners=False)
    top, left = _centred_start(cover_h, height), _centred_start(cover_w, width)
    return scaled[..., top : top + height, left : left + width]


def _snap(length: float, factor: int, rounding) -> int:
    """`length` as a multiple of `factor`, rounded with `rounding` (round, math.floor or math.ceil)."""
    return rounding(length / factor) * factor


def smart_resize(
    height: int,
    width: int,
    factor: int = 32,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> tuple[int, int]:
    """Size for the vision tower: both sides multiples of ``factor``, the area within [min_pixels, max_pixels].

    First each side goes to its nearest multiple (Python ``round``: ties to even; at least one
    ``factor``). If that area is too large (small), the original size is scaled by one common factor
    beta to fit, and the sides are floored (ceiled) to multiples. ``min_pixels``/``max_pixels``
    default to 4 and 16384 tokens of ``factor``², as in the reference.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"the image to resize must have a positive size, got {height}x{width}")
    low = MIN_IMAGE_TOKENS * factor * factor if min_pixels is None else min_pixels
    high = MAX_IMAGE_TOKENS * factor * factor if max_pixels is None else max_pixels
    if high < low:
        raise ValueError(f"max_pixels ({high}) is below min_pixels ({low}); no size can satisfy both")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"a {width}x{height} image has an aspect ratio beyond {MAX_ASPECT_RATIO}:1, more "
                         "than the vision tower takes")

    nearest = (max(factor, _snap(height, factor, round)), max(factor, _snap(width, factor, round)))
    area = nearest[0] * nearest[1]
    if area > high:
        beta = math.sqrt(height * width / high)
        return _snap(height / beta, factor, math.floor), _snap(width / beta, factor, math.floor)
    if area < low:
        beta = math.sqrt(low / (height * width))
        return _snap(height * beta, factor, math.ceil), _snap(width * beta, factor, math.ceil)
    return nearest


def _first_frame_hwc(image_pixels: torch.Tensor) -> torch.Tensor:
    """(3, H, W) of the first frame, from (B, 3, T, H, W), (B, 3, H, W) or (3, H, W) pixels."""
    frame = image_pixels.detach().cpu()
    if frame.ndim in (4, 5):
        frame = frame[0, :, 0] if frame.ndim == 5 else frame[0]
    if frame.ndim != 3 or frame.shape[0] != 3:
        raise ValueError(f"expected image pixels shaped (1,3,1,H,W), got {tuple(image_pixels.shape)}")
    return frame


def vision_image(
    image_pixels: torch.Tensor, patch_size: int = DEFAULT_PATCH_SIZE, merge_size: int = SPATIAL_MERGE_SIZE
) -> Image.Image:
    """The picture the vision tower sees, made from the conditioning pixels (not from the raw input).

    The pixels go back to uint8 with a *truncating* cast of ``clamp(0, 1) * 255`` (lossless for the
    k/255 values :func:`prepare_image_pixels` produces), then PIL resizes them (its default filter)
    to :func:`smart_resize` of their size with factor patch·merge.
    """
    levels = _first_frame_hwc(image_pixels).float().clamp(0, 1).mul(255).to(torch.uint8)
    picture = Image.fromarray(levels.permute(1, 2, 0).numpy(), mode="RGB")
    new_h, new_w = smart_resize(picture.height, picture.width, factor=patch_size * merge_size)
    return picture.resize((new_w, new_h))


# Where a vision patch size may be found, first match wins: the text encoder's vision config, the
# processor's image-processor config, the image processor itself.
_PATCH_SIZE_PATHS = (
    ("encoder", ("config", "vision_config", "patch_size")),
    ("processor", ("image_processor", "config", "patch_size")),
    ("processor", ("image_processor", "patch_size")),
)


def vision_patch_size(text_encoder: Any, processor: Any) -> int:
    """The vision tower's patch size (see `_PATCH_SIZE_PATHS`), 16 when none of them has one."""
    roots = {"encoder": text_encoder, "processor": processor}
    for root, path in _PATCH_SIZE_PATHS:
        value = roots[root]
        for attribute in path:
            value = getattr(value, attribute, None)
        if value is not None:
            return int(value)
    return DEFAULT_PATCH_SIZE
