"""Type names shared by our nodes, and the conversions between ComfyUI types and core objects."""

from __future__ import annotations

import torch

PIPE = "LINGBOT_PIPE"
COND = "LINGBOT_COND"
IMAGE_COND = "LINGBOT_IMAGE_COND"
ANY = "*"

MAX_SIZE = 4096
MAX_FRAMES = 1025


def latent_out(vae_latents: torch.Tensor) -> dict:
    """ComfyUI LATENT: raw Wan-VAE latents (1,16,T,h,w) on the CPU."""
    return {"samples": vae_latents.detach().float().cpu()}


def latent_in(latent: dict) -> torch.Tensor:
    samples = latent.get("samples") if isinstance(latent, dict) else None
    if not isinstance(samples, torch.Tensor) or samples.ndim != 5 or samples.shape[1] != 16:
        shape = tuple(samples.shape) if isinstance(samples, torch.Tensor) else type(samples).__name__
        raise ValueError(f"expected a Wan video LATENT with samples shaped (1,16,T,h,w), got {shape}")
    return samples[:1]


def geometry_errors(width: int, height: int, frames: int | None = None) -> str | bool:
    """VALIDATE_INPUTS-style check: True, or a message."""
    from lingbot_core.latents import validate_geometry

    try:
        validate_geometry(int(height), int(width), int(frames if frames is not None else 1))
    except ValueError as err:
        return str(err)
    return True
