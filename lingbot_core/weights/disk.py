"""Disk-backed offload for the DiTs: the checkpoint file is the CPU home of their weights.

With `offload_to="disk"` a DiT keeps no weights in host memory between uses: every tensor the
loader kept exactly as stored has a `FileSpan` (file, byte offset, byte count), and a streaming unit
(a block under `group`, a leaf layer under `sequential`) reads its tensors from the file right
before it computes and drops them right after. The file is read with ordinary reads, not mapped
into the process, so host RSS stays near one unit while the page cache (not counted in RSS, and
given back under pressure) does the caching. A unit's tensors are read into anonymous mappings of
their own, not the allocator's heap: dropping them gives the pages straight back to the OS, where
freed heap memory would stay in the process (glibc keeps it for reuse), and a view that outlives
its unit keeps exactly its mapping alive. The unit's computation still allocates its temporaries
from the heap, and glibc keeps freed heap pages for reuse (RSS only grows over a long forward), so
every `TRIM_EVERY` bytes streamed the free heap is handed back (`malloc_trim`).

A DiT loaded for disk offload (`load_dit(streamed=True)`, the stage door asks for it) never reads
its span-backed tensors at all: they are on `meta` from the start, and tensors it had to convert
live in the converted-weights cache (`weights.converted`). `materialize` reads them into memory when
a RAM-homed mode takes the model over. A span-backed tensor streams only while it holds its file's
bytes: what was read is noted on the model's `ModelState` (object and version, `note_exact`), so a
tensor changed in memory since (a merged LoRA) keeps a host home and is copied in and out like `ram`
offload, as are
tensors without a span (a model loaded normally with a dtype change or fp8 quantized on load).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import hooks
from ..errors import WeightsError
from .fileio import Identity, check_same_file, open_regular, pread_into
from .state import ModelState

_TRANSIENT_MIN = 1 << 16  # smaller tensors come from the heap (a mapping per norm weight is waste)
TRIM_EVERY = 64 << 20  # streamed bytes between two hand-backs of the free heap
UNITS = ("model", "block", "layer")
"""What a streaming unit is: the whole DiT, one block (or top-level child), one layer (`_units`)."""


def _malloc_trim():
    """glibc's `malloc_trim`, or None (another C library, or none found)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def release_free_heap() -> None:
    """Give the allocator's free heap pages back to the OS (glibc; elsewhere a no-op)."""
    if _TRIM is not None:
        _TRIM(0)


def anonymous_mapping(nbytes: int) -> mmap.mmap:
    """`nbytes` of fresh memory of their own, given back to the OS when the last view goes: a private
    anonymous mapping (POSIX); on Windows, where mmap takes no flags, `-1` maps pagefile-backed memory."""
    if hasattr(mmap, "MAP_ANONYMOUS"):
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, nbytes)


@dataclass(frozen=True)
class FileSpan:
    path: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    identity: Identity | None = None  # the file its header was checked in: a reopen must find the same one

    def read(self, device: torch.device, *, transient: bool = False) -> torch.Tensor:
        """The tensor, read from the file into fresh memory (then moved to `device`).

        `transient`: into an anonymous mapping of its own (a streamed unit's weights), so the pages go
        back to the OS the moment the last view of the tensor is dropped.
        """
        if transient and self.nbytes >= _TRANSIENT_MIN:
            out = torch.frombuffer(anonymous_mapping(self.nbytes), dtype=torch.uint8)
        else:
            out = torch.empty(self.nbytes, dtype=torch.uint8)
        self._fill(out)
        tensor = out.view(self.dtype).reshape(self.shape)
        return tensor if device.type == "cpu" else tensor.to(device)

    def read_into(self, out: torch.Tensor) -> torch.Tensor:
        """Read the bytes straight into `out` (a contiguous CPU tensor of exactly `nbytes`, e.g. one
        expert's slice of a stack being assembled): no buffer of the span's own."""
        if out.device.type != "cpu" or not out.is_contiguous() or out.numel() * out.element_size() != self.nbytes:
            raise ValueError(f"read_into needs a contiguous CPU tensor of {self.nbytes} bytes")
        self._fill(out.view(-1).view(torch.uint8))
        return out

    def _fill(self, out: torch.Tensor) -> None:
        """pread into `out` from the file, after checking it is still the file the header was read from
        (disk offload reopens it at every step: a file replaced meanwhile would mix two models)."""
        fd, _info = open_regular(self.path, WeightsError)
        try:
            check_same_file(self.path, fd, self.identity, WeightsError)
            pread_into(fd, memoryview(out.numpy()).cast("B"), self.offset, self.path, WeightsError)
        finally:
            os.close(fd)


