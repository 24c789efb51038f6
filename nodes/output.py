"""Decode and save."""

from __future__ import annotations

from pathlib import Path

from . import runtime
from .types import PIPE, latent_in


class LingBotDecode:
    CATEGORY = "LingBot-Video"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("images",)
    FUNCTION = "decode"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"pipe": (PIPE,), "latent": ("LATENT",)},
            "optional": {
                "tiling": ("BOOLEAN", {"default": False}),
                "tile_height": ("INT", {"default": 256, "min": 32, "max": 4096, "step": 16}),
                "tile_width": ("INT", {"default": 256, "min": 32, "max": 4096, "step": 16}),
                "stride_height": ("INT", {"default": 192, "min": 16, "max": 4096, "step": 16}),
                "stride_width": ("INT", {"default": 192, "min": 16, "max": 4096, "step": 16}),
            },
        }

    def decode(self, pipe, latent, tiling=False, tile_height=256, tile_width=256, stride_height=192,
               stride_width=192):
        from lingbot_core import stages

        options = None
        if tiling:
            options = dict(tile_sample_min_height=int(tile_height), tile_sample_min_width=int(tile_width),
                           tile_sample_stride_height=int(stride_height), tile_sample_stride_width=int(stride_width))
        with runtime.node_work(label="decode"):
            frames = stages.decode_vae_latents(pipe, latent_in(latent), tiling=options if tiling else False)
        return (frames,)


class LingBotSaveVideo:
    """IMAGE frames -> mp4 (PyAV's bundled FFmpeg), or PNG for a single frame."""

    CATEGORY = "LingBot-Video"
    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "images": ("IMAGE",),
                "fps": ("FLOAT", {"default": 24.0, "min": 1.0, "max": 120.0, "step": 1.0}),
                "filename_prefix": ("STRING", {"default": "lingbot/video"}),
            },
            "hidden": {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, filename_prefix=None):
        if isinstance(filename_prefix, str) and (Path(filename_prefix).is_absolute() or ".." in Path(filename_prefix).parts):
            return "filename_prefix must be a relative path inside the output folder"
        return True

    def save(self, images, fps, filename_prefix, prompt=None, extra_pnginfo=None):
        import json

        from lingbot_core.video import save_frames

        # The graph travels with the file, so dropping it back into ComfyUI restores the workflow.
        metadata = {}
        if prompt is not None:
            metadata["prompt"] = json.dumps(prompt)
        for key, value in (extra_pnginfo or {}).items():
            metadata[key] = json.dumps(value)

        root = runtime.output_dir()
        stem = root / filename_prefix
        stem.parent.mkdir(parents=True, exist_ok=True)
        counter = 1 + max((int(p.stem.rsplit("_", 1)[-1]) for p in stem.parent.glob(f"{stem.name}_*.*")
                           if p.stem.rsplit("_", 1)[-1].isdigit()), default=0)
        path = save_frames(images, stem.parent / f"{stem.name}_{counter:05d}", float(fps), metadata)
        subfolder = str(path.parent.relative_to(root)) if path.parent != root else ""
        entry = {"filename": path.name, "subfolder": subfolder, "type": "output"}
        return {"ui": {"images": [entry], "animated": (path.suffix == ".mp4",)}, "result": ()}
