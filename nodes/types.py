"""Type names shared by our nodes, and the conversions between ComfyUI types and core objects."""

from __future__ import annotations

import torch

PIPE = "LINGBOT_PIPE"
COND = "LINGBOT_COND"
IMAGE_COND = "LINGBOT_IMAGE_COND"
class AnyType(str):
    """ComfyUI's "any type": its server compares link types with `!=`, and a plain "*" is no
    wildcard there (only the editor treats it as one)."""

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = str.__hash__


ANY = AnyType("*")

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
    """VALIDATE_INPUTS-style check: True, or a message naming the input to change.

    ComfyUI skips its own min/max checks for inputs that VALIDATE_INPUTS names, so the bounds are
    applied here too.
    """
    from lingbot_core.latents import SIZE_MULTIPLE, VAE_TEMPORAL

    for name, value in (("width", width), ("height", height)):
        value = int(value)
        if not SIZE_MULTIPLE <= value <= MAX_SIZE:
            return f"{name} must lie in [{SIZE_MULTIPLE}, {MAX_SIZE}], got {value}"
        if value % SIZE_MULTIPLE:
            nearest = min(MAX_SIZE, (value + SIZE_MULTIPLE // 2) // SIZE_MULTIPLE * SIZE_MULTIPLE)
            return f"{name} {value} is not a multiple of {SIZE_MULTIPLE} (nearest: {nearest})"
    if frames is not None:
        frames = int(frames)
        if not 1 <= frames <= MAX_FRAMES:
            return f"frames must lie in [1, {MAX_FRAMES}], got {frames}"
        if frames != 1 and (frames - 1) % VAE_TEMPORAL:
            lower = (frames - 1) // VAE_TEMPORAL * VAE_TEMPORAL + 1
            return f"frames must be 1 or 4n+1 (5, 9, ..., 121), got {frames}; try {lower} or {lower + VAE_TEMPORAL}"
    return True
