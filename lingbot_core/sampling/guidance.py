"""The model side of one denoise step: the DiT's flow prediction at the current latents, guided.

`Guidance` wraps the DiT, the prompt embeddings and the guidance scale for one Denoise call;
`predict(latents, timestep)` returns the float32 guided velocity the sampler steps with.
`sample()` is the loop every Denoise and Refine runs: predict, step, pin the first frame, report.

Classifier-free guidance is v = v_uncond + scale * (v_cond - v_uncond). By default it takes two DiT
forwards per step (the reference's default). With `batch_cfg` both branches run as one batch-2
forward: the two prompts are right-padded to one length and the padding is masked out of attention
(the DiT's padded-batch path), so quantized weights are decoded and offloaded weights moved once per
step instead of twice, for about twice the activation memory. Batched results equal the two-forward
ones up to float rounding (a different matmul/softmax reduction order): measured max |diff| below
1e-5 of the output scale in float32 (tests/test_guidance.py), bf16 rounding in bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from .base import SamplerRun
from .sigmas import transformer_timestep
from .step_cache import StepCache

StepCallback = Callable[[int, int, torch.Tensor], None]

__all__ = ["CFG_BATCH", "Guidance", "StepCallback", "pad_pair", "pin_first_frames", "sample"]

#: the `cfg_batch` choices of Denoise/Refine: `auto` batches when the memory estimate says it fits
CFG_BATCH = ("off", "on", "auto")


def pad_pair(positive: Any, negative: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The two prompts as one batch: (2, L, D) embeddings right-padded with zeros, and the (2, L) mask
    (1 = real token) that keeps the padding out of attention. L is the longer prompt's length."""
    length = max(positive.embeds.shape[1], negative.embeds.shape[1])

    def padded(prompt: Any) -> tuple[torch.Tensor, torch.Tensor]:
        missing = length - prompt.embeds.shape[1]
        embeds = torch.nn.functional.pad(prompt.embeds, (0, 0, 0, missing))
        mask = torch.nn.functional.pad(prompt.mask.to(torch.int64), (0, missing))
        return embeds, mask

    (e_pos, m_pos), (e_neg, m_neg) = padded(positive), padded(negative)
    return torch.cat((e_pos, e_neg)), torch.cat((m_pos, m_neg))


class Guidance:
    """The guided flow prediction of one DiT for one Denoise call (no state carried between steps).

    `positive` and `negative` are `PromptEmbeds` already on the execution device in the DiT's dtype;
    `negative` None means no CFG (one forward per step).
    """

    def __init__(self, dit: torch.nn.Module, positive: Any, negative: Any | None, scale: float, *,
                 dtype: torch.dtype, device: torch.device, batch_cfg: bool = False, cache: StepCache | None = None):
        self.dit, self.scale, self.cache = dit, scale, cache
        self.positive, self.negative = positive, negative
        self.dtype, self.device = dtype, device
        self.batch_cfg = bool(batch_cfg and negative is not None)
        self._pair = pad_pair(positive, negative) if self.batch_cfg else None
        half = dtype in (torch.bfloat16, torch.float16)
        self._autocast = (lambda: torch.autocast("cuda", dtype=dtype)) if device.type == "cuda" and half else nullcontext

    def timestep(self, t: torch.Tensor) -> torch.Tensor:
        """The (1,) float32 timestep the DiT sees for scheduler timestep `t`."""
        return transformer_timestep(t, self.dtype).reshape(1).to(self.device)

    def _branch(self, name: str):
        return self.cache.branch(name) if self.cache is not None else nullcontext()

    def forward(self, latents: torch.Tensor, t_dit: torch.Tensor, prompt: Any, branch: str = "cond") -> torch.Tensor:
        """One DiT forward for one prompt, as float32 (`branch`: whose step-cache state it uses)."""
        with self._branch(branch):
            return self.dit(latents, t_dit, prompt.embeds, prompt.mask, return_dict=False)[0].float()

    def predict(self, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The guided velocity at `latents` for scheduler timestep `t` (float32)."""
        t_dit = self.timestep(t)
        with torch.no_grad(), self._autocast():
            if self.batch_cfg:
                v, v_uncond = self.forward_pair(latents, t_dit)
            else:
                v = self.forward(latents, t_dit, self.positive)
                if self.negative is None:
                    return v
                v_uncond = self.forward(latents, t_dit, self.negative, "uncond")
            return v_uncond + self.scale * (v - v_uncond)

    def forward_pair(self, latents: torch.Tensor, t_dit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both branches in one batch-2 forward: (v_cond, v_uncond), float32, each batch 1."""
        embeds, mask = self._pair
        with self._branch("pair"):
            both = self.dit(torch.cat((latents, latents)), t_dit, embeds, mask, return_dict=False)[0].float()
        return both[:1], both[1:]


def pin_first_frames(latents: torch.Tensor, cond_latent: torch.Tensor | None) -> torch.Tensor:
    """Write the clean first-frame condition into the leading latent frames (in place)."""
    if cond_latent is not None:
        latents[:, :, : cond_latent.shape[2]] = cond_latent
    return latents


def sample(run: SamplerRun, guidance: Guidance, latents: torch.Tensor, *, cond_latent: torch.Tensor | None = None,
           callback: StepCallback | None = None, status: Any = None) -> torch.Tensor:
    """Walk `run`'s schedule from `latents`: predict, step, pin the first frame, report each step.

    A step cache (`guidance.cache`) is attached to the DiT for this loop only, and finished
    (calibration written) only when the loop completes. `status` (on several processes:
    `distributed.abort.StepStatus`) hears after every step, outside the forward, whether this rank
    finished it (`passed`) or raised (`failed`), so a failing rank stops the others; an error inside
    the forward (the others wait in its collectives) becomes what `status.broken` returns."""
    total = len(run.timesteps)
    cache = guidance.cache
    with cache.attached(guidance.dit) if cache is not None else nullcontext(), \
            status.watching() if status is not None else nullcontext():
        for i, t in enumerate(run.timesteps):
            try:
                v = guidance.predict(latents, t)
            except BaseException as err:
                if status is None:
                    raise
                stop = status.broken(i + 1, err)
                if stop is err:
                    raise
                raise stop from err
            try:
                latents = pin_first_frames(run.step(v, i, latents), cond_latent)
                if callback is not None:
                    callback(i + 1, total, latents)
            except BaseException as err:
                if status is not None:
                    status.failed(i + 1, err)
                raise
            if status is not None:
                status.passed(i + 1)
    if cache is not None:
        cache.finish()
    return latents
