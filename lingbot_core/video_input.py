"""Video files -> frames: the input side of video-to-video, decoded with PyAV's bundled FFmpeg.

Everything that can refuse a file is read from the container's stream metadata before a frame is
decoded, and only the frames a request uses are converted and kept: a long file costs the time to
decode up to its last used frame, never the memory of the whole file. Frames come out as the
pack's IMAGE batch, [F,H,W,3] float32 in [0,1], resized with the rule the TI2V first frame uses
(`image.cover_crop`: scale to cover, centre-crop).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction

import torch

from .image import cover_crop

__all__ = ["VIDEO_LIMITS", "VideoInfo", "load_video", "output_size", "probe_video", "read_video_frames"]

VIDEO_LIMITS = {
    "side": 8192,  # a stored frame's width or height (pixels)
    "seconds": 3600.0,  # a file's duration: an hour of video is already far more than one clip
    "frames": 1025,  # frames taken from one file (the longest video a request may sample)
    "bytes": 8 << 30,  # the decoded frames kept, as float32 (F*H*W*3*4)
}
"""What a loaded video may be; the node's ranges and the checks read these."""

SIZE_STEP = 16  # the model's size step: output sides are multiples of it


@dataclass(frozen=True)
class VideoInfo:
    """A video stream's metadata, read without decoding."""

    width: int
    height: int
    fps: float
    frames: int  # from the container, or duration x fps when it does not say

    @property
    def seconds(self) -> float:
        return self.frames / self.fps if self.fps > 0 else 0.0


def _name(path: str | os.PathLike) -> str:
    return os.path.basename(os.fspath(path))[:120]


def _open(path: str | os.PathLike):
    import av

    try:
        return av.open(os.fspath(path), mode="r")
    except Exception as exc:  # PyAV raises its own error classes, OSError, ... for a file FFmpeg cannot read
        why = (getattr(exc, "strerror", None) or str(exc)).splitlines() or [type(exc).__name__]
        why = why[0][:160]
        raise ValueError(f"cannot read '{_name(path)}' as a video: {why}") from None


def _info(container, path: str | os.PathLike) -> tuple[VideoInfo, object]:
    streams = list(container.streams.video)
    if not streams:
        raise ValueError(f"'{_name(path)}' has no video stream")
    stream = streams[0]
    width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    frames = int(stream.frames or 0)
    if frames <= 0:  # the container does not count them: estimate from the duration
        seconds = 0.0
        if stream.duration is not None and stream.time_base:
            seconds = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            seconds = container.duration / 1_000_000
        frames = int(math.floor(seconds * fps + 0.5)) if fps > 0 else 0
    return VideoInfo(width, height, fps, frames), stream


def _check_info(info: VideoInfo, path: str | os.PathLike) -> None:
    name = _name(path)
    if info.width < 1 or info.height < 1:
        raise ValueError(f"'{name}': the video stream has no frame size ({info.width}x{info.height})")
    side = VIDEO_LIMITS["side"]
    if max(info.width, info.height) > side:
        raise ValueError(f"'{name}' is {info.width}x{info.height}; video sides over {side} pixels are not accepted")
    if info.seconds > VIDEO_LIMITS["seconds"]:
        raise ValueError(f"'{name}' lasts {info.seconds / 60:.0f} min; videos over "
                         f"{VIDEO_LIMITS['seconds'] / 60:.0f} min are not accepted (cut the part you need first)")


def probe_video(path: str | os.PathLike) -> VideoInfo:
    """The file's video metadata (refused in one line when it is not a usable video); decodes nothing."""
    with _open(path) as container:
        info, _stream = _info(container, path)
    _check_info(info, path)
    return info


def output_size(info: VideoInfo, width: int = 0, height: int = 0) -> tuple[int, int]:
    """(height, width) of the loaded frames: as asked, or 0 for the source's side floored to the size step."""
    def side(asked: int, source: int, what: str) -> int:
        if asked < 0 or asked % SIZE_STEP:
            raise ValueError(f"{what} must be 0 (from the video) or a positive multiple of {SIZE_STEP}, got {asked}")
        if asked:
            return asked
        if source < SIZE_STEP:
            raise ValueError(f"the video's {what} is {source} pixels, under the model's step of {SIZE_STEP}; "
                             f"set {what} to resize it")
        return source // SIZE_STEP * SIZE_STEP

    out_w, out_h = side(width, info.width, "width"), side(height, info.height, "height")
    if width and not height:  # one side given: the other keeps the source's aspect, on the step
        out_h = max(SIZE_STEP, round(info.height * width / info.width / SIZE_STEP) * SIZE_STEP)
    elif height and not width:
        out_w = max(SIZE_STEP, round(info.width * height / info.height / SIZE_STEP) * SIZE_STEP)
    return out_h, out_w


