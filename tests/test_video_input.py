"""Reading video files for video-to-video: frame ranges, resizing, and one-line refusals before decoding."""

from __future__ import annotations

import pytest
import torch

from lingbot_core import video_input
from lingbot_core.image import load_image, prepare_image_pixels
from lingbot_core.video import save_mp4, save_png
from lingbot_core.video_input import VIDEO_LIMITS, probe_video, read_video_frames


def _clip(path, frames: int = 10, height: int = 48, width: int = 64, fps: float = 12.0):
    """Frames whose brightness rises with their index, so an index can be read back from a decoded frame."""
    levels = torch.linspace(0.05, 0.95, frames).view(frames, 1, 1, 1)
    ramp = torch.linspace(0, 0.04, width).view(1, 1, width, 1)
    return save_mp4((levels + ramp).clamp(0, 1).expand(frames, height, width, 3).contiguous(), path, fps=fps)


def _level(frame: torch.Tensor) -> float:
    return float(frame.mean())


def test_range_stride_and_rate(tmp_path):
    path = _clip(tmp_path / "c.mp4")
    everything, fps = read_video_frames(path, frame_count=0)
    assert everything.shape == (10, 48, 64, 3) and fps == pytest.approx(12.0)
    picked, fps2 = read_video_frames(path, start_frame=2, frame_count=3, stride=3)
    assert picked.shape[0] == 3 and fps2 == pytest.approx(4.0)
    for got, index in zip(picked, (2, 5, 8)):
        assert abs(_level(got) - _level(everything[index])) < 1e-6
    assert read_video_frames(path, start_frame=7, frame_count=0)[0].shape[0] == 3  # 7, 8, 9


