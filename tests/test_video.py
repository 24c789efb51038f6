"""Writing and reading video files."""

from __future__ import annotations

import pytest
import torch
from video_reader import read_video

from lingbot_core.video import save_frames, save_mp4


def test_mp4_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    # Smooth content survives H.264 closely; per-frame brightness must come back in order.
    base = torch.linspace(0, 1, 32).view(1, 1, 32, 1).expand(8, 32, 32, 3).clone()
    frames = (base * 0.5 + torch.linspace(0, 0.5, 8).view(8, 1, 1, 1)).clamp(0, 1)
    frames += torch.rand(frames.shape, generator=g) * 0.01
    path = save_mp4(frames, tmp_path / "clip.mp4", fps=12)
    back, fps = read_video(path)
    assert back.shape == frames.shape and fps == pytest.approx(12)
    assert (back - frames).abs().mean() < 0.03
    assert torch.all(back.mean(dim=(1, 2, 3)).diff() > 0)


def test_odd_sizes_are_padded(tmp_path):
    back, _ = read_video(save_mp4(torch.rand(3, 17, 21, 3), tmp_path / "odd.mp4"))
    assert back.shape == (3, 18, 22, 3)


def test_single_frame_is_png(tmp_path):
    path = save_frames(torch.rand(1, 16, 16, 3), tmp_path / "still.mp4")
    assert path.suffix == ".png" and path.read_bytes()[:4] == b"\x89PNG"


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="fps"):
        save_mp4(torch.rand(2, 16, 16, 3), tmp_path / "x.mp4", fps=0)
    with pytest.raises(ValueError, match=r"\[F,H,W,3\]"):
        save_mp4(torch.rand(2, 16, 16), tmp_path / "x.mp4")