def check_readable(spans: dict[str, FileSpan]) -> None:
    """Refuse disk offload when a home file is gone, is not a regular file, cannot be opened, or is
    shorter than its header said: the checks the streaming reads make, done once before installing."""
    seen: dict[str, int] = {}
    for span in spans.values():
        if span.path in seen:
            continue
        try:
            fd, info = open_regular(span.path, WeightsError)
        except WeightsError as err:
            raise ValueError(f"disk offload needs to read the checkpoint file: {err} Use offload_to='ram', or "
                             "copy the checkpoint to a local disk.") from None
        os.close(fd)
        seen[span.path] = info.st_size
    for name, span in spans.items():
        if span.offset + span.nbytes > seen[span.path]:
            raise ValueError(f"disk offload: {span.path} is shorter than its header says (tensor {name}); "
                             "the file changed since it was loaded. Reload the checkpoint.")


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _units(model: nn.Module, unit: str) -> list[tuple[nn.Module, list[tuple[nn.Module, str, str]]]]:
    """Streaming units and the tensors each brings in: (owner module, local name, full name).

    `model`: the whole DiT. `block`: every top-level child, each block of `blocks` on its own.
    `layer`: every module with tensors of its own; a container without a forward (the expert
    stacks) joins its parent.
    """
    if unit not in UNITS:
        raise ValueError(f"unknown streaming unit {unit!r}; expected one of {', '.join(UNITS)}")
    by_unit: dict[int, tuple[nn.Module, list]] = {}
    names = dict(model.named_modules())
    for prefix, module in model.named_modules():
        own = [*module._parameters.items(), *module._buffers.items()]
        if not own:
            continue
        if unit == "model":
            owner = model
        elif unit == "block":
            parts = prefix.split(".")
            head = ".".join(parts[:2]) if parts[0] == "blocks" and len(parts) > 1 else parts[0]
            owner = names[head] if head else model
        else:
            owner_name = prefix
            while owner_name and not _has_forward(names[owner_name]):
                owner_name = owner_name.rpartition(".")[0]
            owner = names[owner_name] if owner_name else model
        entry = by_unit.setdefault(id(owner), (owner, []))
        for local, tensor in own:
            if tensor is not None:
                entry[1].append((module, local, f"{prefix}.{local}" if prefix else local))
    return list(by_unit.values())


