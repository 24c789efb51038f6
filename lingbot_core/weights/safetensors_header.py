"""Read a safetensors file's header, bounded and validated against the file before anything is allocated.

The one place our code reads safetensors headers: the folder checks, the DiT weights source and
the estimates all build on what it returns, so each file's header is read once per open.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..json_text import parse_json_text

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit

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



def read_safetensors_file(path: Path) -> SafetensorsHeader:
    """Validate a safetensors file's header against the file: its tensors (dtype, shape, byte range) and metadata.

    Checks what the format promises: a bounded JSON header of tensor entries, known dtypes, shapes
    of non-negative integers, byte ranges that match ``numel * itemsize``, lie inside the file and
    do not overlap. Only the header is read.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path} is truncated ({size} bytes): re-download it.")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path} is not a valid safetensors file (header of {header_len} bytes); "
                                  "re-download it.")
            if header_len > size - 8:
                raise CheckpointError(f"{path} is truncated: its header needs {header_len} bytes, the file has "
                                  f"{size}. Re-download it.")
            header_bytes = fh.read(header_len)
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({err}); re-download it.") from err
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
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict):
                raise CheckpointError(f"{path}: __metadata__ must be an object; the file is corrupt, re-download it.")
            metadata = {str(k): v for k, v in entry.items() if isinstance(v, str)}
            continue
        entries[name] = _tensor_entry(path, name, entry, data_size, ranges)
    ranges.sort()
    for (_b0, e0, n0), (b1, _e1, n1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors {n0!r} and {n1!r} overlap in the file; it is corrupt, re-download it.")
    return SafetensorsHeader(path, entries, metadata, 8 + header_len)


def read_safetensors_entries(path: Path) -> dict[str, StoredTensor]:
    """Each tensor's dtype and shape, from the validated header (`read_safetensors_file`)."""
    return read_safetensors_file(path).tensors


def _tensor_entry(path: Path, name: str, entry: Any, data_size: int,
                  ranges: list[tuple[int, int, str]]) -> StoredTensor:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {name[:200]!r} {what}; the file is corrupt, re-download it.")

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
    expected = math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]
    if end - begin != expected:
        raise bad(f"claims {end - begin} bytes for shape {tuple(shape)} of {dtype} ({expected} needed)")
    if end > data_size:
        raise CheckpointError(f"{path} is truncated: tensor {name[:200]!r} ends at byte {end} of a {data_size}-byte "
                          "data section. Re-download it.")
    if end > begin:
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
                raise CheckpointError(f"{f}: tensor {name!r} is stored in two shards; re-download the checkpoint.")
            out[name] = entry
    return out
