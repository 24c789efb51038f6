"""Read a safetensors file's header, bounded and validated against the file before anything is allocated.

The one place our code reads safetensors headers: the folder checks, the DiT weights source and
the estimates all build on what it returns, so each file's header is read once per open.
"""

from __future__ import annotations

import functools
import math
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..interrupt import check_interrupt
from ..json_text import parse_json_text
from .fileio import Identity, open_regular, pread_exact, pread_into

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit (it refuses a longer header)
MAX_INDEX_DIGITS = 6
"""Digits of one number inside a tensor name (`blocks.<N>.`, `experts.w1.<E>`): no model has a millionth
block or expert, and a 5,000-digit index would fail in `int()` deep inside the loaders."""
MAX_TENSORS = 1 << 17
"""Tensors one file may declare: the MoE 30B stored one tensor per expert with fp8 scales has ~40,000;
a header declaring more (10^6 zero-size tensors) is refused before its JSON is parsed."""

# safetensors dtype -> bytes per element (the sub-byte F4/F6 kinds are not used by any LingBot weights)
SAFETENSORS_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


@dataclass(frozen=True)
class StoredTensor:
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int] = (0, 0)  # byte range inside the data section

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    tensors: dict[str, StoredTensor]
    metadata: dict[str, str] = field(default_factory=dict)
    data_start: int = 8  # byte offset of the data section in the file
    identity: Identity | None = None  # the file as it was when its header was checked (`fileio`)


def read_safetensors_file(path: Path) -> SafetensorsHeader:
    """Validate a safetensors file's header against the file: its tensors (dtype, shape, byte range) and metadata.

    Checks what the format promises, and refuses everything the safetensors library refuses when
    the file is opened later (so the error comes now, naming the file, not from a decode after the
    whole denoise): a bounded JSON header, string metadata, known dtypes, shapes of
    non-negative integers, byte ranges that match ``numel * itemsize`` and tile the data section
    from its first byte to the file's last (no gap, no overlap, no trailing bytes). Only the header
    is read (`pread`: a file shrinking meanwhile is an error, never a crash); the path must be a
    regular file (a FIFO is never waited on).
    """
    path = Path(path)
    fd, info = open_regular(path)
    try:
        size = info.st_size
        if size < 8:
            raise CheckpointError(f"{path} is truncated ({size} bytes): re-download it.")
        (header_len,) = struct.unpack("<Q", pread_exact(fd, 8, 0, path))
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path} is not a valid safetensors file (header of {header_len} bytes; at most "
                                  f"{MAX_HEADER_BYTES}); re-download it.")
        if header_len > size - 8:
            raise CheckpointError(f"{path} is truncated: its header needs {header_len} bytes, the file has "
                                  f"{size}. Re-download it.")
        header_bytes = pread_exact(fd, header_len, 8, path)
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({err.strerror or err}); re-download it.") from None
    finally:
        os.close(fd)
    declared = header_bytes.count(b'"data_offsets"')
    if declared > MAX_TENSORS:
        raise CheckpointError(f"{path} is not a usable safetensors file: it declares {declared} tensors (at most "
                              f"{MAX_TENSORS}); re-download it.")
    try:
        text = header_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not a valid safetensors file (its header is not UTF-8); re-download it.") from None
    try:
        header = parse_json_text(text, "its header")
    except CheckpointError as err:
        raise CheckpointError(f"{path} is not a valid safetensors file ({err}); re-download it.") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a valid safetensors file (its header is not a JSON object); re-download it.")
    data_size = size - 8 - header_len
    metadata: dict[str, str] = {}
    entries: dict[str, StoredTensor] = {}
    ranges: list[tuple[int, int, str]] = []
    for i, (name, entry) in enumerate(header.items()):
        if i % 4096 == 0:
            check_interrupt()
        if name == "__metadata__":
            if entry is None:
                continue
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise CheckpointError(f"{path}: __metadata__ must be an object of strings; the file is corrupt, "
                                      "re-download it.")
            metadata = dict(entry)
            continue
        entries[name] = _tensor_entry(path, name, entry, data_size, ranges)
    _check_tiling(path, ranges, data_size)
    return SafetensorsHeader(path, entries, metadata, 8 + header_len, Identity.of(info))


def _check_tiling(path: Path, ranges: list[tuple[int, int, str]], data_size: int) -> None:
    """The byte ranges, in order, cover the data section exactly: each starts where the one before ends."""
    ranges.sort()
    at, before = 0, ""
    for begin, end, name in ranges:
        if begin < at:
            raise CheckpointError(f"{path}: tensors {_clip(before)!r} and {_clip(name)!r} overlap in the file; it is "
                                  "corrupt, re-download it.")
        if begin > at:
            where = f"after {_clip(before)!r}" if before else "at the start of the data"
            raise CheckpointError(f"{path}: {begin - at} unused bytes {where} (tensor {_clip(name)!r} starts at "
                                  f"{begin}); the file is corrupt, re-download it.")
        at, before = end, name
    if at != data_size:
        raise CheckpointError(f"{path}: {data_size - at} bytes follow the last tensor's data; the file is corrupt "
                              "or not a safetensors file, re-download it.")


