"""GGUF block formats, decoded in torch on whatever device the packed bytes are on.

A GGUF tensor row of `n` values is `n / block_size` blocks of `type_size` bytes. We keep those bytes
as a uint8 tensor shaped like the logical tensor with its last dimension replaced by bytes per row,
so offload moves exactly the stored bytes, and decode one layer (or one expert) when it computes.
The `gguf` package's numpy decoder is the reference the tests compare against; layouts below are the
ggml block definitions (`d` = f16 scale, `m`/`dmin` = f16 minimum, `qs` = packed quants).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .decode import PackedFormat, decode_rows

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
    # low nibbles are values 0-15, high nibbles 16-31: written straight into one float32 scratch,
    # then shifted and scaled in place (fewer passes than stacking the nibbles first)
    out = torch.empty(blocks.shape[0], 32, device=blocks.device)
    qs = blocks[:, 2:]
    out[:, :16] = qs & 0x0F
    out[:, 16:] = qs >> 4
    return out.sub_(8.0).mul_(_half(blocks, 0))


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


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """84 bytes: 16 scale bytes (low nibble: the scale, high nibble: the minimum, one per 16 values),
    64 bytes of 2-bit quants, then `d` and `dmin`. Quants: byte b of half h holds values
    h*128 + j*32 + b at bits 2j."""
    n = blocks.shape[0]
    sc = blocks[:, :16]
    shifts = torch.tensor([0, 2, 4, 6], device=blocks.device, dtype=torch.uint8)
    q = ((blocks[:, 16:80].reshape(n, 2, 1, 32) >> shifts[None, None, :, None]) & 3).reshape(n, 16, 16).float()
    scale = (_half(blocks, 80) * (sc & 0x0F).float())[:, :, None]
    low = (_half(blocks, 82) * (sc >> 4).float())[:, :, None]
    return (scale * q - low).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """110 bytes: a 32-byte high-bit mask, 64 bytes of 2-bit low quants, 12 bytes of sixteen 6-bit
    scales, then `d`. Value 32k + b takes bits 2(k%4) of low byte 32(k//4) + b and bit k of mask byte b;
    a clear mask bit subtracts 4. Scale i: low 4 bits from byte i%8 (low nibble for i < 8, else high),
    top 2 bits from byte 8 + i%4 at bits 2(i//4); stored with an offset of 32."""
    n = blocks.shape[0]
    dev = blocks.device
    two = torch.tensor([0, 2, 4, 6], device=dev, dtype=torch.uint8)
    low = ((blocks[:, 32:96].reshape(n, 2, 1, 32) >> two[None, None, :, None]) & 3).reshape(n, 16, 16)
    bits = torch.arange(8, device=dev, dtype=torch.uint8)
    high = ((blocks[:, None, :32] >> bits[None, :, None]) & 1).reshape(n, 16, 16)
    q = low.float() - 4.0 * (1 - high).float()
    packed = blocks[:, 96:108]
    nib = torch.cat((packed[:, :8] & 0x0F, packed[:, :8] >> 4), dim=1)
    top = ((packed[:, None, 8:12] >> two[None, :, None]) & 3).reshape(n, 16)
    scales = (nib | (top << 4)).float() - 32.0
    return ((_half(blocks, 108) * scales)[:, :, None] * q).reshape(n, QK_K)


# IQ4's sixteen non-uniform levels (ggml's kvalues_iq4nl), indexed by a 4-bit code
_IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_levels(codes: torch.Tensor) -> torch.Tensor:
    levels = torch.tensor(_IQ4_LEVELS, device=codes.device, dtype=torch.float32)
    return levels[codes.long()]


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    """18 bytes: `d`, then 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31, each a
    code into the IQ4 levels."""
    codes = _nibbles(blocks[:, None, 2:]).reshape(blocks.shape[0], 32)
    return _half(blocks, 0) * _iq4_levels(codes)


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """136 bytes: `d`, a little-endian uint16 with the top 2 bits of eight 6-bit scales (2 bits each),
    4 bytes with their low 4 bits (low nibble first), then 128 bytes: 16 per sub-block of 32, low
    nibbles first, each a code into the IQ4 levels. Scales are stored with an offset of 32."""
    n = blocks.shape[0]
    dev = blocks.device
    high_word = blocks[:, 2].long() | (blocks[:, 3].long() << 8)
    top = (high_word[:, None] >> (2 * torch.arange(8, device=dev))) & 3
    nib = torch.stack((blocks[:, 4:8] & 0x0F, blocks[:, 4:8] >> 4), dim=-1).reshape(n, 8).long()
    scales = (nib | (top << 4)).float() - 32.0
    codes = _nibbles(blocks[:, 8:].reshape(n, 8, 16)).reshape(n, 8, 32)
    return ((_half(blocks, 0) * scales)[:, :, None] * _iq4_levels(codes)).reshape(n, QK_K)


@dataclass(frozen=True)
class BlockType:
    """One block format we read: its decoder and the byte offsets of its float16 fields (`d`, and
    `m`/`dmin` where it has one): the only stored values that can make a block decode to NaN/inf (the
    NaN scan reads just these). `compiles`: the `auto` decoder may fuse it into one compiled kernel
    (`weights.decode`; off where the compiled kernel measured slower than the eager ops:
    `python bench/speed_dit.py --only decoders`). A new GGUF type is its decoder plus one
    row of `BLOCK_TYPES`."""

    decode: _Decoder
    half_fields: tuple[int, ...]
    compiles: bool = True
    signed_bytes: bool = False  # the decoder reads only int8 quants and float16 fields: bytes handed over as int8

    def rows_format(self, name: str) -> PackedFormat:
        return PackedFormat(name, eager=lambda rows, _: self.decode(rows), compiles=self.compiles,
                            rows_dtype=torch.int8 if self.signed_bytes else None)


_Q = GGMLQuantizationType
BLOCK_TYPES: dict[GGMLQuantizationType, BlockType] = {
    _Q.Q8_0: BlockType(_q8_0, (0,), signed_bytes=True),
    _Q.Q4_0: BlockType(_q4_0, (0,)),
    _Q.Q4_1: BlockType(_q4_1, (0, 2)),
    _Q.Q5_0: BlockType(_q5_0, (0,)),
    _Q.Q5_1: BlockType(_q5_1, (0, 2)),
    _Q.Q4_K: BlockType(_q4_k, (0, 2)),
    _Q.Q5_K: BlockType(_q5_k, (0, 2)),
    _Q.Q6_K: BlockType(_q6_k, (208,), compiles=False),
    _Q.Q3_K: BlockType(_q3_k, (108,), compiles=False),
    _Q.Q2_K: BlockType(_q2_k, (80, 82), compiles=False),
    _Q.IQ4_NL: BlockType(_iq4_nl, (0,)),
    _Q.IQ4_XS: BlockType(_iq4_xs, (0,)),
}
_PLAIN: dict[GGMLQuantizationType, torch.dtype] = {_Q.F32: torch.float32, _Q.F16: torch.float16, _Q.BF16: torch.bfloat16}
SUPPORTED = tuple(_PLAIN) + tuple(BLOCK_TYPES)


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


def block_values(qtype: int) -> int:
    """How many values one block of `qtype` holds (1 for F32/F16/BF16)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]


def half_fields(qtype: int) -> tuple[int, ...]:
    """Byte offsets of the float16 scale fields inside one block of `qtype`."""
    return BLOCK_TYPES[GGMLQuantizationType(qtype)].half_fields


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
               dtype: torch.dtype = torch.float32, decoder: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode packed bytes (uint8, any leading shape) into a `shape` tensor of `dtype` on their device
    (`decoder`: one of `weights.decode.DECODERS`; `out`: a contiguous tensor of that size and `dtype`
    to write into)."""
    kind = GGMLQuantizationType(qtype)
    flat = packed.reshape(-1)
    if kind in _PLAIN:
        plain = flat.view(_PLAIN[kind]).reshape(shape)
        return plain.to(dtype) if out is None else out.view(shape).copy_(plain)
    block = BLOCK_TYPES.get(kind)
    if block is None:
        raise ValueError(f"cannot dequantize GGUF type {kind.name}; lingbot-nodes reads {supported_names()}")
    values, size = GGML_QUANT_SIZES[kind]
    blocks = flat.view(-1, size)
    return decode_rows(blocks, values, block.rows_format(kind.name), dtype, blocks.device, decoder=decoder,
                       out=out).reshape(shape)
