"""What every sampler offers Denoise: a schedule, and a step that moves the latents along it.

A `Sampler` is a small, immutable description (its name and options). `Sampler.start()` makes a
`SamplerRun` for one Denoise call: the timesteps the loop feeds the DiT, the float32 sigma table
(with its terminal value) and `step()`. A run owns all per-run state, so one sampler object can
serve any number of views and branches at once.

`check()` runs before any model work, so a bad request (custom sigmas for a sampler with a fixed
grid, say) fails in a second, not after the text encoder has run.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

SigmaList = Sequence[float] | np.ndarray | torch.Tensor


def warp_sigmas(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """Flow-matching time shift s -> shift*s / (1 + (shift-1)*s), in the array's own dtype."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def check_shift(shift: float) -> None:
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift) or shift <= 0:
        raise ValueError(f"shift must be a positive number, got {shift!r}")


def as_sigma_array(sigmas: SigmaList, *, allow_terminal_zero: bool = True) -> np.ndarray:
    """A user's sigma list as a 1-D float array, checked: finite, in [0, 1], strictly falling.

    A trailing 0 (the terminal sigma) is allowed and dropped: samplers append their own. Float32
    tensors stay float32 (the refiner's list is float32 and its timesteps truncate on that).
    """
    if isinstance(sigmas, torch.Tensor):
        arr = sigmas.detach().cpu().numpy()
    elif isinstance(sigmas, np.ndarray):
        arr = sigmas
    else:
        try:
            arr = np.asarray([float(s) for s in sigmas], dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"sigmas must be a list of numbers, got {sigmas!r}") from None
    if arr.dtype.kind != "f":
        arr = arr.astype(np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"sigmas must be a non-empty 1-D list, got shape {tuple(arr.shape)}")
    values = arr.astype(np.float64)
    if not np.all(np.isfinite(values)):
        raise ValueError(f"sigmas must be finite numbers, got {values.tolist()}")
    if np.any(values < 0) or np.any(values > 1):
        raise ValueError(f"sigmas must lie in [0, 1], got {values.tolist()}")
    if values.size > 1 and not np.all(np.diff(values) < 0):
        raise ValueError(f"sigmas must be strictly decreasing, got {values.tolist()}")
    if allow_terminal_zero and values.size > 1 and values[-1] == 0.0:
        arr = arr[:-1]
    if float(arr[-1]) == 0.0:
        raise ValueError("sigmas need at least one value above 0 (the terminal 0 is appended for you)")
    return arr


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

    def options(self) -> dict[str, Any]:
        return {}

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.options() == other.options()  # type: ignore[union-attr]

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.options().items()))))

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"
