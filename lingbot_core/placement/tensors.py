"""Tensors as placement sees them: where each one's home is, and how many bytes are really held.

Nothing here assumes a tensor is a float `nn.Parameter`: quantized weights (fp8 with scales, GGUF
blocks stored as bytes, tensor subclasses) are moved and counted as they are stored.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .settings import CPU, same_device


def module_tensors(module: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str, str, torch.Tensor]]:
    """Every (owner, kind, name, tensor) slot under `module`; tied tensors appear once per owner."""
    for owner in module.modules():
        for name, t in owner._parameters.items():
            if t is not None:
                yield owner, "param", name, t
        for name, t in owner._buffers.items():
            if t is not None:
                yield owner, "buffer", name, t


def _bound(t: torch.Tensor, home: torch.Tensor) -> bool:
    """Is `t` bound to the storage of `home` (same device, same data pointer)?"""
    if t.device != home.device or t.device.type == "meta":
        return False
    try:
        return t.data_ptr() == home.data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without one storage
        return False


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    if t.device.type == "meta":
        return "meta", id(t)
    try:
        return str(t.device), t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without one storage
        return str(t.device), id(t)


def _held_bytes(t: torch.Tensor) -> int:
    """Bytes this tensor's storage holds (a view counts its whole storage, once)."""
    if t.device.type != "meta":
        try:
            return int(t.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError, TypeError):
            pass
    return t.numel() * t.element_size()


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this process holds of `t`: an FSDP shard (a DTensor) counts its local part, not the whole."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """One (representative tensor, bytes held) per distinct storage among `tensors`."""
    seen: dict[tuple[str, int], tuple[torch.Tensor, int]] = {}
    for t in map(_local, tensors):
        key = _storage_key(t)
        if key not in seen:
            seen[key] = (t, _held_bytes(t))
    return list(seen.values())


def stored_bytes(module: Any, *, include_meta: bool = False) -> int:
    """Bytes a module's parameters and buffers hold, each storage once (tied weights count once)."""
    if not isinstance(module, torch.nn.Module):
        return 0
    held = unique_storages(t for _o, _k, _n, t in module_tensors(module))
    return sum(n for t, n in held if include_meta or t.device.type != "meta")


class Homes:
    """The tensors of one component as they were before a mode touched it.

    `restore()` puts every captured tensor object back into its slot, which undoes whatever hooks
    did (accelerate replaces parameters with new `meta` ones and, when its hooks are removed,
    with per-module copies that untie shared weights). With `keep_data` the home storage of each
    tensor is remembered too, so moving to the device and back is a rebinding of `.data`: no copy
    back, no new host allocation, and the home storage is never copied.
    """

    def __init__(self, module: torch.nn.Module, *, keep_data: bool):
        self.slots = list(module_tensors(module))
        unique: dict[int, torch.Tensor] = {}
        for _owner, _kind, _name, t in self.slots:
            unique.setdefault(id(t), t)
        self.tensors = list(unique.values())
        self.data = [t.data for t in self.tensors] if keep_data else None

    def onload(self, device: torch.device) -> None:
        """Bind every tensor to a copy of its home on `device` (the home itself when it is there)."""
        homes = self._homes()
        with torch.inference_mode(False), torch.no_grad():
            for t, home in zip(self.tensors, homes):
                if same_device(t.device, device) and (not same_device(home.device, device) or _bound(t, home)):
                    continue
                t.data = home.to(device)

    def offload(self) -> None:
        """Bind every tensor back to its home (frees the device copies)."""
        for t, home in zip(self.tensors, self._homes()):
            if not _bound(t, home):
                t.data = home

    def _homes(self) -> list[torch.Tensor]:
        if self.data is None:
            raise RuntimeError("these homes were captured without their data")
        return self.data

    def restore(self) -> None:
        """Every slot holds its captured tensor again, bound to its home (or moved to the CPU)."""
        for owner, kind, name, t in self.slots:
            table = owner._parameters if kind == "param" else owner._buffers
            if table.get(name) is not t:
                table[name] = t
        if self.data is not None:
            self.offload()
            return
        with torch.inference_mode(False), torch.no_grad():
            for t in self.tensors:
                if t.device.type not in ("cpu", "meta"):
                    t.data = t.data.to(CPU)

    def lost(self) -> list[str]:
        """Names of captured slots whose tensor has no data (on `meta`): must be empty after restore."""
        return [name for _o, _k, name, t in self.slots if t.device.type == "meta"]