class DiskStreaming:
    """Streams a DiT's weights from its files, unit by unit; `remove()` brings them back into memory."""

    def __init__(self, model: nn.Module, state: ModelState, device: torch.device, unit: str = "block"):
        known = state.spans
        self.model, self.state, self.device = model, state, torch.device(device)
        self.spans: dict[str, FileSpan] = {}  # the tensors streamed: those whose values are their file's
        self.homes: dict[str, torch.Tensor] = {}  # the others (converted, or changed in memory): host copies
        self.owners: list[nn.Module] = []  # the modules carrying a `UnitStream` hook
        self.streamed = 0  # bytes read since the free heap was last handed back
        self.units = _units(model, unit)
        slots = [(module, local, full) for _owner, tensors in self.units for module, local, full in tensors]
        for module, local, full in slots:
            tensor = _slot(module, local)
            if full in known and matches_file(state, full, tensor):
                self.spans[full] = known[full]
            else:
                self.homes[full] = tensor.data
        check_readable(self.spans)
        for module, local, full in slots:
            if full in self.spans:
                tensor = _slot(module, local)
                self._bind(module, local, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
        for owner, tensors in self.units:
            hooks.attach(owner, UnitStream(self, tensors))
            self.owners.append(owner)

    @staticmethod
    def _bind(module: nn.Module, local: str, value: torch.Tensor) -> None:
        if local in module._parameters:
            module._parameters[local] = nn.Parameter(value, requires_grad=False)
        else:
            module._buffers[local] = value

    def _fetch(self, full: str) -> torch.Tensor:
        if full in self.spans:
            return self.spans[full].read(self.device, transient=True)
        return self.homes[full].to(self.device)

    def load(self, tensors) -> None:
        for module, local, full in tensors:
            self._bind(module, local, self._fetch(full))

    def unload(self, tensors, nbytes: int) -> None:
        self._drop(tensors)
        self.streamed += nbytes
        if self.streamed >= TRIM_EVERY:
            self.streamed = 0
            release_free_heap()

    def _drop(self, tensors) -> None:
        for module, local, full in tensors:
            current = _slot(module, local)
            if full in self.spans:
                self._bind(module, local, torch.empty(current.shape, dtype=current.dtype, device="meta"))
            else:
                self._bind(module, local, self.homes[full])

    def settle(self) -> None:
        """Every unit back home (after an error or interrupt inside a forward)."""
        for _owner, tensors in self.units:
            self._drop(tensors)

    def stored_bytes(self) -> int:
        return sum(s.nbytes for s in self.spans.values())

    def remove(self, restore: bool = True) -> None:
        """Hooks off; with `restore` every tensor back in host memory, read once from the file (else the
        streamed ones stay on `meta`, read when a RAM-homed mode takes the model: `materialize`)."""
        for owner in self.owners:
            hooks.detach(owner, UnitStream.name)
        self.owners.clear()
        self.settle()  # converted tensors bound to their homes, span-backed ones on meta
        if restore:
            materialize(self.model, self.state)


@hooks.named("lingbot.disk_stream", "disk offload: reads a unit's weights from the file before it computes, "
             "drops them after")
class UnitStream(hooks.Hook):
    """One streaming unit of a `DiskStreaming`: its tensors come in before the unit computes and go after."""

    def __init__(self, stream: DiskStreaming, tensors: list):
        super().__init__()
        self.stream, self.tensors = stream, tensors
        self.nbytes = sum(stream.spans[full].nbytes for _m, _l, full in tensors if full in stream.spans)

    @property
    def execution_device(self) -> torch.device:
        return self.stream.device

    def pre_forward(self, module, *args, **kwargs):
        self.stream.load(self.tensors)
        return args, kwargs

    def post_forward(self, module, output):
        self.stream.unload(self.tensors, self.nbytes)
        return output


def _slot(module: nn.Module, local: str) -> torch.Tensor:
    return module._parameters[local] if local in module._parameters else module._buffers[local]


def _span_backed(model: nn.Module, state: ModelState | None, on_meta: bool = True):
    """(owner, local name, full name, tensor) of every span-backed tensor (`on_meta`: only those on `meta`)."""
    spans = state.spans if state is not None else {}
    if not spans:
        return
    for prefix, module in model.named_modules():
        for local, tensor in [*module._parameters.items(), *module._buffers.items()]:
            full = f"{prefix}.{local}" if prefix else local
            if tensor is not None and full in spans and (tensor.device.type == "meta") == on_meta:
                yield module, local, full, tensor


def note_exact(model: nn.Module, state: ModelState, names: set[str] | None = None) -> None:
    """Note on `state` that these span-backed tensors hold exactly their file's bytes now (object and version)."""
    for _m, _l, full, tensor in _span_backed(model, state, on_meta=False):
        if (names is None or full in names) and not tensor.is_inference():
            # an inference tensor has no version to watch: left out, it counts as changed (kept in RAM)
            state.exact[full] = (weakref.ref(tensor), tensor._version)


def matches_file(state: ModelState, full: str, tensor: torch.Tensor) -> bool:
    """Are `tensor`'s values still its file's? On `meta`, or the object read then and not written since
    (an in-place change such as a merged LoRA bumps the version: such a tensor keeps a host home)."""
    if tensor.device.type == "meta":
        return True
    seen = state.exact.get(full)
    return seen is not None and seen[0]() is tensor and seen[1] == tensor._version


def disk_homed(model: nn.Module, state: ModelState | None) -> set[int]:
    """ids of the tensors whose only home is a file now (span-backed, on `meta`): the memory report's `disk`."""
    return {id(t) for _m, _l, _f, t in _span_backed(model, state)} if isinstance(model, nn.Module) else set()


def on_disk(model: nn.Module, state: ModelState | None) -> bool:
    """Does `model` have weights that live only in their file (a streamed load, or streaming installed)?"""
    return isinstance(model, nn.Module) and next(_span_backed(model, state), None) is not None


def materialize(model: nn.Module, state: ModelState | None, names: set[str] | None = None) -> int:
    """Read the span-backed tensors still on `meta` (all, or those `names`) into host memory: a RAM-homed
    mode takes the model over, or a LoRA merges into them. Returns how many were read; a no-op on a
    model loaded normally."""
    if not isinstance(model, nn.Module):
        return 0
    if streaming_of(model) is not None:
        raise RuntimeError("materialize: disk streaming is installed on this model; remove it first")
    todo = [slot for slot in _span_backed(model, state) if names is None or slot[2] in names]
    if not todo:
        return 0
    check_readable({full: state.spans[full] for _m, _l, full, _t in todo})
    cpu = torch.device("cpu")
    with torch.inference_mode(False), torch.no_grad():  # versioned tensors: see `note_exact`
        for module, local, full, _tensor in todo:
            DiskStreaming._bind(module, local, state.spans[full].read(cpu))
    note_exact(model, state, {full for _m, _l, full, _t in todo})
    return len(todo)


def streaming_of(module: nn.Module) -> DiskStreaming | None:
    """The disk streaming installed on `module` (found through its units' hooks), or None."""
    if not isinstance(module, nn.Module):
        return None
    return next((hook.stream for _sub, hook in hooks.hooks_named(module, UnitStream.name)), None)
