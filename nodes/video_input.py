"""LingBot Load Video: a video file as an IMAGE batch, for video-to-video (the core is `lingbot_core.video_input`)."""

from __future__ import annotations

from lingbot_core.video_input import VIDEO_LIMITS

from . import paths
from .image_input import TEST_PATTERN, input_fingerprint, is_test_pattern, test_pattern
from .types import CATEGORY, MAX_SIZE, Choice
from .v3 import io

FRAME_CAP = VIDEO_LIMITS["frames"]  # the most frames one load decodes (the core's bound, read from it)



def test_pattern_video(frames: int = 9, height: int = 256, width: int = 384):
    """Load Image's colour bands drifting one step per frame: a deterministic input video for demos and
    tests, [F,H,W,3] in 0..1."""
    import torch

    wide = test_pattern(height, width + 4 * frames)
    return torch.cat([wide[:, :, 4 * i:4 * i + width] for i in range(frames)])


def video_input(name: str, **options):
    """An input taking frames as the pack's IMAGE batch or as ComfyUI's core VIDEO (its Load Video, a
    video other packs hand on); `video_frames` turns either into frames."""
    return io.MultiType.Input(io.Image.Input(name, **options), types=[io.Video])


def video_frames(value, what: str = "video"):
    """[F,H,W,3] frames from an IMAGE batch (as it is) or a core VIDEO (anything with ComfyUI's
    `get_components()`: `.images`, a tensor [F,H,W,3] in 0..1). A VIDEO that says how big it is
    (`get_dimensions`, `get_duration`, `get_frame_rate`) is refused in one line past the Load Video
    limits before it is decoded; ComfyUI decodes a file VIDEO whole."""
    if value is None or hasattr(value, "ndim"):
        return value
    if not callable(getattr(value, "get_components", None)):
        raise ValueError(f"`{what}` must be frames (IMAGE) or a VIDEO, got {type(value).__name__}")
    from lingbot_core.video_input import VIDEO_LIMITS

    try:  # what it costs to decode, from the metadata (a VIDEO without these is decoded as it comes)
        width, height = (int(v) for v in value.get_dimensions())
        seconds = float(value.get_duration())
        rate = float(value.get_frame_rate()) if callable(getattr(value, "get_frame_rate", None)) else 24.0
    except Exception:  # noqa: BLE001 - metadata is optional: a source that cannot say is decoded
        width = height = 0
        seconds = rate = 0.0
    frames = int(seconds * rate + 0.5)
    size = frames * width * height * 3 * 4
    if max(width, height) > VIDEO_LIMITS["side"] or seconds > VIDEO_LIMITS["seconds"] or size > VIDEO_LIMITS["bytes"]:
        raise ValueError(f"the `{what}` VIDEO is {width}x{height}, {seconds:.0f} s ({frames} frames, "
                         f"{size / 2**30:.1f} GiB decoded); cut it first or load the part you need with LingBot "
                         f"Load Video (at most {VIDEO_LIMITS['side']} px sides, {VIDEO_LIMITS['bytes'] / 2**30:.0f} "
                         "GiB of frames)")
    images = value.get_components().images
    if not hasattr(images, "ndim") or images.ndim != 4 or images.shape[-1] != 3:
        shape = tuple(images.shape) if hasattr(images, "shape") else type(images).__name__
        raise ValueError(f"the `{what}` VIDEO's frames must be [F,H,W,3], got {shape}")
    if images.shape[0] < 1:
        raise ValueError(f"the `{what}` VIDEO has no frame")
    return images


class LingBotLoadVideo(io.ComfyNode):
    """A video file's frames (a range, a stride, resized to the model's size step) as IMAGE."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LingBotLoadVideo",
            display_name="LingBot Load Video",
            category=CATEGORY,
            description="Loads frames of a video file (mp4, webm, mov, ... through PyAV; ComfyUI's input folder, "
                        "with an upload button) as an IMAGE batch for video-to-video (Denoise's `video` input). "
                        "Decodes only the frames it keeps; resizes them like a TI2V first frame (scale to cover, "
                        "centre-crop).",
            inputs=[
                # ComfyUI's video upload combo over its input folder, as core Load Video has; the widget keeps
                # its name `path`, so saved workflows load, and validate_inputs checks the value (ComfyUI then
                # skips its list check), so '' and a typed path (headless any path) still work
                Choice("path", options=[TEST_PATTERN, *paths.input_videos()], default=TEST_PATTERN,
                       upload=io.UploadType.video, image_folder=io.FolderType.input,
                       tooltip="A video in ComfyUI's input folder (choose one, or upload one with the button; "
                               "'x.mp4 [output]' / '[temp]' for ComfyUI's other folders); "
                               f"{TEST_PATTERN} or empty: a built-in drifting test pattern. Headless any video path"),
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
        return input_fingerprint(path, "video")

    @classmethod
    def validate_inputs(cls, path=""):
        # the same folders and the same answer for a missing file and one outside them as Load Image
        if isinstance(path, str) and not is_test_pattern(path):
            from lingbot_core.video_input import probe_video

            try:  # the file's metadata too: a file that is not a usable video is refused with the graph
                probe_video(paths.image_path(path, "video"))
            except ValueError as err:
                return str(err)
        return True

    @classmethod
    def execute(cls, path, start_frame=0, frame_count=121, stride=1, width=0, height=0):
        from lingbot_core.video_input import read_video_frames

        if is_test_pattern(path):
            count = int(frame_count) or 9
            frames = test_pattern_video(count, int(height) or 256, int(width) or 384)
            return io.NodeOutput(frames, count, 24.0)
        frames, fps = read_video_frames(paths.image_path(path, "video"), start_frame=int(start_frame),
                                        frame_count=int(frame_count), stride=int(stride), width=int(width),
                                        height=int(height))
        return io.NodeOutput(frames, int(frames.shape[0]), fps)
