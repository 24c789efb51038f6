"""Type names shared by our nodes, and the conversions between ComfyUI types and core objects."""

from __future__ import annotations

import torch

from .v3 import io

PIPE = "LINGBOT_PIPE"
COND = "LINGBOT_COND"
IMAGE_COND = "LINGBOT_IMAGE_COND"

# The V3 custom types carried between our nodes (ComfyUI passes the objects through as they are).
Pipe = io.Custom(PIPE)
Cond = io.Custom(COND)
ImageCond = io.Custom(IMAGE_COND)

CATEGORY = "LingBot-Video"


class InputProblems(str):
    """A validation result naming each wrong input: reads as one message (what ComfyUI shows),
    and carries ``per_input`` so our engine reports one issue per wrong input, on that input."""

    per_input: dict[str, str]

    def __new__(cls, per_input: dict[str, str]) -> InputProblems:
        text = "; ".join(f"{name}: {message}" for name, message in per_input.items())
        self = super().__new__(cls, text)
        self.per_input = dict(per_input)
        return self


def problems_or_true(per_input: dict[str, str]) -> InputProblems | bool:
    return InputProblems(per_input) if per_input else True


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


def frames_problems(frames: int | None) -> InputProblems | bool:
    """Validator check of a frame count (1 or 4n+1 within range): True, or the message for `frames`.

    ComfyUI attaches a validator's message to every input the validator names, so validators here
    name one input each. Width and height need no validator: their range is the host's own
    per-input min/max check, the editor steps them by 16, and the first stage refuses a size that
    is not a multiple of 16 (naming both values and the nearest valid size) before any work.
    ComfyUI also skips its own range check for a named input, so the range is checked here.
    """
    from lingbot_core.latents import VAE_TEMPORAL

    if frames is None:
        return True
    frames = int(frames)
    if not 1 <= frames <= MAX_FRAMES:
        return InputProblems({"frames": f"must lie in [1, {MAX_FRAMES}], got {frames}"})
    if frames != 1 and (frames - 1) % VAE_TEMPORAL:
        lower = (frames - 1) // VAE_TEMPORAL * VAE_TEMPORAL + 1
        return InputProblems({"frames": f"must be 1 or 4n+1 (5, 9, ..., 121), got {frames}; "
                                        f"try {lower} or {lower + VAE_TEMPORAL}"})
    return True
