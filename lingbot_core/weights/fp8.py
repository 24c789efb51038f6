"""float8 (e4m3) weights with one float32 scale per output channel.

`weight ≈ float(q) * scale[..., None]`: `scale` has the weight's shape without its last (input)
dimension, so a linear weight [out, in] has scale [out] and a stacked expert tensor [E, out, in]
has scale [E, out]. The largest |value| of a row maps to 448, e4m3's largest finite value; e4m3
keeps 3 mantissa bits, so a value is off by at most 2^-4 of itself (2^-10 of the row's scale for
the smallest, subnormal values).
"""

from __future__ import annotations

import torch

from ..errors import WeightsError

E4M3_MAX = 448.0
REL_STEP = 2.0**-4  # half an e4m3 ulp, relative
SUBNORMAL_STEP = 2.0**-10  # half the smallest e4m3 subnormal, in units of the row scale


def fp8_available() -> bool:
    return hasattr(torch, "float8_e4m3fn")


def require_fp8() -> None:
    if not fp8_available():
        raise ValueError(f"fp8 weights need a torch with float8 dtypes (torch >= 2.1); this torch "
                         f"{torch.__version__} has no torch.float8_e4m3fn. Upgrade torch or load the bf16 weights.")


def quantize_fp8(weight: torch.Tensor, rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, float32 scales) for a floating tensor; works in row chunks to bound memory.

    A 1-D tensor is one row (a scalar scale); a 0-D or non-float tensor is refused (WeightsError)."""
    require_fp8()
    if weight.ndim == 0 or not weight.dtype.is_floating_point or weight.dtype.itemsize == 1:
        raise WeightsError(f"fp8 quantizes float tensors of at least one dimension (one scale per row); got a "
                           f"{weight.ndim}-D {str(weight.dtype).replace('torch.', '')} tensor. Keep it as stored.")
    rows = weight.reshape(-1, weight.shape[-1])
    q = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    scale = torch.empty(rows.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, rows.shape[0], rows_per_chunk):
        chunk = rows[start:start + rows_per_chunk].float()
        s = chunk.abs().amax(dim=-1) / E4M3_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row quantizes to zeros with any scale
        q[start:start + rows_per_chunk] = (chunk / s[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        scale[start:start + rows_per_chunk] = s
    return q.reshape(weight.shape), scale.reshape(weight.shape[:-1])


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8 values and their per-row float32 scales -> `dtype` (the product is formed in float32)."""
    return (q.float() * scale.float()[..., None]).to(dtype)