def _indices(info: VideoInfo, start: int, count: int, stride: int, path: str | os.PathLike) -> range:
    """The source frame indices a request uses (`count` 0: every stride-th frame to the end, capped)."""
    if start < 0 or stride < 1 or count < 0:
        raise ValueError(f"start_frame must be >= 0, stride >= 1 and frame_count >= 0; got {start}, {stride}, {count}")
    cap = VIDEO_LIMITS["frames"]
    if count > cap:
        raise ValueError(f"frame_count is {count}; at most {cap} frames are loaded from one video")
    if info.frames > 0 and start >= info.frames:
        raise ValueError(f"'{_name(path)}' has {info.frames} frames; start_frame {start} is past its end")
    available = (info.frames - start + stride - 1) // stride if info.frames > 0 else cap
    wanted = min(count or available, cap)
    return range(start, start + wanted * stride, stride)


def _scale_options(av) -> dict[str, int]:
    """How a frame is converted to RGB: on one thread. PyAV 17 and newer scale with a pool of threads that
    FFmpeg keeps for the whole process; a process forked after it ran (a worker pool, torch's start_processes
    with 'fork') waits forever on the first frame it converts, the pool's threads not being in the child
    (seen with PyAV 19). Older PyAV has no such pool and no such option."""
    return {"threads": 1} if int(av.__version__.split(".")[0]) >= 17 else {}


def read_video_frames(path: str | os.PathLike, *, start_frame: int = 0, frame_count: int = 0, stride: int = 1,
                      width: int = 0, height: int = 0) -> tuple[torch.Tensor, float]:
    """Frames `start_frame`, +`stride`, ... (`frame_count` of them, 0: to the end) as [F,H,W,3] float32 in
    [0,1] at (`height`, `width`) (0: the source size floored to multiples of 16), and the frames' rate.

    Refused in one line before decoding: not a video, no frame size, sides over `VIDEO_LIMITS["side"]`,
    longer than `VIDEO_LIMITS["seconds"]`, a start past the end, more frames or bytes than the limits.
    A file that then decodes to no frame at all is refused too.
    """
    import av

    with _open(path) as container:
        info, stream = _info(container, path)
        _check_info(info, path)
        out_h, out_w = output_size(info, width, height)
        wanted = _indices(info, int(start_frame), int(frame_count), int(stride), path)
        size = len(wanted) * out_h * out_w * 3 * 4
        if size > VIDEO_LIMITS["bytes"]:
            raise ValueError(f"{len(wanted)} frames at {out_w}x{out_h} take {size / 2**30:.1f} GiB; at most "
                             f"{VIDEO_LIMITS['bytes'] / 2**30:.0f} GiB of frames are loaded (fewer frames, a "
                             "stride, or a smaller size)")
        stream.thread_type = "AUTO"
        scaling = _scale_options(av)
        kept: list[torch.Tensor] = []
        next_index = iter(wanted)
        target = next(next_index, None)
        try:
            for index, frame in enumerate(container.decode(stream)):
                if target is None:
                    break
                if index != target:
                    continue
                rgb = torch.from_numpy(frame.to_ndarray(format="rgb24", **scaling)).permute(2, 0, 1).unsqueeze(0)
                kept.append(cover_crop(rgb, out_h, out_w)[0].permute(1, 2, 0).float().div(255.0))
                target = next(next_index, None)
        except av.error.FFmpegError as exc:
            if not kept:
                raise ValueError(f"'{_name(path)}' could not be decoded: {str(exc)[:160]}") from None
        # a broken tail ends the video early: keep what decoded (the count is in the output)
    if not kept:
        raise ValueError(f"'{_name(path)}' has no decodable frame at index {wanted.start} or after "
                         f"(the file holds {info.frames} frames by its metadata)")
    fps = info.fps / stride if info.fps > 0 else 24.0
    return torch.stack(kept), float(Fraction(fps).limit_denominator(1001))


def load_video(path: str | os.PathLike, **options: int) -> torch.Tensor:
    """`read_video_frames` without the frame rate."""
    return read_video_frames(path, **options)[0]
