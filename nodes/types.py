"""Type names shared by our nodes, and the conversions between ComfyUI types and core objects."""

from __future__ import annotations

from typing import Any

import torch

from lingbot_core.stage_inputs import LIMITS
from lingbot_core.workflow.grid import GridMin

from .v3 import io

PIPE = "LINGBOT_PIPE"
COND = "LINGBOT_COND"
IMAGE_COND = "LINGBOT_IMAGE_COND"

# The V3 custom types carried between our nodes (ComfyUI passes the objects through as they are).
Pipe = io.Custom(PIPE)
Cond = io.Custom(COND)
ImageCond = io.Custom(IMAGE_COND)

CATEGORY = "LingBot-Video"


class Choice(io.Combo.Input):
    """A COMBO input that reaches ComfyUI in its list form, ``(["a", "b"], {...})``.

    ComfyUI 0.3.64 checks a widget value against the options only when the input's type is that
    list; in the V3 form (``("COMBO", {"options": [...]})``) a wrong value passes validation and
    fails only when the node runs. The editor reads both forms alike, and so does our engine.
    """

    def get_io_type(self) -> list:
        return list(self.options)


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

MAX_SIZE, MAX_FRAMES, MAX_STEPS = LIMITS["size"], LIMITS["frames"], LIMITS["steps"]  # the core's one registry


def on_grid(low: int, step: int) -> dict[str, Any]:
    """``min``/``step`` for an INT input whose values must lie on ``low + k * step``: ComfyUI's own
    range check then refuses an off-grid value at validation time, with one message on that input
    (see lingbot_core.workflow.grid), and the editor rounds its widget to the same grid."""
    return {"min": GridMin(low, step), "step": step}


# Sizes are multiples of 16 (the VAE's x8, then the DiT's 2x2 patches); frame counts 1 or 4n+1.
SIZE_GRID = on_grid(16, 16)
FRAMES_GRID = on_grid(1, 4)


def latent_out(vae_latents: torch.Tensor) -> dict:
    """ComfyUI LATENT: raw Wan-VAE latents (1,16,T,h,w) on the CPU."""
    return {"samples": vae_latents.detach().float().cpu()}


def latent_in(latent: dict) -> torch.Tensor:
    samples = latent.get("samples") if isinstance(latent, dict) else None
    if not isinstance(samples, torch.Tensor) or samples.ndim != 5 or samples.shape[1] != 16:
        shape = tuple(samples.shape) if isinstance(samples, torch.Tensor) else type(samples).__name__
        raise ValueError(f"expected a Wan video LATENT with samples shaped (1,16,T,h,w), got {shape}")
    return samples[:1]
