"""Ulysses sequence parallel for the LingBot DiT: one forward shared by the ranks of a group.

After the embeddings (which every rank computes whole: they are cheap) the joint
[video; text] sequence is right-padded to a multiple of the degree P and cut once into P
contiguous chunks, one per rank, together with its rotary rotations. Every block then runs on the
local chunk; only attention needs the whole sequence, so around it an `all_to_all_single` turns
(chunk of the sequence, all heads) into (whole sequence, 1/P of the heads), attention runs with the
whole key mask, and a second all-to-all turns it back. After the last block the chunks are
gathered and the padding cut off, so the output norm and projection see the one-process sequence.

Every other layer (norms, modulation, FFN, the MoE router and experts) works token by token, so a
token's result does not depend on which rank holds it: the MoE routes each token exactly as it
would in one process. Padding tokens are zeros with identity rotations, and the key mask keeps
them out of every real token's attention.

It is installed as two named hooks of `lingbot_core.hooks` (the one registry every behaviour on a
module goes through: listed, counted and removed like the offload and step-cache hooks), so the model code
is untouched and nothing changes when the degree is 1: one on the DiT hands `forward` a block
runner that shards and gathers, and one per attention module swaps its forward for the
all-to-all version. Diffusers' own context-parallel machinery is not used because it plans around
modules that pass a `parallel_config` to `dispatch_attention_fn`, which our attention does not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import hooks
from ..models.rotary import rotate_pairs
from ..models.transformer import LingBotVideoTransformer3DModel, SelfAttention, attend
from .layout import ParallelLayout

__all__ = ["ATTENTION_HOOK", "DIT_HOOK", "disable_sequence_parallel", "enable_sequence_parallel",
           "heads_to_sequence", "sequence_to_heads"]

DIT_HOOK = "lingbot.ulysses"
ATTENTION_HOOK = "lingbot.ulysses_attention"


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    """all_to_all_single over dim 0 (P equal pieces): piece j goes to rank j, piece j back from it."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after .contiguous(): empty_like keeps a permuted input's strides
    dist.all_to_all_single(out, x, group=group)
    return out


