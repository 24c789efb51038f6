"""`offload_to="disk"`: the DiTs stream from their checkpoint files; other components as the mode says.

A wrapper around any offloading mode. For the transformer and refiner it installs
`weights.disk.DiskStreaming` (no host copy: a unit's tensors are read from the file right before it
computes and dropped after; `model` streams the whole DiT, `group` one block, `sequential` one
layer), and hands every other component to the wrapped mode. Uninstalling (a release, a switch, a
suspension for a LoRA) never reads the streamed tensors back: they stay on `meta` until a RAM-homed
mode installs (`Mode.install` materializes them) or a LoRA merges into some (it reads only those).

`streams_from_disk` is the one answer to "will this component's weights live in its file?": the
door asks it before loading a component, so a DiT that will stream is loaded with its stored
tensors left in the file (`load_dit(streamed=True)`) instead of read and then dropped.
"""

from __future__ import annotations

from typing import Any

import torch

from ...components import DITS
from ..settings import CPU


def streams_from_disk(settings: Any, name: str) -> bool:
    """Do `settings` (concrete: `auto` resolved) make `name`'s CPU home its checkpoint file?"""
    if name not in DITS or settings.offload_to != "disk":
        return False
    from . import disk_unit

    return disk_unit(settings.mode) is not None


class DiskBacked:
    def __init__(self, inner: Any):
        self.inner = inner
        self.streams: dict[str, Any] = {}

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    @property
    def homes(self) -> dict[str, Any]:
        return {**self.inner.homes, **self.streams}

    def install(self, name: str, module: Any) -> None:
        if name in DITS and isinstance(module, torch.nn.Module):
            from ...weights.disk import DiskStreaming

            if any(t.device.type not in ("cpu", "meta") for t in module.parameters()):
                module.to(CPU)  # built or loaded on the device: its home is the CPU (and the file)
            self.streams[name] = DiskStreaming(module, self.inner.state(name, module), self.inner.device,
                                               self.inner.disk_unit)
            return
        self.inner.install(name, module)

    def acquire(self, name: str, module: Any) -> None:
        if name not in self.streams:
            self.inner.acquire(name, module)

    def settle(self, name: str, module: Any) -> None:
        if name in self.streams:
            self.streams[name].settle()  # a forward that failed half way leaves no unit loaded
        else:
            self.inner.settle(name, module)

    def uninstall(self, name: str, module: Any) -> None:
        stream = self.streams.pop(name, None)
        if stream is not None:
            # hooks off; the streamed tensors stay in the file until a RAM-homed mode takes the DiT
            # (`Mode.install` reads them) or a LoRA merges into some (`lora` reads those)
            stream.remove(restore=False)
        else:
            self.inner.uninstall(name, module)

    def moves_whole(self, name: str) -> bool:
        return name not in self.streams and self.inner.moves_whole(name)

    def installed(self) -> set[str]:
        return self.inner.installed() | set(self.streams)


def unit_bytes(mode: str, sizes: Any) -> int:
    """Host bytes a streamed DiT holds at once under `mode` (`estimate.ModelSizes`): the unit it reads.
    A "model" unit is the whole DiT per forward; a "block" one block, a "layer" one layer (a block bounds
    it, a MoE FFN streams as one piece); a mode that does not stream holds the whole DiTs."""
    from . import disk_unit

    unit = disk_unit(mode)
    if unit is None:
        return sizes.transformer + sizes.refiner
    if unit == "model":
        return max(sizes.transformer, sizes.refiner)
    return sizes.largest_block


def make_mode(classes: dict[str, type], settings: Any, device: torch.device, states: dict | None = None) -> Any:
    """The mode object for `settings`, disk-backed for the DiTs when `offload_to` is `disk`; `states`: the
    handle's `ModelState`s (where disk homes are written down)."""
    mode = classes[settings.mode](settings, device, states)
    if streams_from_disk(settings, DITS[0]):
        return DiskBacked(mode)
    return mode
