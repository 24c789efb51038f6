"""Decode and save."""

from __future__ import annotations

import logging
from fractions import Fraction
from pathlib import Path

from . import paths, runtime
from .types import CATEGORY, Choice, Pipe, latent_in
from .v3 import InputImpl, Types, io


def video_value(frames, fps: float):
    """Frames [T,H,W,3] and a frame rate as ComfyUI's VIDEO (core SaveVideo, GetVideoComponents...)."""
    rate = Fraction(float(fps)).limit_denominator(1001)
    return InputImpl.VideoFromComponents(Types.VideoComponents(images=frames, audio=None, frame_rate=rate))


VAE_CHOICES = {"full": "the Wan 2.1 VAE", "light": "the light decoder (TAEHV / LightTAE) in models/vae_approx"}


def light_decoder(choice: str) -> Path | None:
    """The light decoder file for Decode's `vae` widget: None for `full`, and for `light` when no file is
    found (then the full VAE decodes, after one warning)."""
    if choice not in VAE_CHOICES:
        raise ValueError(f"vae must be one of {', '.join(VAE_CHOICES)}, got {str(choice)[:40]!r}")
    if choice == "full":
        return None
    from .files import light_vae_file

    found = light_vae_file()
    if found is None:
        from lingbot_core.checkpoints.light_vae_file import PUT

        logging.getLogger("lingbot_nodes").warning(
            "lingbot: vae: light, but no light decoder was found in vae_approx; decoding with the full Wan "
            "2.1 VAE. %s.", PUT)
    return found


class LingBotDecode(io.ComfyNode):
    """Latents -> frames (IMAGE) and the same frames as a VIDEO."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LingBotDecode",
            display_name="LingBot Decode",
            category=CATEGORY,
            description="Decodes LATENT video latents with the Wan VAE into frames (IMAGE, frames as the batch) "
                        "and the same frames as a VIDEO at `fps`, which core Save Video and other video nodes take.",
            inputs=[
                Pipe.Input("pipe", tooltip="From LingBot Loader or LingBot Offload"),
                io.Latent.Input("latent", tooltip="From LingBot Denoise or Refine (raw Wan 2.1 VAE latents)"),
                io.Boolean.Input("tiling", default=False, optional=True,
                                 tooltip="Decode in overlapping tiles: much less memory, a little slower"),
                io.Int.Input("tile_height", default=256, min=32, max=4096, step=16, optional=True,
                             tooltip="Tile height in pixels"),
                io.Int.Input("tile_width", default=256, min=32, max=4096, step=16, optional=True,
                             tooltip="Tile width in pixels"),
                io.Int.Input("stride_height", default=192, min=16, max=4096, step=16, optional=True,
                             tooltip="Vertical distance between tiles (smaller than the tile: they overlap)"),
                io.Int.Input("stride_width", default=192, min=16, max=4096, step=16, optional=True,
                             tooltip="Horizontal distance between tiles"),
                io.Float.Input("fps", default=24.0, min=1.0, max=120.0, step=1.0, optional=True,
                               tooltip="Frame rate of the VIDEO output (LingBot-Video is trained at 24)"),
                # appended last: saved workflows assign widget values by position
                Choice("vae", options=list(VAE_CHOICES), default="full", optional=True,
                       tooltip="full: the Wan 2.1 VAE (best quality; minutes and the run's peak memory at "
                               "real sizes). light: the tiny TAEHV / LightTAE decoder from models/vae_approx "
                               "(lighttaew2_1 or taew2_1 .safetensors): many times faster and a small fraction "
                               "of the memory, softer detail and colour: drafts and previews. Without that "
                               "file: the full VAE, with a warning"),
            ],
            outputs=[io.Image.Output(display_name="images", tooltip="Frames [T,H,W,3] in 0..1"),
                     io.Video.Output(display_name="video", tooltip="The frames as a VIDEO at `fps`")],
        )

    @classmethod
    def execute(cls, pipe, latent, tiling=False, tile_height=256, tile_width=256, stride_height=192,
                stride_width=192, fps=24.0, vae="full"):
        from lingbot_core import stages

        light = light_decoder(vae)
        options = None
        if tiling:
            options = dict(tile_sample_min_height=int(tile_height), tile_sample_min_width=int(tile_width),
                           tile_sample_stride_height=int(stride_height), tile_sample_stride_width=int(stride_width))
        from lingbot_core.interrupt import decode_units

        latents = latent_in(latent)
        units = int(latents.shape[2]) if light is not None else decode_units(pipe, latents.shape[2])
        with runtime.node_work(label="decode", units=units):  # moves per block (light: per latent frame)
            frames = stages.decode_vae_latents(pipe, latents, tiling=options if tiling else False, light=light)
        runtime.log_run_summary(pipe, frames)
        return io.NodeOutput(frames, video_value(frames, fps))


class LingBotSaveVideo(io.ComfyNode):
    """IMAGE frames -> mp4 (PyAV's bundled FFmpeg), or PNG for a single frame."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LingBotSaveVideo",
            display_name="LingBot Save Video",
            category=CATEGORY,
            description="Saves frames to ComfyUI's output folder: an H.264 mp4 (PyAV, no ffmpeg needed), or a "
                        "PNG for a single frame, with the workflow embedded, and shows it in the editor.",
            inputs=[
                io.Image.Input("images", tooltip="Frames [T,H,W,3] from LingBot Decode"),
                io.Float.Input("fps", default=24.0, min=1.0, max=120.0, step=1.0, tooltip="Frame rate of the mp4"),
                io.String.Input("filename_prefix", default="lingbot/video",
                                tooltip="File name prefix inside the output folder; may hold a subfolder and "
                                        "%date:yyyy-MM-dd% / %year% fields. Files: <prefix>_00001_.mp4"),
            ],
            outputs=[],
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, filename_prefix=None):
        # A linked prefix arrives as None here; execute() checks the real value when it writes.
        if isinstance(filename_prefix, str):
            return paths.check_save_prefix(filename_prefix) or True
        return True

    @classmethod
    def execute(cls, images, fps, filename_prefix):
        import json

        from lingbot_core.distributed.stage import writes_outputs
        from lingbot_core.video import save_frames

        if not writes_outputs():  # a parallel run: rank 0 saves, the other ranks hold placeholder frames
            return io.NodeOutput(ui={"images": []})

        prompt, extra_pnginfo = cls.hidden.prompt, cls.hidden.extra_pnginfo
        # The graph travels with the file, so dropping it back into ComfyUI restores the workflow.
        metadata = {}
        if prompt is not None:
            metadata["prompt"] = json.dumps(prompt)
        for key, value in (extra_pnginfo or {}).items():
            metadata[key] = json.dumps(value)

        # Resolved now, whatever the prefix came through (a link is not seen by validate_inputs), with
        # ComfyUI's rules: %date:..%/%year%.. fields, <prefix>_<00001>_.<ext>, nothing outside the folder.
        height, width = (int(images.shape[-3]), int(images.shape[-2])) if images.ndim >= 3 else (0, 0)
        target = paths.save_target(filename_prefix, width=width, height=height)
        single = images.ndim == 3 or images.shape[0] == 1
        path = save_frames(images, target.path("png" if single else "mp4"), float(fps), metadata)
        entry = {"filename": path.name, "subfolder": target.subfolder, "type": "output"}
        return io.NodeOutput(ui={"images": [entry], "animated": (path.suffix == ".mp4",)})
