"""What every sampler offers Denoise: a schedule, and a step that moves the latents along it.

A `Sampler` is a small, immutable description (its name and options). `Sampler.start()` makes a
`SamplerRun` for one Denoise call: the timesteps the loop feeds the DiT, the float32 sigma table
(with its terminal value) and `step()`. A run owns all per-run state, so one sampler object can
serve any number of views and branches at once.

`check()` runs before any model work, so a bad request (custom sigmas for a sampler with a fixed
grid, say) fails in a second, not after the text encoder has run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from .sigmas import SigmaList, as_sigma_array, check_shift

__all__ = ["Sampler", "SamplerRun"]


@dataclass
class SamplerRun(ABC):
    """One sampling run: `timesteps[i]` is what step i feeds the DiT (through `transformer_timestep`).

    `sigmas` is float32 on the CPU, one longer than `timesteps` (the terminal sigma last). When
    `record` is set a run keeps what it drew and how (`trace`), for tests and parity checks.
    """

    timesteps: torch.Tensor
    sigmas: torch.Tensor
    record: bool = False
    trace: dict[str, list[Any]] = field(default_factory=dict)

    @abstractmethod
    def step(self, model_output: torch.Tensor, index: int, latents: torch.Tensor) -> torch.Tensor:
        """Latents after step `index`, given the (guided) flow prediction at `latents`; float32."""

    def __len__(self) -> int:
        return int(self.timesteps.numel())


class Sampler(ABC):
    """A sampling method Denoise can use; subclasses register under `name` in `lingbot_core.sampling`."""

    name: ClassVar[str]
    #: reads the checkpoint's `scheduler` component (its config), so Denoise acquires it
    uses_scheduler: ClassVar[bool] = False
    #: the settings its model was made for, shown by nodes and used by profiles (None: no advice)
    recommended: ClassVar[dict[str, Any] | None] = None

    def check(self, *, steps: int, shift: float, sigmas: SigmaList | None = None, refine: bool = False) -> None:
        """Refuse a request this sampler cannot run (before any model work)."""
        check_shift(shift)
        if sigmas is not None:
            as_sigma_array(sigmas)

    @abstractmethod
    def start(self, *, steps: int, shift: float, sigmas: SigmaList | None, device: torch.device,
              generator: torch.Generator | None, scheduler: Any = None, record: bool = False) -> SamplerRun:
        """A run of `steps` steps (or along `sigmas`, used as given: `shift` does not apply to them)."""

    def grid(self, *, steps: int, shift: float, scheduler: Any = None) -> np.ndarray | None:
        """The float64 sigmas (no terminal value) a `steps`-step run walks, so a run can start part-way
        along them (video-to-video passes their tail as `sigmas`); None when the sampler cannot start
        anywhere but its own first step."""
        return None

    def options(self) -> dict[str, Any]:
        return {}

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.options() == other.options()  # type: ignore[union-attr]

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.options().items()))))

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"
