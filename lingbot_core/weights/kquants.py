"""GGUF K-quant encoders (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) for `python -m lingbot_core.quantize`.

The `gguf` package decodes K-quants but cannot write them; these write the ggml block layouts that
`gguf_codec` decodes (and the `gguf` package's reference decoder reads the same bytes). A block holds
256 values of one row in sub-blocks of 32 (Q4_K, Q5_K) or 16 (Q2_K, Q3_K, Q6_K), each with a 4-, 6- or
8-bit scale (and, for the asymmetric types, a minimum) relative to the block's float16 `d` / `dmin`.

The scales are chosen in one pass: each sub-block's range (asymmetric types: min..max with the
minimum kept <= 0; symmetric types: its value of largest magnitude mapped to the most negative code),
then `d` from the largest sub-block scale. llama.cpp refines scales by a small search (lower error
for the same bytes); this does not, so its error is a little higher than a llama.cpp file's of the
same type. Rows whose length is not a multiple of 256 are the caller's to handle (`quantize` keeps
them in Q8_0).
"""

from __future__ import annotations

import numpy as np

__all__ = ["K_TYPES", "QK_K", "encode"]

QK_K = 256
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, 0 where den is 0 (an all-zero sub-block or block)."""
    safe = np.where(den == 0, 1.0, den)
    return np.where(den == 0, 0.0, num / safe).astype(np.float32)


def _f16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values as stored float16 bytes (n, 2), and the float32 of those float16s (what decodes)."""
    half = values.astype(np.float16)
    return half.view(np.uint8).reshape(-1, 2), half.astype(np.float32)


def _asymmetric(x: np.ndarray, levels: int, scale_levels: int) -> tuple:
    """Sub-blocks x (n, s, k) as q in 0..levels with per-sub-block scale and minimum codes in
    0..scale_levels: x ~ d*sc*q - dmin*m. Returns (q, sc, m, d bytes, dmin bytes)."""
    low = np.minimum(x.min(axis=-1), 0.0)
    high = x.max(axis=-1)
    scale = (high - low) / levels
    minimum = -low
    d_bytes, d = _f16(scale.max(axis=-1) / scale_levels)
    m_bytes, dmin = _f16(minimum.max(axis=-1) / scale_levels)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, scale_levels)
    m = np.clip(np.rint(_ratio(minimum, dmin[:, None])), 0, scale_levels)
    step = (d[:, None] * sc)[..., None]
    offset = (dmin[:, None] * m)[..., None]
    q = np.clip(np.rint(_ratio(x + offset, np.broadcast_to(step, x.shape))), 0, levels)
    return q.astype(np.uint8), sc.astype(np.uint8), m.astype(np.uint8), d_bytes, m_bytes


def _symmetric(x: np.ndarray, low_code: int, scale_max: int) -> tuple:
    """Sub-blocks x (n, s, k) as q in low_code..-low_code-1 (the value of largest magnitude maps to
    low_code), with signed per-sub-block scale codes in -scale_max..scale_max: x ~ d*sc*q.
    Returns (q, sc, d bytes)."""
    at = np.abs(x).argmax(axis=-1)
    peak = np.take_along_axis(x, at[..., None], axis=-1)[..., 0]
    scale = peak / low_code
    d_bytes, d = _f16(np.abs(scale).max(axis=-1) / scale_max)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), -scale_max, scale_max)
    step = np.broadcast_to((d[:, None] * sc)[..., None], x.shape)
    q = np.clip(np.rint(_ratio(x, step)), low_code, -low_code - 1)
    return q.astype(np.int16), sc.astype(np.int16), d_bytes


def _packed_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and minimums -> the 12-byte field of Q4_K / Q5_K."""
    first = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    second = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    rest = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([first, second, rest], axis=1).astype(np.uint8)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """(n, 8, 32) 4-bit codes -> (n, 128) bytes: sub-blocks 2c and 2c+1 share bytes 32c..32c+31,
    the first in the low nibbles."""
    q = q.reshape(q.shape[0], 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], 128).astype(np.uint8)


def _q4_k(x: np.ndarray) -> np.ndarray:
    q, sc, m, d, dmin = _asymmetric(x.reshape(-1, 8, 32), 15, 63)
    return np.concatenate([d, dmin, _packed_scales(sc, m), _nibble_pairs(q)], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    q, sc, m, d, dmin = _asymmetric(x.reshape(-1, 8, 32), 31, 63)
    high = ((q >> 4) & 1).astype(np.uint8)  # (n, 8, 32): sub-block j's fifth bits go to bit j of byte b
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate([d, dmin, _packed_scales(sc, m), qh, _nibble_pairs(q & 0x0F)], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]  # blocks of 256
    q, sc, d = _symmetric(x.reshape(n, 16, 16), -32, 127)
    u = (q + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # value h*128 + k*32 + b
    low, high = u & 0x0F, u >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), d], axis=1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]  # blocks of 256
    q, sc, d = _symmetric(x.reshape(n, 16, 16), -4, 31)
    u = (q + 4).astype(np.uint8).reshape(n, 8, 32)  # value 32k + b
    hmask = np.zeros((n, 32), dtype=np.uint8)
    for k in range(8):
        hmask |= (u[:, k] >> 2) << k
    low = (u & 3).reshape(n, 2, 4, 32)
    qs = low[:, :, 0] | (low[:, :, 1] << 2) | (low[:, :, 2] << 4) | (low[:, :, 3] << 6)
    stored = (sc + 32).astype(np.uint8)  # 0..63
    nib, top = stored & 0x0F, stored >> 4
    scales = np.concatenate([nib[:, :8] | (nib[:, 8:] << 4),
                             top[:, 0:4] | (top[:, 4:8] << 2) | (top[:, 8:12] << 4) | (top[:, 12:16] << 6)], axis=1)
    return np.concatenate([hmask, qs.reshape(n, 64), scales, d], axis=1)


def _q2_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]  # blocks of 256
    q, sc, m, d, dmin = _asymmetric(x.reshape(n, 16, 16), 3, 15)
    quads = q.reshape(n, 2, 4, 32)  # value h*128 + j*32 + b at bits 2j of byte (h, b)
    qs = quads[:, :, 0] | (quads[:, :, 1] << 2) | (quads[:, :, 2] << 4) | (quads[:, :, 3] << 6)
    return np.concatenate([sc | (m << 4), qs.reshape(n, 64), d, dmin], axis=1)


_ENCODERS = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def encode(rows: np.ndarray, qtype_name: str) -> np.ndarray:
    """Rows (r, c) of float32, c a multiple of 256 -> (r, c / 256 * block bytes) uint8 in `qtype_name`."""
    if qtype_name not in _ENCODERS:
        raise ValueError(f"no K-quant encoder for {qtype_name!r} (known: {', '.join(K_TYPES)})")
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[1] % QK_K:
        raise ValueError(f"K-quants need rows of a multiple of {QK_K} values, got shape {rows.shape}")
    blocks = _ENCODERS[qtype_name](rows.reshape(-1, QK_K))
    return np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows.shape[0], -1)