_LONG_INDEX = re.compile(rf"\d{{{MAX_INDEX_DIGITS + 1}}}")


def _clip(name: str) -> str:
    return name if len(name) <= 120 else name[:117] + "..."


def long_index(name: str) -> bool:
    """Does the tensor name hold a number of more than `MAX_INDEX_DIGITS` digits?"""
    return _LONG_INDEX.search(name) is not None


def _tensor_entry(path: Path, name: str, entry: Any, data_size: int,
                  ranges: list[tuple[int, int, str]]) -> StoredTensor:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {_clip(name)!r} {what}; the file is corrupt, re-download it.")

    if long_index(name):
        raise bad(f"holds an index of more than {MAX_INDEX_DIGITS} digits")

    if not isinstance(entry, dict):
        raise bad("has no header entry object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_ITEMSIZE:
        raise bad(f"has an unknown dtype {str(dtype)[:40]!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad("has a malformed shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise bad("has malformed data_offsets")
    begin, end = offsets
    running = 1
    for d in shape:  # the library multiplies in 64 bits, in order: an overflow on the way is refused there
        running *= d
        if running >= 1 << 64:
            raise bad("has a shape whose element count overflows")
    expected = math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]
    if end - begin != expected:
        raise bad(f"claims {end - begin} bytes for shape {tuple(shape)} of {dtype} ({expected} needed)")
    if end > data_size:
        raise CheckpointError(f"{path} is truncated: tensor {_clip(name)!r} ends at byte {end} of a {data_size}-byte "
                          "data section. Re-download it.")
    ranges.append((begin, end, name))
    return StoredTensor(dtype, tuple(shape), (begin, end))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def stored_tensors(files: Iterable[Path] | Iterable[SafetensorsHeader]) -> dict[str, StoredTensor]:
    """All tensors of a component (its shards together); a name in two shards is refused.
    Takes the files (their headers are read) or headers already read."""
    out: dict[str, StoredTensor] = {}
    for item in files:
        header = item if isinstance(item, SafetensorsHeader) else read_safetensors_file(item)
        f = header.path
        for name, entry in header.tensors.items():
            if name in out:
                raise CheckpointError(f"{f}: tensor {_clip(name)!r} is stored in two shards; re-download the checkpoint.")
            out[name] = entry
    return out


@functools.cache
def torch_dtypes() -> dict[str, Any]:
    """The safetensors dtype names and their torch dtypes (the fp8 ones where this torch has them): the
    one table every reader and writer of safetensors files uses."""
    import torch

    table = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}
    for name, attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
        if hasattr(torch, attr):
            table[name] = getattr(torch, attr)
    return table


@functools.cache
def safetensors_dtype(dtype: Any) -> str:
    """The safetensors name of a torch dtype ("BF16" for torch.bfloat16); KeyError if it has none."""
    return {d: n for n, d in torch_dtypes().items()}[dtype]


class TensorReader:
    """The tensors of a file whose header was checked (`read_safetensors_file`), read with `pread` into
    memory of their own: the file is opened once, must still be the file the header came from (same
    device, inode, size and modification time), and a short read is an error naming the file, never
    the SIGBUS a mapping gives when the file shrinks. Use as a context manager."""

    def __init__(self, header: SafetensorsHeader):
        self.header = header
        self._fd: int | None = None
        self._dtypes = torch_dtypes()

    def __enter__(self) -> TensorReader:
        from .fileio import check_same_file

        fd, _info = open_regular(self.header.path)
        try:
            check_same_file(self.header.path, fd, self.header.identity)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def get(self, name: str) -> Any:
        """The tensor `name` (its stored dtype and shape), on the CPU."""
        import torch

        if self._fd is None:
            raise RuntimeError("TensorReader used outside its `with` block")
        entry = self.header.tensors[name]
        dtype = self._dtypes.get(entry.dtype)
        if dtype is None:
            raise CheckpointError(f"{self.header.path}: tensor {_clip(name)!r} is stored as {entry.dtype}, which "
                                  "lingbot-nodes does not read here.")
        begin, end = entry.offsets
        check_interrupt()
        flat = torch.empty(end - begin, dtype=torch.uint8)
        if end > begin:
            pread_into(self._fd, memoryview(flat.numpy()).cast("B"), self.header.data_start + begin, self.header.path)
        return flat.view(dtype).reshape(entry.shape)
