"""GGUF block formats, decoded in torch on whatever device the packed bytes are on.

A GGUF tensor row of `n` values is `n / block_size` blocks of `type_size` bytes. We keep those bytes
as a uint8 tensor shaped like the logical tensor with its last dimension replaced by bytes per row,
so offload moves exactly the stored bytes, and decode one layer (or one expert) when it computes.
The `gguf` package's numpy decoder is the reference the tests compare against; layouts below are the
ggml block definitions (`d` = f16 scale, `m`/`dmin` = f16 minimum, `qs` = packed quants).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256

_Decoder = Callable[[torch.Tensor], torch.Tensor]


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 stored at byte `at` of every block, as an (n, 1) float32 column."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(n, g, b) bytes -> (n, g, 2, b): the low nibbles of a group first, then the high ones."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * blocks[:, 2:].view(torch.int8).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, None, 2:]).reshape(blocks.shape[0], 32)
    return _half(blocks, 0) * (q.float() - 8.0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, None, 4:]).reshape(blocks.shape[0], 32)
    return _half(blocks, 0) * q.float() + _half(blocks, 2)


def _fifth_bits(bits: torch.Tensor) -> torch.Tensor:
    """Four little-endian bytes per block -> (n, 32) bit i of the 32-bit word, for value i."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    return ((bits[:, :, None] >> shifts) & 1).reshape(bits.shape[0], 32)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, None, 6:]).reshape(blocks.shape[0], 32)
    q = low | (_fifth_bits(blocks[:, 2:6]) << 4)
    return _half(blocks, 0) * (q.float() - 16.0)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, None, 8:]).reshape(blocks.shape[0], 32)
    q = low | (_fifth_bits(blocks[:, 4:8]) << 4)
    return _half(blocks, 0) * q.float() + _half(blocks, 2)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12-byte scale field of Q4_K/Q5_K -> eight 6-bit scales and eight 6-bit minimums.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 minimums 0-3; bytes 8-11 hold the low 4 bits of
    scales 4-7 (low nibble) and minimums 4-7 (high nibble), whose top 2 bits are the spare top bits of
    bytes 0-3 and 4-7.
    """
    first, second, rest = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((first & 0x3F, (rest & 0x0F) | ((first >> 2) & 0x30)), dim=1)
    mins = torch.cat((second & 0x3F, (rest >> 4) | ((second >> 2) & 0x30)), dim=1)
    return scales.float(), mins.float()


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, mins = _k_scales(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    out = (_half(blocks, 0) * scales)[:, :, None] * q - (_half(blocks, 2) * mins)[:, :, None]
    return out.reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, mins = _k_scales(blocks[:, 4:16])
    low = _nibbles(blocks[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    shifts = torch.arange(8, device=blocks.device, dtype=torch.uint8)
    high = (blocks[:, None, 16:48] >> shifts[None, :, None]) & 1  # sub-block j takes bit j of each byte
    q = (low | (high << 4)).float()
    out = (_half(blocks, 0) * scales)[:, :, None] * q - (_half(blocks, 2) * mins)[:, :, None]
    return out.reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    # Two halves of 128 values: 64 bytes of low nibbles and 32 bytes of 2-bit high parts each.
    low = _nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], device=blocks.device, dtype=torch.uint8)
    high = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts[None, None, :, None]) & 3
    q = ((low | (high << 4)).view(torch.int8).float() - 32.0).reshape(n, 16, 16)
    scales = blocks[:, 192:208].view(torch.int8).float()
    return ((_half(blocks, 208) * scales)[:, :, None] * q).reshape(n, QK_K)


_DECODERS: dict[GGMLQuantizationType, _Decoder] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
_PLAIN: dict[GGMLQuantizationType, torch.dtype] = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
SUPPORTED = tuple(_PLAIN) + tuple(_DECODERS)
# Byte offsets of each block type's float16 fields (`d`, and `m`/`dmin` where it has one): the only
# stored values that can make a block decode to NaN/inf (the NaN scan reads just these).
_HALF_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    GGMLQuantizationType.Q8_0: (0,), GGMLQuantizationType.Q4_0: (0,), GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,), GGMLQuantizationType.Q5_1: (0, 2), GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2), GGMLQuantizationType.Q6_K: (208,),
}


def type_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"unknown type {qtype}"


def supported_names() -> str:
    return ", ".join(t.name for t in SUPPORTED)


def is_plain(qtype: int) -> bool:
    """F32/F16/BF16: stored values, no blocks."""
    return GGMLQuantizationType(qtype) in _PLAIN


def plain_dtype(qtype: int) -> torch.dtype:
    """The torch dtype of an F32/F16/BF16 tensor."""
    return _PLAIN[GGMLQuantizationType(qtype)]


def block_bytes(qtype: int) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1]


def half_fields(qtype: int) -> tuple[int, ...]:
    """Byte offsets of the float16 scale fields inside one block of `qtype`."""
    return _HALF_FIELDS[GGMLQuantizationType(qtype)]


def check_supported(qtype: int, tensor: str) -> GGMLQuantizationType:
    """The type, or a ValueError naming it and what we can read."""
    if qtype not in {int(t) for t in SUPPORTED}:
        raise ValueError(f"GGUF tensor {tensor!r} is stored as {type_name(qtype)}, which lingbot-nodes cannot "
                         f"dequantize (it reads {supported_names()}). Re-quantize the model to one of those types.")
    return GGMLQuantizationType(qtype)


def bytes_per_row(qtype: int, row: int) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if row % block:
        raise ValueError(f"a {type_name(qtype)} row must hold a multiple of {block} values, not {row}")
    return row // block * size


def dequantize(packed: torch.Tensor, qtype: int, shape: tuple[int, ...] | torch.Size,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode packed bytes (uint8, any leading shape) into a `shape` tensor of `dtype` on their device."""
    kind = GGMLQuantizationType(qtype)
    flat = packed.reshape(-1)
    if kind in _PLAIN:
        return flat.view(_PLAIN[kind]).reshape(shape).to(dtype)
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise ValueError(f"cannot dequantize GGUF type {kind.name}; lingbot-nodes reads {supported_names()}")
    _, size = GGML_QUANT_SIZES[kind]
    return decoder(flat.view(-1, size)).reshape(shape).to(dtype)
