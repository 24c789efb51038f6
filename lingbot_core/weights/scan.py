"""Cheap NaN/inf checks on packed (fp8 / GGUF) weights, without decoding them.

A packed weight can only decode to a non-finite value through a few stored fields, so the scan
reads just those: fp8 e4m3fn values whose bit pattern is NaN (e4m3fn has no infinity: `S.1111.111`,
bytes 0x7F and 0xFF), fp8 row scales that are non-finite or so large that a row overflows float32,
and the float16 fields of GGUF blocks (`d`, and `m`/`dmin` where the type has one) whose exponent
bits are all ones. The integer quants in a block are bounded, so with finite fields every decoded
value is finite. GGUF F32/F16/BF16 tensors kept inside a packed module are checked value by value.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn

from . import gguf_codec
from .fp8 import E4M3_MAX
from .modules import FP8, Packing, packed_tensors

_CHUNK = 1 << 24  # bytes per step: bounds the boolean temporaries


def _flat_chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    flat = t.detach().reshape(-1)
    for start in range(0, flat.numel(), _CHUNK):
        yield flat[start:start + _CHUNK]


def _count_all_ones(bits: torch.Tensor, mask: int) -> int:
    """How many elements have every bit of `mask` set. `amax` of the masked bits reaches `mask` only
    when one does, so a clean chunk costs one mask and one max; only a bad one gets counted."""
    masked = bits & mask
    return int((masked == mask).sum()) if int(masked.amax()) == mask else 0


def fp8_nan_count(data: torch.Tensor) -> int:
    """How many stored e4m3fn bytes (uint8) are NaN."""
    return sum(_count_all_ones(chunk, 0x7F) for chunk in _flat_chunks(data) if chunk.numel())


def fp8_bad_scale_count(scale_bits: torch.Tensor) -> int:
    """How many float32 row scales (stored as int32 bits) are non-finite or overflow a row at 448."""
    scale = scale_bits.detach().reshape(-1).view(torch.float32)
    return int((~torch.isfinite(scale * E4M3_MAX)).sum())


def gguf_bad_field_count(data: torch.Tensor, qtype: int) -> int:
    """How many float16 block fields (block types) or values (F32/F16/BF16) of a GGUF tensor are non-finite."""
    if gguf_codec.is_plain(qtype):
        dtype = gguf_codec.plain_dtype(qtype)
        per = torch.empty((), dtype=dtype).element_size()
        step = _CHUNK - _CHUNK % per
        flat = data.detach().reshape(-1)
        return sum(int((~torch.isfinite(flat[i:i + step].view(dtype))).sum()) for i in range(0, flat.numel(), step))
    blocks = data.detach().reshape(-1, gguf_codec.block_bytes(qtype))
    bad = 0
    for start in range(0, blocks.shape[0], _CHUNK // 64):
        part = blocks[start:start + _CHUNK // 64]
        for at in gguf_codec.half_fields(qtype):
            bad += _count_all_ones(part[:, at + 1], 0x7C)  # little-endian high byte: sign, 5 exponent bits, ...
    return bad


def problems(packing: Packing, data: torch.Tensor, scale: torch.Tensor | None) -> list[str]:
    """What is non-finite in one stored tensor, in words (empty when nothing is)."""
    found = []
    if packing.kind == FP8:
        if n := fp8_nan_count(data):
            found.append(f"{n} NaN fp8 value(s)")
        if scale is not None and (n := fp8_bad_scale_count(scale)):
            found.append(f"{n} non-finite (or overflowing) row scale(s) in its .scale")
    elif n := gguf_bad_field_count(data, packing.gguf_type):
        label = gguf_codec.type_name(packing.gguf_type)
        what = "value(s)" if gguf_codec.is_plain(packing.gguf_type) else "block scale(s) (float16 d/m fields)"
        found.append(f"{n} non-finite {label} {what}")
    return found


def packed_non_finite(model: nn.Module) -> Iterator[tuple[str, str]]:
    """(stored tensor name, what is wrong) for every packed tensor of `model` that would decode to NaN/inf.

    Tensors on the meta device (offloaded, not materialised) are skipped.
    """
    for name, module in model.named_modules():
        for tensor, packing, data, scale in packed_tensors(module):
            if data.device.type == "meta":
                continue
            with torch.no_grad():
                wrong = problems(packing, data, scale)
            if wrong:
                yield (f"{name}.{tensor}" if name else tensor), "; ".join(wrong)
