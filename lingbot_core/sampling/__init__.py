"""Samplers Denoise can use, chosen per call: `flow_unipc` (default), `euler`, `dmd_student`.

    from lingbot_core import sampling
    sampler = sampling.get_sampler("dmd_student")          # by name, default options
    sampler = sampling.from_scheduler_block({"name": "dmd_student", "ddim_eta": 1.0, ...})

Adding a sampler is one module with a `Sampler` subclass, registered in `SAMPLERS` below.
"""

from __future__ import annotations

from typing import Any

from .base import Sampler, SamplerRun
from .dmd_student import DMDStudentSampler, ancestral_std, student_grid
from .euler import EulerSampler, euler_sigmas
from .flow_unipc import FlowUniPCSampler
from .sigmas import SigmaList, as_sigma_array, warp_sigmas

__all__ = [
    "SAMPLERS", "DEFAULT_SAMPLER", "Sampler", "SamplerRun", "SigmaList", "DMDStudentSampler", "EulerSampler",
    "FlowUniPCSampler", "as_sigma_array", "warp_sigmas", "ancestral_std", "student_grid", "euler_sigmas",
    "get_sampler", "from_scheduler_block", "parse_sigmas",
]

SAMPLERS: dict[str, type[Sampler]] = {cls.name: cls for cls in (FlowUniPCSampler, EulerSampler, DMDStudentSampler)}
DEFAULT_SAMPLER = "flow_unipc"

# Scheduler-block keys that describe the model rather than the sampler; accepted and not used.
_DESCRIPTIVE = {"name", "flow_shift", "prediction_type"}


def get_sampler(sampler: str | Sampler | None = None, **options: Any) -> Sampler:
    """A sampler by name (with its options), or the given instance; None is the default."""
    if isinstance(sampler, Sampler):
        if options:
            raise ValueError("options are only taken with a sampler name")
        return sampler
    name = DEFAULT_SAMPLER if sampler is None else sampler
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")
    try:
        return SAMPLERS[name](**options)
    except TypeError as err:
        raise ValueError(f"bad options for sampler {name!r}: {err}") from None


def from_scheduler_block(block: dict[str, Any]) -> Sampler:
    """The sampler a parity case's `scheduler` block names, with its settings.

    Unknown names and unknown keys raise: a case must never run on a sampler that only looks like
    the one it asks for.
    """
    name = block.get("name")
    if name not in SAMPLERS:
        raise ValueError(f"scheduler {name!r} is not implemented here (known: {', '.join(SAMPLERS)})")
    if block.get("prediction_type", "flow_prediction") != "flow_prediction":
        raise ValueError(f"scheduler {name!r}: only flow_prediction is supported, got {block['prediction_type']!r}")
    options = {k: v for k, v in block.items() if k not in _DESCRIPTIVE}
    return get_sampler(name, **options)


def parse_sigmas(text: str) -> list[float] | None:
    """A node's sigma text ("1.0, 0.9, 0.75, 0.5") as a checked list; blank gives None."""
    text = (text or "").replace(";", ",").strip().strip("[]")
    if not text:
        return None
    try:
        values = [float(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"custom sigmas must be numbers separated by commas, got {text!r}") from None
    as_sigma_array(values)
    return values
