"""A GGUF file's header, read with every count and length bounded by the bytes the file holds.

The layout (GGUF v2/v3, little-endian): magic `GGUF`, uint32 version, uint64 tensor count, uint64
metadata count; the metadata as (string key, uint32 value type, value); one record per tensor
(string name, uint32 n_dims, n_dims uint64 sizes innermost first, uint32 GGML type, uint64 offset
into the data section); padding to `general.alignment` (32 by default); the tensor data. A string
is a uint64 byte count and UTF-8 bytes; an array is a uint32 element type, a uint64 count and the
elements.

Why not `gguf.GGUFReader`: it trusts the header. It loops and allocates by whatever counts the file
claims (a 47-byte file claiming 2^62 array entries runs until memory is gone), builds one numpy
array per metadata array element (a 4 MB array takes minutes and over a GB), recurses into nested
arrays without a limit, opens whatever the path names (a FIFO blocks forever), accepts tensors that
overlap, sit misaligned or do not match their bytes, and fails with whatever numpy or Python raises.
This walk checks each count and length against the bytes left BEFORE it loops or allocates, reads
numeric arrays in one step, and ends every problem in `GGUFError` naming the file and what is wrong.

Tensor data must be laid out as llama.cpp requires: in declaration order, each tensor at the running
total of its predecessors' sizes rounded up to the alignment. That one rule refuses overlapping,
misaligned and gapped tensors, and a tensor whose declared type or shape does not match its bytes.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import WeightsError
from ..interrupt import check_interrupt
from .fileio import Identity, open_regular, read_at
from .safetensors_header import MAX_INDEX_DIGITS, MAX_TENSORS, long_index

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 3  # an array of arrays of arrays; deeper nesting is refused
MAX_NAME_BYTES = 1 << 16  # metadata keys and tensor names
MAX_ELEMENTS = 1 << 62  # elements of one tensor (ggml counts them in int64)
MAX_ALIGNMENT = 1 << 30
_FIXED_PART = 24  # magic, version, two counts

# value type -> (struct format of one little-endian value, numpy dtype of an array of them)
_SCALARS: dict[int, tuple[str, str]] = {
    GGUFValueType.UINT8: ("<B", "<u1"), GGUFValueType.INT8: ("<b", "<i1"),
    GGUFValueType.UINT16: ("<H", "<u2"), GGUFValueType.INT16: ("<h", "<i2"),
    GGUFValueType.UINT32: ("<I", "<u4"), GGUFValueType.INT32: ("<i", "<i4"),
    GGUFValueType.UINT64: ("<Q", "<u8"), GGUFValueType.INT64: ("<q", "<i8"),
    GGUFValueType.FLOAT32: ("<f", "<f4"), GGUFValueType.FLOAT64: ("<d", "<f8"),
    GGUFValueType.BOOL: ("<B", "<u1"),
}
_STRING, _ARRAY = int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)
_U64 = struct.Struct("<Q")
# the fewest bytes one value of a type occupies (a string: its length; an array: type and count)
_MIN_BYTES = {**{t: struct.calcsize(f) for t, (f, _) in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}
_MIN_KV = 8 + 4 + 1  # empty key, type, one byte of value
_MIN_TENSOR = 8 + 4 + 4 + 8  # empty name, n_dims (0), type, offset


class GGUFError(WeightsError):
    """A `.gguf` file that is not a well-formed GGUF file; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor record: its GGML type, sizes (innermost first, as stored) and where its bytes are."""

    name: str
    qtype: int
    dims: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The torch (row-major) shape: the stored sizes reversed."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.qtype).name


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file says about itself; tensors in declaration order, metadata as Python values
    (numeric arrays as numpy arrays, string arrays as lists)."""

    path: Path
    size: int
    version: int
    alignment: int
    data_start: int
    metadata: dict[str, Any] = field(repr=False)
    tensors: dict[str, TensorInfo] = field(repr=False)
    identity: Identity | None = None  # the file as it was when its header was checked (`fileio`)

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def orig_shape(self, name: str) -> tuple[int, ...] | None:
        """The torch shape a ComfyUI-GGUF converter recorded for a tensor it reshaped
        (`comfy.gguf.orig_shape.<name>`), or None; a record that cannot be that tensor's shape is refused."""
        value = self.metadata.get(f"comfy.gguf.orig_shape.{name}")
        if value is None:
            return None
        info = self.tensors.get(name)
        dims = value.tolist() if isinstance(value, np.ndarray) else value
        if (info is None or not isinstance(dims, list) or not 0 < len(dims) <= 2 * MAX_DIMS
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims)
                or _product(dims) != info.n_elements):
            what = "no such tensor" if info is None else f"the tensor holds {info.n_elements} values"
            raise GGUFError(f"{self.path}: metadata comfy.gguf.orig_shape.{name} = {_short(value)} is not a shape "
                            f"of that tensor ({what}); the file is damaged. Re-convert it.")
        return tuple(dims)


