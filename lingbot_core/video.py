"""Frames <-> files: mp4 through PyAV's bundled FFmpeg (no system ffmpeg), PNG for a single frame."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def to_uint8(frames: torch.Tensor) -> np.ndarray:
    """[F,H,W,3] float in [0,1] -> uint8, rounded."""
    if frames.ndim == 3:
        frames = frames.unsqueeze(0)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected frames shaped [F,H,W,3], got {tuple(frames.shape)}")
    return frames.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).cpu().numpy()


@contextmanager
def _written_whole(path: Path) -> Iterator[Path]:
    """Yield a hidden temporary name beside `path`; rename it to `path` only once writing finished.

    A failed or interrupted (Ctrl-C) save therefore leaves no partial file behind. The suffix is
    kept so PIL and FFmpeg still pick the format from the name.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.stem}.partial{path.suffix}")
    try:
        yield partial
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def save_png(frame: torch.Tensor, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> Path:
    """PNG with optional text chunks (ComfyUI keeps `prompt` and `workflow` there)."""
    from PIL.PngImagePlugin import PngInfo

    path = Path(path)
    info = PngInfo()
    for key, value in (metadata or {}).items():
        info.add_text(key, value)
    image = Image.fromarray(to_uint8(frame)[0])
    with _written_whole(path) as partial:
        image.save(partial, format="PNG", pnginfo=info)
    return path


def save_mp4(frames: torch.Tensor, path: str | os.PathLike, fps: float = 24.0, crf: int = 18,
             metadata: dict[str, str] | None = None) -> Path:
    """H.264 (yuv420p) mp4. Odd sizes are padded by one edge pixel, as yuv420p needs even sizes.

    `metadata` goes into the container's tags (ComfyUI reads `prompt` and `workflow` from there).
    """
    import av

    if not (0 < fps <= 240):
        raise ValueError(f"fps must lie in (0, 240], got {fps}")
    data = to_uint8(frames)
    _, h, w, _ = data.shape
    if h % 2 or w % 2:
        data = np.pad(data, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    path = Path(path)
    from fractions import Fraction

    with _written_whole(path) as partial, av.open(str(partial), mode="w", format="mp4",
                                                  options={"movflags": "use_metadata_tags"}) as container:
        container.metadata.update(metadata or {})
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = data.shape[2], data.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf)}
        for frame in data:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def save_frames(frames: torch.Tensor, path: str | os.PathLike, fps: float = 24.0,
                metadata: dict[str, str] | None = None) -> Path:
    """One frame -> PNG, several -> mp4; the suffix follows the content."""
    path = Path(path)
    if frames.ndim == 3 or frames.shape[0] == 1:
        return save_png(frames if frames.ndim == 3 else frames[0], path.with_suffix(".png"), metadata)
    return save_mp4(frames, path.with_suffix(".mp4"), fps, metadata=metadata)
