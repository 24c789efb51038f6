"""Latent geometry and the two latent spaces.

The DiT works on normalised latents `(z - mean) / std`; the Wan VAE (and ComfyUI's `LATENT`) on raw
ones (sizes are checked in `stage_inputs.validate_geometry`). The conversions use the reference's reciprocal form, `(z - mean) * (1/std)` and
`z / (1/std) + mean`, in float32, so they round exactly as the reference does.
"""

from __future__ import annotations

import torch

VAE_TEMPORAL = 4
VAE_SPATIAL = 8
SIZE_MULTIPLE = 16  # VAE x8, then the DiT's 2x2 patches


def latent_shape(height: int, width: int, num_frames: int, channels: int = 16) -> tuple[int, int, int, int, int]:
    return (1, channels, (num_frames - 1) // VAE_TEMPORAL + 1, height // VAE_SPATIAL, width // VAE_SPATIAL)


def _stats(vae_config, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def get(key):
        return vae_config[key] if isinstance(vae_config, dict) else getattr(vae_config, key)

    mean = torch.tensor(get("latents_mean"), device=like.device, dtype=torch.float32).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(get("latents_std"), device=like.device, dtype=torch.float32).view(1, -1, 1, 1, 1)
    return mean, inv_std


def vae_to_dit(latents: torch.Tensor, vae_config) -> torch.Tensor:
    mean, inv_std = _stats(vae_config, latents)
    return (latents.float() - mean) * inv_std


def dit_to_vae(latents: torch.Tensor, vae_config) -> torch.Tensor:
    mean, inv_std = _stats(vae_config, latents)
    return latents.float() / inv_std + mean
