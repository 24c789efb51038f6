"""What a view asks of placement: the offload mode, its options, and the checks that refuse bad asks.

A leaf: it imports nothing of ours, so the handle, the modes and the door can all depend on it.
The modes themselves, their names, order and options are the registry in `modes/` (a new mode is
one file there); only `auto`, which is not a mode class, has its options here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

AUTO = "auto"
OFFLOAD_TO = ("ram", "disk")
MODULE_COMPONENTS = ("text_encoder", "transformer", "refiner", "vae")
"""Components that are nn.Modules placement manages (the processor and scheduler are not placed)."""

AUTO_OPTIONS = frozenset({"height", "width", "num_frames", "cfg", "refine", "release_base", "vae_tiling",
                          "rewrite_tokens", "budget_bytes", "host_budget_bytes"})
"""What `auto` plans for, and (tests, simulations) the accelerator and host memory to plan within."""
CPU = torch.device("cpu")


@dataclass(frozen=True)
class OffloadSettings:
    """How a view wants components placed while its stages run.

    `offload_to` names the CPU-side home of offloaded weights: `ram` (a copy in host memory) or
    `disk` (the DiTs' checkpoint files themselves, read with plain reads when a unit computes:
    `weights.disk`). Modes never copy a home they were given: they move the stored tensors (whatever
    their dtype or subclass) to the device and rebind them to their home afterwards.
    """

    mode: str = "none"
    options: tuple[tuple[str, Any], ...] = ()
    offload_to: str = "ram"

    @classmethod
    def make(cls, mode: str, offload_to: str = "ram", **options: Any) -> OffloadSettings:
        return cls(mode, tuple(sorted(options.items())), offload_to)

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Do `a` and `b` name one device? Every CPU is the CPU; `cuda` without an index is the current CUDA
    device (`torch.cuda.set_device`: under torchrun, the local rank's GPU, where a handle opened on `cuda`
    puts its weights), so on rank 1 `cuda` and `cuda:1` are one device and `cuda:0` another."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    return a.type == "cpu" or device_index(a) == device_index(b)


def device_index(device: torch.device) -> int:
    """The index of an accelerator device, an unindexed `cuda` read as the current CUDA device's."""
    if device.index is not None:
        return device.index
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.current_device()
    return 0


