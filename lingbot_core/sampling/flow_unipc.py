"""`flow_unipc`: the checkpoint's flow-matching UniPC scheduler (the reference default).

This only adapts `lingbot_core.scheduler.FlowUniPCScheduler` (the handle's `scheduler` component,
built from the checkpoint's scheduler_config.json) to the sampler interface; the solver itself
lives there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .base import Sampler, SamplerRun
from .sigmas import SigmaList, as_sigma_array


class _UniPCRun(SamplerRun):
    def __init__(self, scheduler: Any, record: bool):
        super().__init__(scheduler.timesteps, scheduler.sigmas, record)
        self._scheduler = scheduler

    def step(self, model_output: torch.Tensor, index: int, latents: torch.Tensor) -> torch.Tensor:
        return self._scheduler.step(model_output, self.timesteps[index], latents)


class FlowUniPCSampler(Sampler):
    name = "flow_unipc"
    uses_scheduler = True

    def grid(self, *, steps: int, shift: float, scheduler: Any = None) -> np.ndarray:
        if scheduler is None:
            raise ValueError("flow_unipc samples with the checkpoint's scheduler; none was given")
        return scheduler.sigma_grid(steps, shift)

    def start(self, *, steps: int, shift: float, sigmas: SigmaList | None, device: torch.device,
              generator: torch.Generator | None, scheduler: Any = None, record: bool = False) -> SamplerRun:
        if scheduler is None:
            raise ValueError("flow_unipc samples with the checkpoint's scheduler; none was given")
        if sigmas is None:
            scheduler.set_timesteps(steps, device=device, shift=shift)
        else:
            grid = as_sigma_array(sigmas)
            scheduler.set_timesteps(len(grid), device=device, sigmas=grid, shift=1.0)
        return _UniPCRun(scheduler, record)