def sequence_to_heads(x: torch.Tensor, degree: int, group: Any) -> torch.Tensor:
    """(B, S/P, H, D) local chunk, all heads -> (B, S, H/P, D) whole sequence, this rank's heads."""
    b, chunk, heads, d = x.shape
    pieces = x.reshape(b, chunk, degree, heads // degree, d).permute(2, 0, 1, 3, 4)  # (P, B, S/P, H/P, D)
    got = _exchange(pieces, group)  # got[j] = rank j's chunk, our head group
    return got.permute(1, 0, 2, 3, 4).reshape(b, degree * chunk, heads // degree, d)


def heads_to_sequence(x: torch.Tensor, degree: int, group: Any) -> torch.Tensor:
    """Inverse of `sequence_to_heads`: (B, S, H/P, D) -> (B, S/P, H, D)."""
    b, seq, part, d = x.shape
    pieces = x.reshape(b, degree, seq // degree, part, d).permute(1, 0, 2, 3, 4)  # (P, B, S/P, H/P, D)
    got = _exchange(pieces, group)  # got[j] = our chunk, rank j's head group
    return got.permute(1, 2, 0, 3, 4).reshape(b, seq // degree, degree * part, d)


@hooks.named(ATTENTION_HOOK, "sequence parallel: attention over the whole sequence with all-to-alls around it")
class _AttentionHook(hooks.Hook):
    """Replaces a `SelfAttention` forward by: project, rotate, all-to-all, attend, all-to-all, project."""

    def __init__(self, layout: ParallelLayout):
        super().__init__()
        self.degree = layout.ulysses
        self.group = layout.ulysses_group

    def new_forward(self, module: SelfAttention, x: torch.Tensor, rotations: torch.Tensor,
                    key_mask: torch.Tensor | None) -> torch.Tensor:
        q = rotate_pairs(module.norm_q(module.to_q(x).unflatten(-1, module.heads)), rotations)
        k = rotate_pairs(module.norm_k(module.to_k(x).unflatten(-1, module.heads)), rotations)
        v = module.to_v(x).unflatten(-1, module.heads)
        q, k, v = (sequence_to_heads(t, self.degree, self.group) for t in (q, k, v))
        mixed = attend(q, k, v, key_mask, module.backend, layer=module.layer)  # a fast backend by trial (models/transformer.py)
        mixed = heads_to_sequence(mixed, self.degree, self.group)
        return module.to_out(mixed.flatten(-2).type_as(x))


@hooks.named(DIT_HOOK, "sequence parallel: the DiT's blocks run on this rank's share of the sequence")
class _ShardingHook(hooks.Hook):
    """Hands the DiT's forward a block runner that shards the joint sequence and gathers it back."""

    def __init__(self, layout: ParallelLayout):
        super().__init__()
        self.degree = layout.ulysses
        self.index = layout.ulysses_rank
        self.group = layout.ulysses_group

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        inner = kwargs.get("block_runner")  # a step cache's runner: it runs on this rank's share
        kwargs["block_runner"] = self.run if inner is None else functools.partial(self.run, inner=inner)
        return args, kwargs

    def run(self, blocks: torch.nn.ModuleList, x: torch.Tensor, temb6: torch.Tensor, rotations: torch.Tensor,
            key_mask: torch.Tensor | None, inner: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """Shard the joint sequence, run the blocks on this rank's share (through `inner`, a step cache's
        runner, when given: it must decide alike on every rank, see `distributed.stage.share_step_cache`),
        gather it back."""
        batch, seq = x.shape[:2]
        pad = -seq % self.degree
        chunk = (seq + pad) // self.degree
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
            identity = torch.ones(batch, pad, rotations.shape[-1], dtype=rotations.dtype, device=rotations.device)
            rotations = torch.cat((rotations, identity), dim=1)
            keys = key_mask if key_mask is not None else torch.ones(batch, 1, 1, seq, dtype=torch.bool, device=x.device)
            key_mask = F.pad(keys, (0, pad), value=False)
        mine = slice(self.index * chunk, (self.index + 1) * chunk)
        local = x[:, mine].contiguous()
        local_rotations = rotations[:, mine].contiguous()
        if inner is not None:  # it must not count this share's padding rows: `real_tokens`
            real = max(0, min(chunk, seq - self.index * chunk))
            local = inner(blocks, local, temb6, local_rotations, key_mask, real_tokens=real)
        else:
            for block in blocks:
                local = block(local, temb6, local_rotations, key_mask)
        chunks = [torch.empty_like(local) for _ in range(self.degree)]
        dist.all_gather(chunks, local, group=self.group)
        return torch.cat(chunks, dim=1)[:, :seq]


def enable_sequence_parallel(dit: LingBotVideoTransformer3DModel, layout: ParallelLayout) -> None:
    """Make `dit`'s forward share its sequence over `layout`'s ulysses group (a no-op for degree 1).

    Every rank of the group must then call the DiT with the same inputs; each returns the whole
    output. Installing twice replaces the previous installation.
    """
    disable_sequence_parallel(dit)
    if layout.ulysses == 1:
        return
    layout.check_heads(dit.spec.num_attention_heads)
    for sub in dit.modules():
        if isinstance(sub, SelfAttention):
            hooks.attach(sub, _AttentionHook(layout))
    hooks.attach(dit, _ShardingHook(layout))


def disable_sequence_parallel(dit: torch.nn.Module) -> None:
    """Remove what `enable_sequence_parallel` installed (nothing else); the model runs on one process again."""
    for sub in dit.modules():
        for name in (DIT_HOOK, ATTENTION_HOOK):
            hooks.detach(sub, name)
