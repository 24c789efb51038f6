"""Does a module hold FSDP shards? The one test the DiT's own `to` (which moves a sharded DiT outside
inference mode) and the offload modes (which leave a sharded component where FSDP put it) both ask.

FSDP2's `fully_shard` gives a module a class named ``FSDP<its class>`` and DTensor parameters; FSDP1
wraps it in ``FullyShardedDataParallel``. No DTensor exists before `torch.distributed.tensor` is
imported, so the test never imports it (the pack's start stays light).
"""

from __future__ import annotations

import sys

import torch

__all__ = ["is_sharded"]


def is_sharded(module: torch.nn.Module) -> bool:
    """True when `module` (or a module inside it) is FSDP-wrapped or holds DTensor parameters."""
    if any(type(m).__name__.startswith("FSDP") or type(m).__name__ == "FullyShardedDataParallel"
           for m in module.modules()):
        return True
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and any(isinstance(p, dtensor) for p in module.parameters())
