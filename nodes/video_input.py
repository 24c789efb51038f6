"""LingBot Load Video: a video file as an IMAGE batch, for video-to-video (the core is `lingbot_core.video_input`)."""

from __future__ import annotations

from . import paths
from .image_input import test_pattern
from .types import CATEGORY, MAX_SIZE
from .v3 import io

FRAME_CAP = 1025  # lingbot_core.video_input.VIDEO_LIMITS["frames"] (a test compares them; listed without importing torch)


def test_pattern_video(frames: int = 9, height: int = 256, width: int = 384):
    """Load Image's colour bands drifting one step per frame: a deterministic input video for demos and
    tests, [F,H,W,3] in 0..1."""
    import torch

    wide = test_pattern(height, width + 4 * frames)
    return torch.cat([wide[:, :, 4 * i:4 * i + width] for i in range(frames)])


class LingBotLoadVideo(io.ComfyNode):
    """A video file's frames (a range, a stride, resized to the model's size step) as IMAGE."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LingBotLoadVideo",
            display_name="LingBot Load Video",
            category=CATEGORY,
            description="Loads frames of a video file (mp4, webm, mov, ... through PyAV) as an IMAGE batch for "
                        "video-to-video (Denoise's `video` input). Decodes only the frames it keeps; resizes them "
                        "like a TI2V first frame (scale to cover, centre-crop).",
            inputs=[
                io.String.Input("path", default="", tooltip="A video file; empty: a built-in drifting test pattern. In "
                                "ComfyUI a file in its input folder ('clip.mp4', or 'x.mp4 [output]' / '[temp]'); "
                                "headless any path"),
                io.Int.Input("start_frame", default=0, min=0, max=10_000_000, tooltip="First source frame used"),
                io.Int.Input("frame_count", default=121, min=0, max=FRAME_CAP,
                             tooltip="Frames to load (0: all to the end, up to the cap); Denoise uses 4n+1 frames"),
                io.Int.Input("stride", default=1, min=1, max=1000, tooltip="Use every n-th source frame"),
                io.Int.Input("width", default=0, min=0, max=MAX_SIZE, step=16,
                             tooltip="Output width, a multiple of 16 (0: from the video; with only height set, "
                                     "the video's aspect)"),
                io.Int.Input("height", default=0, min=0, max=MAX_SIZE, step=16,
                             tooltip="Output height, a multiple of 16 (0: from the video)"),
            ],
            outputs=[io.Image.Output(display_name="frames", tooltip="[F,H,W,3] in 0..1"),
                     io.Int.Output(display_name="frame_count", tooltip="Frames loaded"),
                     io.Float.Output(display_name="fps", tooltip="The loaded frames' rate (source fps / stride)")],
        )

    @classmethod
    def fingerprint_inputs(cls, path="", **_ignored):
        if not path:
            return path
        try:
            return f"{path}@{paths.image_path(path, 'video').stat().st_mtime_ns}"
        except (ValueError, OSError):
            return path  # validation reports it

    @classmethod
    def validate_inputs(cls, path=""):
        # the same folders and the same answer for a missing file and one outside them as Load Image
        if isinstance(path, str) and path:
            from lingbot_core.video_input import probe_video

            try:  # the file's metadata too: a file that is not a usable video is refused with the graph
                probe_video(paths.image_path(path, "video"))
            except ValueError as err:
                return str(err)
        return True

    @classmethod
    def execute(cls, path, start_frame=0, frame_count=121, stride=1, width=0, height=0):
        from lingbot_core.video_input import read_video_frames

        if not path:
            count = int(frame_count) or 9
            frames = test_pattern_video(count, int(height) or 256, int(width) or 384)
            return io.NodeOutput(frames, count, 24.0)
        frames, fps = read_video_frames(paths.image_path(path, "video"), start_frame=int(start_frame),
                                        frame_count=int(frame_count), stride=int(stride), width=int(width),
                                        height=int(height))
        return io.NodeOutput(frames, int(frames.shape[0]), fps)
