"""Reading a video file back (tests only: the pack writes videos, it never reads one)."""

from __future__ import annotations

import os

import numpy as np
import torch


def read_video(path: str | os.PathLike) -> tuple[torch.Tensor, float]:
    """Decode a video file to frames [F,H,W,3] float32 in [0,1] and its frame rate."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or 24)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert frames, f"{path} has no frames"
    return torch.from_numpy(np.stack(frames)).float() / 255.0, fps
