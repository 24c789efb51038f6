"""CFG parallel: the conditional and unconditional DiT forwards of one step on two rank rows.

Row 0 of the layout computes the prediction for the positive prompt, row 1 for the negative one;
an `all_gather` over the cfg group (the two ranks that hold the same sequence chunk) gives every
rank both, and each combines them with `Guidance`'s formula, so all ranks step the same latents.
With a ulysses degree above 1 each row's forward is itself sequence-parallel (see `ulysses.py`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import RefusedInput
from ..sampling.guidance import Guidance
from .layout import ParallelLayout

__all__ = ["ParallelGuidance"]


class ParallelGuidance(Guidance):
    """`Guidance` whose two branches run on the two cfg rows of `layout` (cfg degree 2).

    Takes `Guidance`'s arguments plus the layout; `batch_cfg` is refused (the one-device way of doing
    the same). A step cache keeps one branch's state per row: row 0 the conditional branch's, row 1
    the unconditional one's, as one process keeps both. Without a negative prompt every rank computes
    the one conditional forward.
    """

    def __init__(self, dit: torch.nn.Module, positive: Any, negative: Any | None, scale: float, *,
                 layout: ParallelLayout, **kwargs: Any):
        if layout.cfg != 2:
            raise RefusedInput(f"CFG parallel needs a layout with cfg=2 (got {layout.describe()})")
        if kwargs.get("batch_cfg"):
            raise RefusedInput("CFG parallel and batch_cfg are two ways of doing the same; pick one")
        super().__init__(dit, positive, negative, scale, **kwargs)
        self.layout = layout

    def predict(self, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if self.negative is None:
            return super().predict(latents, t)
        t_dit = self.timestep(t)
        mine, branch = (self.positive, "cond") if self.layout.cfg_rank == 0 else (self.negative, "uncond")
        with torch.no_grad(), self._autocast():
            v_mine = self.forward(latents, t_dit, mine, branch).contiguous()
            both = [torch.empty_like(v_mine) for _ in range(2)]
            dist.all_gather(both, v_mine, group=self.layout.cfg_group)
            v, v_uncond = both
            return v_uncond + self.scale * (v - v_uncond)
