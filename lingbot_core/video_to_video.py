"""Video-to-video: an input video (or its latents) re-noised to a point of the sampler's schedule and
sampled from there with the text, the refiner's SDEdit start (`stages.renoise`) with the base DiT.

`strength` (Denoise's `denoise`) picks the point: a `steps`-step run starts at step
`steps - floor(steps * strength)` and runs the rest of the very schedule plain sampling walks. A run
that starts at the schedule's first step starts, as plain sampling does, from the noise alone (the
flow-UniPC grid begins at sigma 0.999, which plain sampling treats as pure noise), so strength 1 leaves
the input unused (not even encoded) and equals plain T2V with the same seed bit for bit; lower
strengths keep more of the input and run fewer steps.

RNG order, one CPU generator seeded with `seed`: (TI2V) the first frame's posterior sample, then the
noise, as plain sampling draws them, so the noise is plain sampling's noise; then the input video's
posterior sample. The denoise stage redraws the first frame's sample from a fresh generator, the
same value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import image as image_ops
from . import sampling, stages
from . import stage_inputs as checks
from .distributed import stage as parallel_stage
from .latents import latent_shape, vae_to_dit
from .placement.door import stage
from .sampling.guidance import StepCallback

__all__ = ["VideoStart", "check_strength", "prepare_video_start", "strength_sigmas", "video_to_video"]


def check_strength(strength: Any) -> float:
    """A strength is a number in (0, 1]."""
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0.0 < float(strength) <= 1.0 \
            or not math.isfinite(float(strength)):
        raise ValueError(f"denoise (video-to-video strength) must be a number in (0, 1], got {str(strength)[:40]}")
    return float(strength)


def steps_run(steps: int, strength: float) -> int:
    """How many of `steps` a run at `strength` takes (the last ones of the schedule)."""
    return min(int(math.floor(steps * strength + 1e-9)), steps)


def strength_sigmas(handle, *, steps: int, shift: float, strength: float, sampler: Any = None) -> list[float]:
    """The tail of the sampler's own `steps`-step schedule a run at `strength` walks (float64 values as
    Python floats, the first being the noise level the input is moved to). Refused in one line for a
    sampler that cannot start part-way, and for a strength that leaves no step."""
    strength = check_strength(strength)
    checks.check_steps(steps)
    method = sampling.get_sampler(sampler)
    method.check(steps=steps, shift=shift)
    if method.grid.__func__ is sampling.Sampler.grid:  # no grid of its own to start part-way along
        raise ValueError(f"the {method.name} sampler walks its own fixed grid from pure noise and cannot start "
                         "part-way: video-to-video (denoise below 1) needs flow_unipc or euler")
    run = steps_run(steps, strength)
    if run < 1:
        raise ValueError(f"denoise {strength:g} of {steps} steps runs no step; raise denoise to at least "
                         f"{1 / steps:.3g} or use more steps")
    if method.uses_scheduler:
        with stage(handle, "scheduler"):
            grid = method.grid(steps=steps, shift=shift, scheduler=handle.component("scheduler"))
    else:
        grid = method.grid(steps=steps, shift=shift)
    return [float(s) for s in np.asarray(grid, dtype=np.float64)[steps - run:]]


@dataclass
class VideoStart:
    """Where a video-to-video run starts (CPU, DiT space)."""

    clean: torch.Tensor | None  # the input's latents (posterior sample, or the latents given); None: unused
    noise: torch.Tensor  # plain sampling's noise for this seed
    initial: torch.Tensor  # renoise(clean, noise, sigmas[0])
    sigmas: list[float]  # the schedule's tail, for denoise(sigmas=...)


def _video_pixels(video: Any, height: int, width: int, num_frames: int) -> torch.Tensor:
    """An IMAGE batch [F,H,W,3] in [0,1] -> (1,3,num_frames,height,width): its first `num_frames` frames,
    resized like a first frame (cover, centre-crop) when their size differs."""
    if not isinstance(video, torch.Tensor) or video.ndim != 4 or video.shape[-1] != 3 or video.shape[0] < 1:
        shape = tuple(video.shape) if isinstance(video, torch.Tensor) else type(video).__name__
        raise ValueError(f"the input video must be frames shaped [F,H,W,3] (an IMAGE batch), got {shape}")
    if video.shape[0] < num_frames:
        raise ValueError(f"the input video has {video.shape[0]} frames and the output {num_frames}; load at least "
                         f"{num_frames} frames or set frames to {(int(video.shape[0]) - 1) // 4 * 4 + 1} or fewer")
    checks.checked_pixels(video, "video", unit_range_only=True)
    frames = video[:num_frames].float().permute(0, 3, 1, 2)  # F,3,H,W
    if tuple(frames.shape[-2:]) != (height, width):
        frames = image_ops.cover_crop(frames, height, width).clamp(0, 1)
    return frames.permute(1, 0, 2, 3).unsqueeze(0).contiguous()


def prepare_video_start(handle, *, height: int, width: int, num_frames: int, steps: int, shift: float,
                        strength: float, seed: int, video: Any = None, latents: torch.Tensor | None = None,
                        sampler: Any = None, image_cond: stages.ImageCondition | None = None,
                        tiling: dict | bool | None = True) -> VideoStart:
    """Encode the input video (tiled by default) or take its DiT-space `latents`, and re-noise it to
    `strength`'s point of the schedule. Everything is checked before the VAE loads."""
    if (video is None) == (latents is None):
        raise ValueError("video-to-video starts from exactly one input: connect a video or a latent")
    stages.validate_geometry(height, width, num_frames)
    checks.check_seed(seed)
    sigmas = strength_sigmas(handle, steps=steps, shift=shift, strength=strength, sampler=sampler)
    shape = latent_shape(height, width, num_frames)
    if latents is not None:
        checks.checked_latents(latents, "latent", shape=shape)
    else:
        pixels = _video_pixels(video, height, width, num_frames)
        checks.check_request_fits(handle, height=height, width=width, num_frames=num_frames, phase="decode",
                                  what="encoding the input video")
    g = torch.Generator("cpu").manual_seed(seed)
    if image_cond is not None:
        image_cond.sample_latent(g)  # plain sampling's first draw: the noise below is its noise
    noise = stages.prepare_latents(shape, g)
    if len(sigmas) == steps:  # the whole schedule: plain sampling's start, the input unused
        return VideoStart(None, noise, noise, sigmas)
    if latents is None:
        if tiling is True:
            tiling = dict(stages.REFINER_TILING)

        def posterior() -> tuple[torch.Tensor, torch.Tensor]:
            with stage(handle, "vae") as device:
                vae = handle.component("vae")
                with stages._vae_tiling(vae, tiling):
                    mean, std = stages._encode_posterior(vae, pixels, device)
                return mean.cpu(), std.cpu()

        # on a parallel view rank 0 runs the VAE and the others receive its posterior
        mean, std = parallel_stage.from_rank0(handle, posterior, lambda got: {"mean": got[0], "std": got[1]},
                                              lambda got: (got["mean"], got["std"]), ("mean", "std"))
        latents = vae_to_dit(mean + std * torch.randn(mean.shape, generator=g), handle.vae_config())
    clean = latents.float()
    return VideoStart(clean, noise, stages.renoise(clean, noise, sigmas[0]), sigmas)


def video_to_video(handle, cond: stages.Conditioning, *, height: int, width: int, num_frames: int,
                   strength: float, seed: int, video: Any = None, latents: torch.Tensor | None = None,
                   steps: int = 40, shift: float = 3.0, sampler: Any = None,
                   image_cond: stages.ImageCondition | None = None, tiling: dict | bool | None = True,
                   callback: StepCallback | None = None, **denoise_options: Any) -> torch.Tensor:
    """Sample from an input video re-noised to `strength` (see the module); returns DiT-space latents.

    `denoise_options` go to `stages.denoise` (guidance_scale, cfg_batch, step_cache, ...).
    """
    start = prepare_video_start(handle, height=height, width=width, num_frames=num_frames, steps=steps,
                                shift=shift, strength=strength, seed=seed, video=video, latents=latents,
                                sampler=sampler, image_cond=image_cond, tiling=tiling)
    return stages.denoise(handle, cond, height=height, width=width, num_frames=num_frames, steps=len(start.sigmas),
                          shift=shift, seed=seed, image_cond=image_cond, latents=start.initial, sigmas=start.sigmas,
                          sampler=sampler, callback=callback, **denoise_options)
