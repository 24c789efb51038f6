"""Denoise and refine: the sampling nodes. They output raw Wan-VAE latents (ComfyUI LATENT)."""

from __future__ import annotations

from . import runtime
from .types import COND, IMAGE_COND, MAX_FRAMES, MAX_SIZE, PIPE, geometry_errors, latent_in, latent_out


class LingBotDenoise:
    CATEGORY = "LingBot-Video"
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("latent",)
    FUNCTION = "denoise"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipe": (PIPE,),
                "conditioning": (COND,),
                "width": ("INT", {"default": 832, "min": 16, "max": MAX_SIZE, "step": 16}),
                "height": ("INT", {"default": 480, "min": 16, "max": MAX_SIZE, "step": 16}),
                "frames": ("INT", {"default": 121, "min": 1, "max": MAX_FRAMES, "step": 4}),
                "steps": ("INT", {"default": 40, "min": 1, "max": 200}),
                "cfg": ("FLOAT", {"default": 3.0, "min": 0.0, "max": 30.0, "step": 0.1}),
                "shift": ("FLOAT", {"default": 3.0, "min": 0.01, "max": 100.0, "step": 0.1}),
                "seed": ("INT", {"default": 42, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": True}),
            },
            "optional": {
                "image_cond": (IMAGE_COND,),
                "latent": ("LATENT", {"tooltip": "start from these latents instead of fresh noise"}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, width=None, height=None, frames=None):
        if None in (width, height, frames):
            return True
        return geometry_errors(width, height, frames)

    def denoise(self, pipe, conditioning, width, height, frames, steps, cfg, shift, seed, image_cond=None,
                latent=None):
        from lingbot_core import stages
        from lingbot_core.latents import dit_to_vae, vae_to_dit

        start = vae_to_dit(latent_in(latent), pipe.vae_config()) if latent is not None else None
        with runtime.node_work(steps, "denoise") as on_step:
            out = stages.denoise(pipe, conditioning, height=int(height), width=int(width), num_frames=int(frames),
                                 steps=int(steps), guidance_scale=float(cfg), shift=float(shift), seed=int(seed),
                                 image_cond=image_cond, latents=start, callback=on_step)
        return (latent_out(dit_to_vae(out, pipe.vae_config())),)


class LingBotRefine:
    """The MoE refiner (SDEdit at t_thresh) on base frames or a base LATENT."""

    CATEGORY = "LingBot-Video"
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("latent",)
    FUNCTION = "refine"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipe": (PIPE,),
                "conditioning": (COND, {"tooltip": "text-only conditioning (no image)"}),
                "width": ("INT", {"default": 1920, "min": 16, "max": MAX_SIZE, "step": 16}),
                "height": ("INT", {"default": 1088, "min": 16, "max": MAX_SIZE, "step": 16}),
                "steps": ("INT", {"default": 8, "min": 1, "max": 200}),
                "t_thresh": ("FLOAT", {"default": 0.85, "min": 0.01, "max": 1.0, "step": 0.01}),
                "cfg": ("FLOAT", {"default": 3.0, "min": 0.0, "max": 30.0, "step": 0.1}),
                "shift": ("FLOAT", {"default": 3.0, "min": 0.01, "max": 100.0, "step": 0.1}),
                "seed": ("INT", {"default": 42, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": True}),
            },
            "optional": {
                "latent": ("LATENT", {"tooltip": "base latents (decoded here), or give images"}),
                "images": ("IMAGE", {"tooltip": "base frames [T,H,W,3]"}),
                "first_frame": ("IMAGE", {"tooltip": "TI2V: the original input image"}),
                "tiling": ("BOOLEAN", {"default": True}),
                "release_base": (["auto", "on", "off"], {
                    "default": "auto",
                    "tooltip": "drop the base DiT before the refiner loads (auto: whenever offload is not 'none')"}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, width=None, height=None):
        if None in (width, height):
            return True
        return geometry_errors(width, height)

    def refine(self, pipe, conditioning, width, height, steps, t_thresh, cfg, shift, seed, latent=None, images=None,
               first_frame=None, tiling=True, release_base="auto"):
        from lingbot_core import stages
        from lingbot_core.latents import dit_to_vae

        if (latent is None) == (images is None):
            raise ValueError("connect exactly one of `latent` or `images` as the base video")
        with runtime.node_work(steps, "refine") as on_step:
            frames = images if images is not None else stages.decode_vae_latents(pipe, latent_in(latent))
            out = stages.refine(pipe, frames, conditioning, height=int(height), width=int(width), steps=int(steps),
                                t_thresh=float(t_thresh), guidance_scale=float(cfg), shift=float(shift),
                                seed=int(seed), first_frame=first_frame, tiling=bool(tiling), decode_output=False,
                                release_base={"auto": None, "on": True, "off": False}[release_base],
                                callback=on_step)
        return (latent_out(dit_to_vae(out, pipe.vae_config())),)