def _product(dims: list[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _c(name: str) -> str:
    """A name as a message shows it (a name may be 64 KB long)."""
    return name if len(name) <= 120 else name[:117] + "..."


def _short(value: Any) -> str:
    text = repr(value.tolist() if isinstance(value, np.ndarray) else value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Walk:
    """A cursor over the file; every read is checked against the bytes left first.

    The bytes come with `read_at` (pread) into a buffer that grows as the walk goes (never a mapping: a file
    truncated while its header is walked would kill the process with SIGBUS); a read that comes back
    short means the file shrank since it was opened, and is refused."""

    _STEP = 1 << 20

    def __init__(self, path: Path, fd: int, size: int):
        self.path, self.fd, self.size, self.at = path, fd, size, 0
        self.data = bytearray()
        self._ticks = 0

    def fill(self, end: int) -> None:
        """The first `end` bytes of the file are in `data` (callers have checked `end <= size`)."""
        have = len(self.data)
        if end <= have:
            return
        want = min(self.size, max(end, have + self._STEP, 2 * have))
        while len(self.data) < end:
            try:
                chunk = read_at(self.fd, want - len(self.data), len(self.data))
            except OSError as err:
                raise GGUFError(f"GGUF file {self.path} cannot be read ({err.strerror or err}).") from None
            if not chunk:
                raise GGUFError(f"{self.path} changed while its header was read (it ends at byte {len(self.data)}, "
                                f"it had {self.size}); it is being written or was replaced. Wait for the copy to "
                                "finish, then run again.")
            self.data += chunk
        self.tick()

    def tick(self) -> None:
        """A cancellation point every few thousand items (a header walk may take seconds)."""
        self._ticks += 1
        if self._ticks % 1024 == 0:
            check_interrupt()

    def fail(self, problem: str) -> GGUFError:
        return GGUFError(f"{self.path} is not a valid GGUF file: {problem}. Re-download or re-convert it.")

    @property
    def left(self) -> int:
        return self.size - self.at

    def need(self, n: int, what: str) -> None:
        if n > self.left:
            raise self.fail(f"truncated at byte {self.at} ({what} needs {n} bytes, {self.left} left)")

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        self.fill(self.at + n)
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += n
        return value

    def count(self, what: str, each: int, limit: int | None = None) -> int:
        """A uint64 count of items of at least `each` bytes: refused unless they fit in what is left."""
        n = self.scalar("<Q", what)
        if n * each > self.left or (limit is not None and n > limit):
            bound = f"at most {limit}" if limit is not None and n * each <= self.left else f"{self.left} bytes left"
            raise self.fail(f"{what} claims {n} entries ({bound})")
        return n

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.scalar("<Q", f"{what} length")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long (at most {limit})")
        self.need(n, what)
        self.fill(self.at + n)
        raw = self.data[self.at:self.at + n]
        self.at += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {self.at - n} is not UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            v = self.scalar(_SCALARS[vtype][0], what)
            return bool(v) if vtype == GGUFValueType.BOOL else v
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")
        item = self.scalar("<I", f"{what} element type")
        if item not in _MIN_BYTES:
            raise self.fail(f"{what} is an array of unknown value type {item}")
        n = self.count(f"{what} (array)", _MIN_BYTES[item])
        if item in _SCALARS:  # one step, whatever the count: the bytes are there
            dtype = np.dtype(_SCALARS[item][1])
            self.fill(self.at + n * dtype.itemsize)
            raw = bytes(self.data[self.at:self.at + n * dtype.itemsize])
            self.at += n * dtype.itemsize
            arr = np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="))
            return arr.astype(bool) if item == GGUFValueType.BOOL else arr
        if item == _STRING:
            return self._strings(n, what)
        return [self.value(item, what, depth + 1) for _ in range(n)]

    def _strings(self, n: int, what: str) -> list[str]:
        """`n` strings in a row (a tokenizer's vocabulary: 10^5 of them), each length checked first."""
        size, at, out = self.size, self.at, []
        length = _U64.unpack_from
        for i in range(n):
            if at + 8 > size:
                self.at = at
                self.need(8, f"{what} entry {i} length")
            if at + 8 > len(self.data):
                self.fill(at + 8)
            (k,) = length(self.data, at)
            at += 8
            if k > size - at:
                self.at = at
                self.need(k, f"{what} entry {i}")
            if at + k > len(self.data):
                self.fill(at + k)
            data = self.data
            try:
                out.append(data[at:at + k].decode("utf-8"))
            except UnicodeDecodeError:
                raise self.fail(f"{what} entry {i} at byte {at} is not UTF-8") from None
            at += k
        self.at = at
        return out


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """The header of the GGUF file at `path`, checked against its size; `GGUFError` for anything malformed
    (a directory, FIFO or device is refused by what it is; a FIFO is never waited on)."""
    path = Path(path)
    fd, info = open_regular(path, GGUFError)
    try:
        size = info.st_size
        if size < _FIXED_PART:
            raise GGUFError(f"{path} is not a valid GGUF file: truncated header ({size} bytes; a GGUF header "
                            f"has at least {_FIXED_PART}). Re-download or re-convert it.")
        header = _walk(_Walk(path, fd, size))
    finally:
        os.close(fd)
    return GGUFHeader(header.path, header.size, header.version, header.alignment, header.data_start,
                      header.metadata, header.tensors, Identity.of(info))


def _walk(w: _Walk) -> GGUFHeader:
    w.fill(4)
    magic = bytes(w.data[0:4])
    if magic != MAGIC:
        raise w.fail(f"bad magic {magic!r} (a GGUF file starts with b'GGUF')")
    w.at = 4
    version = w.scalar("<I", "version")
    if version not in VERSIONS:
        if version & 0xFFFF == 0 and int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:
            raise w.fail("it is big-endian; lingbot-nodes reads little-endian GGUF files (the usual kind)")
        raise w.fail(f"unsupported version {version} (it reads versions {', '.join(map(str, VERSIONS))})")
    n_tensors = w.scalar("<Q", "tensor count")
    if n_tensors > MAX_TENSORS:
        raise w.fail(f"tensor count claims {n_tensors} tensors (at most {MAX_TENSORS})")
    n_kv = w.count("metadata", _MIN_KV)
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = w.string(f"metadata key {i}", MAX_NAME_BYTES)
        if key in metadata:
            raise w.fail(f"metadata key {_c(key)!r} appears twice")
        vtype = w.scalar("<I", f"type of metadata {_c(key)!r}")
        metadata[key] = w.value(vtype, f"metadata {_c(key)!r}")
        w.tick()
    if n_tensors * _MIN_TENSOR > w.left:
        raise w.fail(f"tensor count claims {n_tensors} tensors ({w.left} bytes left)")
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
            or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT):
        raise w.fail(f"general.alignment is {_short(alignment)} (a power of two up to {MAX_ALIGNMENT})")
    records = [_tensor_record(w, i) for i in range(n_tensors)]
    data_start = -(-w.at // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    expected = 0  # where the next tensor must start, relative to the data section
    previous: TensorInfo | None = None
    for name, qtype, dims, offset in records:
        if name in tensors:
            raise w.fail(f"tensor {_c(name)!r} appears twice")
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        kind = GGMLQuantizationType(qtype).name
        if dims and dims[0] % block:
            raise w.fail(f"tensor {_c(name)!r}: a {kind} row holds a multiple of {block} values, not {dims[0]}")
        info = TensorInfo(name, qtype, dims, data_start + offset, _product(list(dims)) // block * type_size)
        what = f"tensor {_c(name)!r} ({kind} {list(info.shape)}, {info.nbytes} bytes)"
        if offset % alignment:
            raise w.fail(f"{what} starts at data offset {offset}, not a multiple of the alignment {alignment}")
        if offset < expected and previous is not None:
            raise w.fail(f"{what} starts at data offset {offset}, inside {_c(previous.name)!r} (which ends at "
                         f"{previous.offset - data_start + previous.nbytes}): tensors overlap")
        if offset != expected:
            after = f"after {_c(previous.name)!r}" if previous is not None else "at the start of the data"
            raise w.fail(f"{what} starts at data offset {offset}, but {expected} is where it belongs {after}: "
                         "a declared type or shape does not match the bytes stored")
        if info.offset + info.nbytes > w.size:
            raise w.fail(f"{what} runs past the end of the file (ends at byte {info.offset + info.nbytes}, the "
                         f"file has {w.size})")
        tensors[name] = previous = info
        expected = offset + -(-info.nbytes // alignment) * alignment
    end = data_start + expected
    if tensors and w.size > end:
        raise w.fail(f"{w.size - end} bytes follow the last tensor {_c(previous.name)!r}: its declared type or shape "
                     "does not match the bytes stored")
    if not tensors and w.size > data_start + alignment:
        raise w.fail(f"it declares no tensors but holds {w.size - data_start} bytes of data")
    return GGUFHeader(w.path, w.size, version, alignment, data_start, metadata, tensors)


def _tensor_record(w: _Walk, i: int) -> tuple[str, int, tuple[int, ...], int]:
    name = w.string(f"tensor {i} name", MAX_NAME_BYTES)
    w.tick()
    if long_index(name):
        raise w.fail(f"tensor {_c(name)!r} holds an index of more than {MAX_INDEX_DIGITS} digits")
    n_dims = w.scalar("<I", f"tensor {_c(name)!r} dimension count")
    if n_dims > MAX_DIMS:
        raise w.fail(f"tensor {_c(name)!r} has {n_dims} dimensions (at most {MAX_DIMS})")
    w.need(8 * n_dims, f"tensor {_c(name)!r} sizes")
    w.fill(w.at + 8 * n_dims)
    dims = struct.unpack_from(f"<{n_dims}Q", w.data, w.at)
    w.at += 8 * n_dims
    if any(d == 0 for d in dims) or _product(list(dims)) > MAX_ELEMENTS:
        raise w.fail(f"tensor {_c(name)!r} has sizes {list(dims)} (each at least 1, at most 2^62 values in all)")
    qtype = w.scalar("<I", f"tensor {_c(name)!r} type")
    if qtype not in {int(t) for t in GGML_QUANT_SIZES}:
        raise w.fail(f"tensor {_c(name)!r} has unknown tensor type {qtype}")
    offset = w.scalar("<Q", f"tensor {_c(name)!r} offset")
    return name, qtype, dims, offset
