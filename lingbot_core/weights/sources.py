"""Where a DiT's tensors come from: safetensors files (plain or fp8 + scales) or one GGUF file.

A tensor is read when the loader asks for it (plain reads into memory of its own), so loading never
holds more than the model so far plus one tensor. A source answers, for every state-dict name, how the
tensor is stored (`Entry`) before anything is read, so the loader can check names, shapes and
types against the config first and fail before heavy work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import WeightsError
from . import gguf_codec
from .disk import FileSpan
from .gguf_file import TensorInfo, read_header
from .modules import FP8
from .safetensors_header import SafetensorsHeader, read_safetensors_file, torch_dtypes

SCALE_SUFFIX = ".scale"
_CPU = torch.device("cpu")
FORMAT_KEY = "lingbot_weights"  # safetensors metadata: "fp8_e4m3" in a pre-quantized file
# A MoE expert stack stored one expert per tensor: the stack's own name plus the expert index,
# e.g. `blocks.3.ffn.experts.w1.17` is expert 17 of `blocks.3.ffn.experts.w1` ([I, D] of [E, I, D]).
PER_EXPERT = re.compile(r"^(?P<stack>.+\.experts\.w[123])\.(?P<expert>\d+)$")


def per_expert_key(stack: str, expert: int) -> str:
    return f"{stack}.{expert}"


@dataclass(frozen=True)
class Entry:
    """How one tensor is stored: `plain` (a torch dtype), `fp8` (+ scale) or `gguf` (a GGML type)."""

    kind: str
    shape: tuple[int, ...]  # logical shape
    dtype: torch.dtype | None = None  # plain tensors
    gguf_type: int = 0
    parts: tuple[str, ...] = ()  # a stack stored per expert: the file's tensor names, in expert order
    decode: bool = False  # plain, but stored GGUF-packed in another shape: decoded when read (`GGUFSource`)

    @property
    def quantized(self) -> bool:
        return self.kind == "fp8" or (self.kind == "gguf" and not gguf_codec.is_plain(self.gguf_type))

    @property
    def label(self) -> str:
        if self.kind == "plain":
            return str(self.dtype).replace("torch.", "")
        return FP8 if self.kind == "fp8" else gguf_codec.type_name(self.gguf_type)


def group_experts(entries: dict[str, Entry], path: Path) -> None:
    """Replace the per-expert tensors of a stack (`NAME.0` ... `NAME.{E-1}`) by one logical entry
    `NAME` of shape [E, ...], after checking they form one: every index once, one type, one shape."""
    stacks: dict[str, dict[int, str]] = {}
    for name in entries:
        found = PER_EXPERT.match(name)
        if found:
            stacks.setdefault(found["stack"], {})[int(found["expert"])] = name
    for stack, by_index in stacks.items():
        if stack in entries:
            raise WeightsError(f"{path}: {stack!r} is stored both stacked and per expert "
                               f"({by_index[min(by_index)]!r}); keep one layout.")
        missing = [i for i in range(len(by_index)) if i not in by_index]
        if missing:
            raise WeightsError(f"{path}: the experts of {stack!r} are stored per expert but "
                               f"{per_expert_key(stack, missing[0])!r} is missing (found {len(by_index)} "
                               f"tensors, indices up to {max(by_index)}); the file is incomplete.")
        names = [by_index[i] for i in range(len(by_index))]
        first = entries[names[0]]
        for name in names:
            entry = entries[name]
            if entry.decode:
                raise WeightsError(f"{path}: per-expert tensor {name!r} is recorded (comfy.gguf.orig_shape) in rows "
                                   "that are not whole quant blocks; expert stacks must be stored in whole blocks. "
                                   "Re-convert the model.")
            if len(entry.shape) != 2:
                raise WeightsError(f"{path}: per-expert tensor {name!r} is {list(entry.shape)}; each expert of "
                                   f"{stack!r} must be one 2-D [out, in] matrix.")
            if entry.shape != first.shape:
                raise WeightsError(f"{path}: per-expert tensor {name!r} is {list(entry.shape)}, but "
                                   f"{names[0]!r} is {list(first.shape)}; every expert of a stack has one shape.")
            if entry.label != first.label or entry.kind == "fp8":
                what = ("fp8 experts are stored stacked by lingbot-nodes' quantize" if entry.kind == "fp8"
                        else f"{first.label} for {names[0]!r}, {entry.label} for {name!r}")
                raise WeightsError(f"{path}: the experts of {stack!r} are stored per expert in types lingbot-nodes "
                                   f"cannot stack ({what}); it needs one plain or GGUF type per expert stack.")
        for name in names:
            del entries[name]
        entries[stack] = Entry(first.kind, (len(names), *first.shape), first.dtype, first.gguf_type, tuple(names))


class SafetensorsSource:
    """One or more safetensors files (a sharded checkpoint): the tensors as their headers describe them.

    Built from headers read once (`safetensors_header.read_safetensors_file`); pass `headers` when
    they were read already (the resolver does), else the files' headers are read here.
    """

    kind = "safetensors"

    def __init__(self, files: list[Path], headers: list[SafetensorsHeader] | None = None,
                 rename: dict[str, str] | None = None):
        self.files = list(files)
        headers = headers if headers is not None else [read_safetensors_file(Path(f)) for f in self.files]
        self._where: dict[str, int] = {}
        raw: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.metadata: dict[str, str] = {}
        self._spans: dict[str, tuple[Path, int, int]] = {}  # key -> (file, byte offset, byte count)
        self._identity = {h.path: h.identity for h in headers}
        rename = rename or {}  # stored name -> the checkpoint's own name (a single file's conventions)
        for i, header in enumerate(headers):
            self.metadata.update(header.metadata)
            for stored, info in header.tensors.items():
                key = rename.get(stored, stored)
                if key in self._where:
                    raise WeightsError(f"{header.path}: tensor {key!r} is stored twice "
                                       f"({stored!r}); the file is corrupt or mixes two conventions.")
                self._where[key] = i
                raw[key] = (info.dtype, info.shape)
                start, end = info.offsets
                self._spans[key] = (header.path, header.data_start + start, end - start)
        self.entries: dict[str, Entry] = {}
        for key, (dt, shape) in raw.items():
            if key.endswith(SCALE_SUFFIX) and key[: -len(SCALE_SUFFIX)] in raw:
                continue
            if dt == "F8_E4M3":
                scale = raw.get(key + SCALE_SUFFIX)
                if scale is None:
                    raise WeightsError(f"{self._file(key)}: fp8 tensor {key!r} has no {key + SCALE_SUFFIX!r} next to "
                                       "it; a pre-quantized lingbot checkpoint stores one float32 scale per output "
                                       "row. Re-create it with `python -m lingbot_core.quantize`.")
                if scale[0] != "F32" or scale[1] != shape[:-1]:
                    raise WeightsError(f"{self._file(key)}: {key + SCALE_SUFFIX!r} is {scale[0]} {list(scale[1])}, "
                                       f"expected F32 {list(shape[:-1])} (one scale per row of {key!r}).")
                self.entries[key] = Entry("fp8", shape)
            elif dt in torch_dtypes() and not dt.startswith("F8_"):  # F8_E4M3 without a scale, F8_E5M2: refused
                self.entries[key] = Entry("plain", shape, torch_dtypes()[dt])
            else:
                raise WeightsError(f"{self._file(key)}: tensor {key!r} is stored as {dt}, which lingbot-nodes does "
                                   "not load (it reads F32/F16/BF16 and F8_E4M3 with scales).")
        group_experts(self.entries, self.files[0])

    def _file(self, key: str) -> Path:
        return self.files[self._where[key]]

    def span(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> FileSpan:
        """Where `key`'s bytes sit in its file (read as `dtype`/`shape`): a disk home for offload."""
        path, offset, nbytes = self._spans[key]
        return FileSpan(str(path), offset, nbytes, dtype, tuple(shape), self._identity.get(path))

    # Tensors are read with plain file reads into memory of their own: mapping the file and copying
    # out of the mapping would also leave every page mapped in this process (RSS twice the model).
    def plain(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        entry = self.entries[key]
        if entry.parts:
            return self._stack(entry, dtype or entry.dtype)
        t = self.span(key, entry.dtype, entry.shape).read(_CPU)
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def _stack(self, entry: Entry, dtype: torch.dtype) -> torch.Tensor:
        """A stack stored per expert, assembled in place: each expert is read straight into its slice of
        the stack (converted through a one-expert buffer when `dtype` differs), so the load holds the
        stack once, not the experts and then their `torch.stack` copy (a 400 MB transient per stack
        at the MoE's width)."""
        out = torch.empty(entry.shape, dtype=dtype)
        for e, part in enumerate(entry.parts):
            span = self.span(part, entry.dtype, entry.shape[1:])
            if dtype == entry.dtype:
                span.read_into(out[e])
            else:
                out[e].copy_(span.read(_CPU))
        return out

    def close(self) -> None:
        pass


class GGUFSource:
    """One GGUF file (the checkpoint's own state-dict names): its header read once by the bounded walk of
    `gguf_file`, tensors read from their spans with plain file reads."""

    kind = "gguf"

    def __init__(self, path: Path, rename: dict[str, str] | None = None):
        self.files = [path]
        self.header = read_header(path)  # bounded walk: every malformed file ends in a GGUFError
        self.rename(rename or {})

    def rename(self, mapping: dict[str, str]) -> None:
        """Index the tensors under the checkpoint's own names (`mapping`: stored name -> own name, for a
        single file's conventions; the header is not read again), per-expert stacks grouped."""
        path = self.files[0]
        self._tensors: dict[str, TensorInfo] = {}
        self.entries: dict[str, Entry] = {}
        for stored, t in self.header.tensors.items():
            try:
                gguf_codec.check_supported(t.qtype, stored)
            except ValueError as err:
                raise WeightsError(f"{path}: {err}") from None
            shape = self.header.orig_shape(stored) or t.shape
            name = mapping.get(stored, stored)
            if name in self._tensors:
                raise WeightsError(f"{path}: tensor {name!r} is stored twice ({stored!r}); the file is corrupt "
                                   "or mixes two naming conventions.")
            self._tensors[name] = t
            if shape[-1] % gguf_codec.block_values(t.qtype):
                # Only a recorded shape splits a block: ComfyUI-GGUF's converter packs a tensor whose rows
                # are not whole blocks (a 2048x64 patch embedder) as whole-block rows of another shape. Such
                # tensors are small: decoded whole when read, as ComfyUI-GGUF does, not kept packed.
                self.entries[name] = Entry("plain", shape, torch.float32, gguf_type=t.qtype, decode=True)
            else:
                self.entries[name] = Entry("gguf", shape, gguf_type=t.qtype)
        group_experts(self.entries, path)

    def span(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> FileSpan:
        t = self._tensors[key]
        return FileSpan(str(self.files[0]), t.offset, t.nbytes, dtype, tuple(shape), self.header.identity)

    def packed(self, key: str) -> torch.Tensor:
        """The stored bytes of `key` as uint8 [..., bytes per row], read into memory of their own."""
        entry = self.entries[key]
        if entry.parts:
            raise ValueError(f"{key} is stored per expert; its experts are read one by one")
        return self._packed(key, entry.shape, entry.gguf_type)

    def _packed(self, key: str, logical: tuple[int, ...], qtype: int) -> torch.Tensor:
        shape = (*logical[:-1], gguf_codec.bytes_per_row(qtype, logical[-1]))
        return self.span(key, torch.uint8, shape).read(_CPU)

    def plain(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor decoded to `dtype` (float32 by default), in memory of its own."""
        entry = self.entries[key]
        dtype = dtype or torch.float32
        if entry.decode:  # packed in its stored shape (whole-block rows), decoded, then given its recorded shape
            t = self._tensors[key]
            return gguf_codec.dequantize(self._packed(key, t.shape, t.qtype), t.qtype, t.shape,
                                         dtype).reshape(entry.shape)
        if entry.parts:  # decoded expert by expert into the stack (as SafetensorsSource._stack)
            out = torch.empty(entry.shape, dtype=dtype)
            for e, part in enumerate(entry.parts):
                out[e].copy_(gguf_codec.dequantize(self._packed(part, entry.shape[1:], entry.gguf_type),
                                                   entry.gguf_type, entry.shape[1:], dtype))
            return out
        return gguf_codec.dequantize(self.packed(key), entry.gguf_type, entry.shape, dtype)

    @staticmethod
    def _plain_dtype(entry: Entry) -> torch.dtype:
        return {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}.get(entry.gguf_type, torch.float32)

    def close(self) -> None:
        self._tensors.clear()
