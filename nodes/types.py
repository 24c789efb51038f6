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


def geometry_errors(width: int | None, height: int | None, frames: int | None = None) -> InputProblems | bool:
    """The validator's check of a video size: True, or one message per input to change.

    ComfyUI skips its own min/max checks for inputs a validator names, so the bounds are applied
    here too. Inputs that are links (None at validation time) are skipped.
    """
    from lingbot_core.latents import SIZE_MULTIPLE, VAE_TEMPORAL

    problems: dict[str, str] = {}
    for name, value in (("width", width), ("height", height)):
        if value is None:
            continue
        value = int(value)
        if not SIZE_MULTIPLE <= value <= MAX_SIZE:
            problems[name] = f"must lie in [{SIZE_MULTIPLE}, {MAX_SIZE}], got {value}"
        elif value % SIZE_MULTIPLE:
            nearest = min(MAX_SIZE, (value + SIZE_MULTIPLE // 2) // SIZE_MULTIPLE * SIZE_MULTIPLE)
            problems[name] = f"{value} is not a multiple of {SIZE_MULTIPLE} (nearest: {nearest})"
    if frames is not None:
        frames = int(frames)
        if not 1 <= frames <= MAX_FRAMES:
            problems["frames"] = f"must lie in [1, {MAX_FRAMES}], got {frames}"
        elif frames != 1 and (frames - 1) % VAE_TEMPORAL:
            lower = (frames - 1) // VAE_TEMPORAL * VAE_TEMPORAL + 1
            problems["frames"] = f"must be 1 or 4n+1 (5, 9, ..., 121), got {frames}; try {lower} or {lower + VAE_TEMPORAL}"
    return problems_or_true(problems)
