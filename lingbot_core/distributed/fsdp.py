"""FSDP2 for a parallel run's DiTs: each block's weights sharded over every rank, for memory.

`shard_dit` applies torch's `fully_shard` to every `JointBlock` over a one-dimensional mesh of the
whole world: each rank keeps 1/N of a block's bulk weights, and a block's forward all-gathers them
just before it runs and frees them after (`reshard_after_forward`). The float32 set of the model
(`models.precision.FLOAT32_NAMES`: norm gains, modulation tables, the MoE router) stays whole on
every rank (`ignored_params`), as does everything outside the blocks (embedders, output norm and
projection), which is small.

The ranks of a cfg=2 layout run different prompts but the same blocks in the same order, and the
ranks of a ulysses group run the same blocks on their sequence chunks, so every rank reaches every
block's all-gather together. Sharding is one-way: a sharded DiT stays sharded until it is released
(the next load is whole again). It is refused for packed weights (fp8 / GGUF tensor subclasses,
which DTensor cannot wrap) and under every offload mode but `none` (the offload modes move whole
tensors between host and device; a shard is not theirs to move).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import RefusedInput
from ..models.precision import stays_float32
from .layout import ParallelLayout

__all__ = ["ShardPlan", "check_shardable", "is_fsdp_sharded", "shard_dit", "shard_plan"]


class ShardPlan:
    """What `shard_dit` does to a DiT: per block, the parameter names it shards and those it keeps whole."""

    def __init__(self, dit: torch.nn.Module):
        self.blocks: list[tuple[str, list[str], list[str]]] = []
        for index, block in enumerate(dit.blocks):
            sharded, whole = [], []
            for name, _ in block.named_parameters():
                (whole if stays_float32(name) else sharded).append(name)
            self.blocks.append((f"blocks.{index}", sharded, whole))
        blocks = {id(p) for block in dit.blocks for p in block.parameters()}
        self.outside = [name for name, p in dit.named_parameters() if id(p) not in blocks]

    def bytes(self, dit: torch.nn.Module) -> tuple[int, int]:
        """(bytes sharded, bytes kept whole on every rank) of `dit`'s parameters under this plan."""
        sizes = {name: p.numel() * p.element_size() for name, p in dit.named_parameters()}
        sharded = sum(sizes[f"{block}.{name}"] for block, names, _ in self.blocks for name in names)
        return sharded, sum(sizes.values()) - sharded


def shard_plan(dit: torch.nn.Module) -> ShardPlan:
    return ShardPlan(dit)


def is_fsdp_sharded(dit: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in dit.parameters())


def check_shardable(dit: torch.nn.Module) -> None:
    """Refuse a DiT whose block weights are not plain tensors (fp8 / GGUF packed weights)."""
    for block in dit.blocks:
        for name, p in block.named_parameters():
            if type(p.data) is not torch.Tensor and not stays_float32(name):
                raise RefusedInput(f"FSDP cannot shard the packed weight {name} ({type(p.data).__name__}): load the "
                                 "DiT with plain (bf16) weights for an FSDP run, or run without FSDP")


def shard_dit(dit: torch.nn.Module, layout: ParallelLayout) -> bool:
    """Shard `dit`'s blocks over every rank of `layout` (see the module text); True if this call sharded
    it, False if it was sharded already or the world is one process. Every rank must call it."""
    if layout.world_size == 1 or is_fsdp_sharded(dit):
        return False
    check_shardable(dit)
    from torch.distributed.fsdp import fully_shard

    mesh = layout.world_mesh()
    with torch.inference_mode(False):  # shards that are no inference tensors: see `models.transformer`'s `to`
        for block in dit.blocks:
            whole = {p for name, p in block.named_parameters() if stays_float32(name)}
            fully_shard(block, mesh=mesh, reshard_after_forward=True, ignored_params=whole)
            block.register_forward_hook(_reshard)  # after FSDP's own post-forward hook: see `_reshard`
    return True


def _reshard(block: torch.nn.Module, _inputs: Any, output: Any) -> Any:
    """After a sharded block's forward: its whole weights freed, its shards registered again.

    Every block is sharded on its own (no FSDP module above it), so each is a root to FSDP, and torch
    2.7's FSDP never reshards a root after its forward (`reshard_after_forward` is dropped for roots, a
    training optimisation; later torch keeps an explicit True). There, after one step every rank held
    the whole DiT (the memory FSDP is there to save) and the next denoise sharded it again, which
    `fully_shard` refuses. Where FSDP resharded already this does nothing."""
    block.reshard()
    return output


def describe(dit: Any) -> str:
    plan = ShardPlan(dit)
    sharded, whole = plan.bytes(dit)
    return f"{len(plan.blocks)} blocks sharded ({sharded / 2**20:,.1f} MiB), {whole / 2**20:,.1f} MiB whole on every rank"
