"""`euler`: the first-order flow-matching ODE step x <- x + (sigma_next - sigma) * v.

The default grid is linspace(1, 0, S+1) without its last point, shift-warped, then 0: for 4 steps
at shift 3 that is [1.0, 0.9, 0.75, 0.5, 0], the grid the LightLingBot-Video 4-step LoRA was
trained and validated on (LightX2V's training-time validation and mirai's distilled profile).
A custom sigma list is used exactly as given (shift does not apply to it); a terminal 0 is
appended when missing. The DiT sees timestep = sigma * 1000 (no integer truncation).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .base import Sampler, SamplerRun
from .sigmas import SigmaList, as_sigma_array, warp_sigmas

TRAIN_TIMESTEPS = 1000


def euler_sigmas(steps: int, shift: float) -> np.ndarray:
    """The default grid (float64, without the terminal 0)."""
    return warp_sigmas(np.linspace(1.0, 0.0, int(steps) + 1)[:-1], float(shift))


class _EulerRun(SamplerRun):
    def step(self, model_output: torch.Tensor, index: int, latents: torch.Tensor) -> torch.Tensor:
        v = model_output.float()
        z = latents.float()
        s = self.sigmas[index].to(z.device)
        n = self.sigmas[index + 1].to(z.device)
        return z + v * (n - s)


class EulerSampler(Sampler):
    name = "euler"
    recommended = None

    def grid(self, *, steps: int, shift: float, scheduler: Any = None) -> np.ndarray:
        return euler_sigmas(steps, shift)

    def start(self, *, steps: int, shift: float, sigmas: SigmaList | None, device: torch.device,
              generator: torch.Generator | None, scheduler: Any = None, record: bool = False) -> SamplerRun:
        grid = euler_sigmas(steps, shift) if sigmas is None else as_sigma_array(sigmas).astype(np.float64)
        table = torch.from_numpy(np.concatenate([grid, [0.0]]).astype(np.float32))
        timesteps = (table[:-1] * TRAIN_TIMESTEPS).to(device)
        return _EulerRun(timesteps, table, record)
