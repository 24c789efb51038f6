"""`dmd_student`: the few-step sampler of DMD-distilled LingBot-Video student checkpoints.

A distilled student only works on the step geometry it was distilled on (upstream LingBot-Video
commit dd5c231, `DMDStudentScheduler`; recipe: 8 steps, guidance 1.0, shift 3.0):

- grid: linspace(1, 1/1000, S+1) without its last point (float64), shift-warped, the first value
  lowered by 1e-6 when it is within 1e-6 of 1; timesteps are the grid * 1000 truncated to int64;
  sigmas the grid plus a terminal 0, as float32.
- step i, in float32 (s = sigmas[i], n = sigmas[i+1], v the flow prediction, z the latent): while
  s >= the high-noise threshold (0.5, on the warped sigma) a DDIM eta-ancestral transition on the
  split x0 = z - s*v, x1 = z + (1-s)*v: z' = x0*(1-n) + x1*sqrt(n^2 - std^2) + std*noise, the
  noise drawn from the run's generator after the DiT forward; below it the Euler step
  z' = z + (n-s)*v, which draws nothing.

The math stays in float32 on purpose: at step 0 the float32 std equals n exactly, so the x1 term
vanishes; float64 leaves ~2e-4 of it and moves the result well outside the reference tolerance.
Custom sigma lists and refiner schedules are refused: the grid is part of what was distilled.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from .base import Sampler, SamplerRun
from .sigmas import SigmaList, check_shift, warp_sigmas

log = logging.getLogger(__name__)

EDGE = 1e-6  # how close to 1 the first sigma may come before it is pulled down by this much


def student_grid(steps: int, shift: float, train_timesteps: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps int64 [S], sigmas float32 [S+1]) of the student's grid."""
    grid = np.linspace(1.0, 1.0 / train_timesteps, int(steps) + 1)[:-1]
    grid = warp_sigmas(grid, float(shift))
    if abs(grid[0] - 1.0) < EDGE:
        grid[0] -= EDGE
    timesteps = torch.from_numpy(grid * train_timesteps).to(torch.int64)
    sigmas = torch.from_numpy(np.concatenate([grid, [0.0]]).astype(np.float32))
    return timesteps, sigmas


def ancestral_std(sigma: torch.Tensor, sigma_next: torch.Tensor, eta: float) -> torch.Tensor:
    """DDIM eta-ancestral noise std for sigma -> sigma_next in flow coordinates (0-dim float32).

    The DDIM variance is taken in the variance-preserving frame of x = (1-s)*x0 + s*eps
    (signal a/sqrt(a^2+b^2), noise b/sqrt(a^2+b^2)) and mapped back; it never exceeds sigma_next.
    """
    keep_now, noise_now = 1.0 - sigma, sigma
    keep_next, noise_next = 1.0 - sigma_next, sigma_next
    norm_now = 1.0 / torch.sqrt(keep_now**2 + noise_now**2)
    norm_next = 1.0 / torch.sqrt(keep_next**2 + noise_next**2)
    signal_ratio = ((keep_now * norm_now) / (keep_next * norm_next + 1e-8)) ** 2
    spread = (1.0 - signal_ratio).clamp(min=0.0)
    std = eta * ((noise_next * norm_next) / (noise_now * norm_now + 1e-8)) * spread.sqrt() / (norm_next + 1e-8)
    return torch.minimum(std, sigma_next)


class _StudentRun(SamplerRun):
    def __init__(self, timesteps, sigmas, record, *, threshold: float, eta: float, generator):
        super().__init__(timesteps, sigmas, record)
        self.threshold = threshold
        self.eta = eta
        self.generator = generator
        if record:
            self.trace.update(std=[], noise=[], noise_steps=[])

    def step(self, model_output: torch.Tensor, index: int, latents: torch.Tensor) -> torch.Tensor:
        v = model_output.float()
        z = latents.float()
        s = self.sigmas[index].to(z.device)
        n = self.sigmas[index + 1].to(z.device)
        if float(s) < self.threshold:
            if self.record:
                self.trace["std"].append(torch.zeros((), dtype=torch.float32))
            return z + v * (n - s)
        std = ancestral_std(s, n, self.eta)
        x0 = z - s * v
        x1 = z + v * (1 - s)
        noise = torch.randn(tuple(v.shape), generator=self.generator, dtype=torch.float32,
                            device=self.generator.device if self.generator is not None else "cpu").to(z.device)
        if self.record:
            self.trace["std"].append(std.detach().cpu())
            self.trace["noise"].append(noise.detach().cpu().clone())
            self.trace["noise_steps"].append(index)
        return x0 * (1 - n) + x1 * torch.sqrt(n**2 - std**2) + std * noise


class DMDStudentSampler(Sampler):
    name = "dmd_student"
    recommended = dict(steps=8, guidance_scale=1.0, shift=3.0)

    def __init__(self, *, high_noise_threshold: float = 0.5, ddim_eta: float = 1.0, num_train_timesteps: int = 1000):
        if not 0.0 <= float(high_noise_threshold) <= 1.0:
            raise ValueError(f"high_noise_threshold must lie in [0, 1], got {high_noise_threshold!r}")
        if not 0.0 <= float(ddim_eta) <= 1.0:
            raise ValueError(f"ddim_eta must lie in [0, 1], got {ddim_eta!r}")
        if isinstance(num_train_timesteps, bool) or int(num_train_timesteps) != num_train_timesteps \
                or num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be a positive integer, got {num_train_timesteps!r}")
        self.high_noise_threshold = float(high_noise_threshold)
        self.ddim_eta = float(ddim_eta)
        self.num_train_timesteps = int(num_train_timesteps)

    def options(self) -> dict[str, Any]:
        return dict(high_noise_threshold=self.high_noise_threshold, ddim_eta=self.ddim_eta,
                    num_train_timesteps=self.num_train_timesteps)

    def check(self, *, steps: int, shift: float, sigmas: SigmaList | None = None, refine: bool = False) -> None:
        check_shift(shift)
        if refine:
            raise ValueError("the dmd_student sampler cannot run the refiner: the refiner's schedule starts at "
                             "t_thresh, and the student's grid is fixed by its distillation. Refine with "
                             "flow_unipc (the refiner is not a student model)")
        if sigmas is not None:
            raise ValueError("the dmd_student sampler has a fixed sigma grid (the one the student was distilled "
                             "on) and does not take custom sigmas; clear the sigmas, or use the euler sampler")

    def start(self, *, steps: int, shift: float, sigmas: SigmaList | None, device: torch.device,
              generator: torch.Generator | None, scheduler: Any = None, record: bool = False) -> SamplerRun:
        self.check(steps=steps, shift=shift, sigmas=sigmas)
        timesteps, table = student_grid(steps, shift, self.num_train_timesteps)
        return _StudentRun(timesteps.to(device), table, record, threshold=self.high_noise_threshold,
                           eta=self.ddim_eta, generator=generator)