def test_resize_follows_the_first_frame_rule(tmp_path):
    path = _clip(tmp_path / "c.mp4", frames=3, height=48, width=80)
    frames, _ = read_video_frames(path, frame_count=1, height=32, width=32)
    assert frames.shape == (1, 32, 32, 3)
    whole, _ = read_video_frames(path, frame_count=1)
    still = save_png(whole[0], tmp_path / "first.png")
    expected = prepare_image_pixels(load_image(still), 32, 32)[0, :, 0].permute(1, 2, 0)
    assert torch.equal(frames[0], expected)
    # one side given: the other keeps the aspect on the 16-pixel step; 0 floors the source side to it
    assert read_video_frames(path, frame_count=1, width=160)[0].shape[1:3] == (96, 160)
    odd = _clip(tmp_path / "odd.mp4", frames=2, height=40, width=72)
    assert read_video_frames(odd, frame_count=1)[0].shape[1:3] == (32, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        read_video_frames(path, width=20)


def test_bad_files_are_refused_in_one_line(tmp_path):
    text = tmp_path / "notes.mp4"
    text.write_text("this is not a video\n" * 50)
    png = save_png(torch.rand(16, 16, 3), tmp_path / "still.png")
    path = _clip(tmp_path / "c.mp4")
    cases = [
        (lambda: read_video_frames(text), "cannot read 'notes.mp4' as a video"),
        (lambda: read_video_frames(tmp_path / "absent.mp4"), "cannot read 'absent.mp4'"),
        (lambda: read_video_frames(path, start_frame=10), "start_frame 10 is past its end"),
        (lambda: read_video_frames(path, stride=0), "stride"),
        (lambda: read_video_frames(path, frame_count=VIDEO_LIMITS["frames"] + 1), "at most"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words) as err:
            call()
        assert "\n" not in str(err.value)
    assert read_video_frames(png)[0].shape == (1, 16, 16, 3)  # an image is a one-frame video


def test_audio_only_file_has_no_video_stream(tmp_path):
    import av
    import numpy as np

    path = tmp_path / "sound.m4a"
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    with pytest.raises(ValueError, match="has no video stream"):
        read_video_frames(path)


def test_empty_video_stream_is_refused(tmp_path):
    import av

    path = tmp_path / "empty.mp4"
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
    with pytest.raises(ValueError, match="empty.mp4") as err:
        read_video_frames(path)
    assert "\n" not in str(err.value)


def test_limits_are_checked_from_metadata_before_decoding(tmp_path, monkeypatch):
    path = _clip(tmp_path / "c.mp4", frames=6, fps=6.0)  # one second
    decoded = []
    real_decode = None

    import av.container

    real_decode = av.container.InputContainer.decode

    def counting(self, *args, **kwargs):
        decoded.append(1)
        return real_decode(self, *args, **kwargs)

    monkeypatch.setattr(av.container.InputContainer, "decode", counting)
    monkeypatch.setitem(VIDEO_LIMITS, "seconds", 0.5)
    with pytest.raises(ValueError, match="min are not accepted"):
        read_video_frames(path)
    monkeypatch.setitem(VIDEO_LIMITS, "seconds", 3600.0)
    monkeypatch.setitem(VIDEO_LIMITS, "side", 40)
    with pytest.raises(ValueError, match="sides over 40 pixels"):
        read_video_frames(path)
    monkeypatch.setitem(VIDEO_LIMITS, "side", 8192)
    monkeypatch.setitem(VIDEO_LIMITS, "bytes", 48 * 64 * 3 * 4 * 2)
    with pytest.raises(ValueError, match="GiB"):
        read_video_frames(path, frame_count=3)
    assert decoded == []  # every refusal above came from the metadata
    assert probe_video(path).frames == 6
    assert read_video_frames(path, frame_count=2)[0].shape[0] == 2


def test_decoding_stops_after_the_last_frame_used(tmp_path, monkeypatch):
    path = _clip(tmp_path / "c.mp4", frames=20)
    converted = []
    real = video_input.cover_crop

    def counting(*args):
        converted.append(1)
        return real(*args)

    monkeypatch.setattr(video_input, "cover_crop", counting)
    frames, _ = read_video_frames(path, start_frame=1, frame_count=2, stride=2)
    assert frames.shape[0] == 2 and len(converted) == 2


def test_node_cap_matches_the_core_limit():
    from lingbot_nodes.video_input import FRAME_CAP

    assert FRAME_CAP == VIDEO_LIMITS["frames"]


def test_load_video_node_headless(tmp_path):
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    node = NODE_CLASS_MAPPINGS["LingBotLoadVideo"]
    path = _clip(tmp_path / "c.mp4")
    assert node.validate_inputs(path=str(path)) is True
    assert "video file not found" in node.validate_inputs(path=str(tmp_path / "nope.mp4"))
    (tmp_path / "notes.mp4").write_text("not a video")
    assert node.validate_inputs(path=str(tmp_path / "notes.mp4")).startswith("cannot read 'notes.mp4' as a video: ")
    frames, count, fps = node.execute("", 0, 5, 1, 32, 48).args  # empty: the drifting test pattern
    assert frames.shape == (5, 48, 32, 3) and count == 5 and not torch.equal(frames[0], frames[1])
    frames, count, fps = node.execute(str(path), 0, 5, 1, 32, 32).args
    assert frames.shape == (5, 32, 32, 3) and count == 5 and fps == pytest.approx(12.0)


def test_a_process_forked_after_reading_a_video_reads_one_too(tmp_path):
    """PyAV 17+ scales frames on a thread pool FFmpeg keeps for the process: a child forked after the parent
    converted a frame waited forever on its own first frame (PyAV 19; a worker pool or torch's start_processes
    with 'fork'). The read converts on one thread, so the child finishes."""
    import multiprocessing as mp

    path = _clip(tmp_path / "in.mp4", frames=3)
    frames, _fps = read_video_frames(path)  # the parent converts first
    ctx = mp.get_context("fork")
    child = ctx.Process(target=read_video_frames, args=(path,))
    child.start()
    child.join(60)
    hung = child.is_alive()
    if hung:
        child.kill()
        child.join()
    assert not hung, "the forked child never finished converting its first frame"
    assert child.exitcode == 0 and frames.shape[0] == 3
