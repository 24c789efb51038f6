"""The entry point for running one denoise on several processes: `parallel_denoise`.

Call it on every rank of the layout with the same inputs (the same starting latents, conditioning,
schedule and seed); every rank returns the same final latents, so rank 0 (or any) keeps them.
It is the `denoise` stage on a parallel view of the handle (`PipelineHandle.with_parallel`), so a
workflow, a worker process and a test all run the one code path; a bare DiT is wrapped in a
handle of its own first.
"""

from __future__ import annotations

import torch

from ..components import TRANSFORMER
from ..distributed.layout import ParallelLayout
from ..errors import RefusedInput
from ..handle import PipelineHandle
from ..latents import VAE_SPATIAL, VAE_TEMPORAL
from ..sampling.guidance import StepCallback
from ..sampling.step_cache import StepCacheSettings
from ..stages import Conditioning, denoise

__all__ = ["geometry_of", "parallel_denoise", "wrap_dit"]


def geometry_of(latents: torch.Tensor) -> tuple[int, int, int]:
    """(height, width, num_frames) of the video that DiT-space `latents` (1, C, T, h, w) stand for."""
    if latents.ndim != 5:
        raise RefusedInput(f"latents must be shaped (1, C, T, h, w), got {tuple(latents.shape)}")
    t, h, w = latents.shape[2:]
    return int(h) * VAE_SPATIAL, int(w) * VAE_SPATIAL, (int(t) - 1) * VAE_TEMPORAL + 1


def wrap_dit(dit: torch.nn.Module, *, transformer: str = TRANSFORMER,
             device: str | torch.device = "cpu") -> PipelineHandle:
    """A handle over one DiT already in memory (and a default flow-UniPC scheduler), for callers that
    hold a DiT and no checkpoint (a worker, a test). `transformer`: "transformer" or "refiner"."""
    from ..scheduler import FlowUniPCScheduler

    return PipelineHandle.from_components({transformer: dit, "scheduler": FlowUniPCScheduler()}, device=device)


def parallel_denoise(
    handle_or_dit: PipelineHandle | torch.nn.Module,
    layout: ParallelLayout,
    latents: torch.Tensor,
    cond: Conditioning,
    sigmas: torch.Tensor | None = None,
    seed: int = 0,
    *,
    steps: int | None = None,
    guidance_scale: float = 3.0,
    shift: float = 3.0,
    transformer: str = TRANSFORMER,
    sampler: str | None = None,
    cond_latent: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    callback: StepCallback | None = None,
    step_cache: str | StepCacheSettings = "off",
) -> torch.Tensor:
    """Denoise `latents` on the processes of `layout`; the final DiT-space latents (float32, CPU).

    - `handle_or_dit`: a `PipelineHandle` (its offload mode must be `none`) or a bare LingBot DiT.
    - `layout`: from `ParallelLayout.create(cfg, ulysses)` on every rank (or `.single()`: this
      process alone, exactly the `denoise` stage).
    - `latents`: the starting DiT-space latents (1, 16, T, h, w), e.g. the noise drawn from the seed
      (`stages.prepare_latents`) or the refiner's re-noised start; the video size follows from them.
    - `cond`: `stages.Conditioning` (CPU); a negative is needed when `guidance_scale` > 1.
    - `sigmas`: an explicit schedule (used as given, as the refiner does), or None for `steps`
      (default 40) with `shift`.
    - `seed`: seeds the generator stochastic samplers draw from (ignored when `generator` is given).
    - `transformer`: "transformer" (the base DiT) or "refiner".
    `callback(step, total, latents)` runs on every rank after every step. `step_cache`: as for the
    `denoise` stage (every rank of a ulysses group decides alike; each cfg row keeps its branch's state).
    """
    handle = handle_or_dit if isinstance(handle_or_dit, PipelineHandle) else wrap_dit(handle_or_dit,
                                                                                      transformer=transformer)
    height, width, num_frames = geometry_of(latents)
    if steps is None:
        steps = len(sigmas) if sigmas is not None else 40
    view = handle.with_parallel(layout)
    return denoise(view, cond, height=height, width=width, num_frames=num_frames, steps=steps,
                   guidance_scale=guidance_scale, shift=shift, seed=seed, generator=generator,
                   cond_latent=cond_latent, latents=latents, sigmas=sigmas, transformer=transformer,
                   callback=callback, sampler=sampler, step_cache=step_cache)
