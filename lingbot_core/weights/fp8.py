"""float8 (e4m3) weights with one float32 scale per output channel.

`weight ≈ float(q) * scale[..., None]`: `scale` has the weight's shape without its last (input)
dimension, so a linear weight [out, in] has scale [out] and a stacked expert tensor [E, out, in]
has scale [E, out]. The largest |value| of a row maps to 448, e4m3's largest finite value; e4m3
keeps 3 mantissa bits, so a value is off by at most 2^-4 of itself (2^-10 of the row's scale for
the smallest, subnormal values).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import kernels
from ..errors import WeightsError
from .decode import PackedFormat, decode_rows

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


_VALUE_TABLES: dict[torch.device, torch.Tensor] = {}


def e4m3_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256 float32 values of the e4m3 bytes 0..255 (byte b -> its value), one table per device."""
    device = torch.device(device)
    table = _VALUE_TABLES.get(device)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().to(device)
        _VALUE_TABLES[device] = table
    return table


def _by_table(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Eager: each byte's value looked up in a 256-entry float32 table (`e4m3_values`) and scaled in
    place: the same float32 numbers as torch's fp8 -> float32 cast (bit-identical, tested) in fewer
    passes over memory."""
    wide = torch.index_select(e4m3_values(rows.device), 0, rows.view(torch.uint8).reshape(-1).int())
    return wide.view(rows.shape).mul_(scales[:, None])


def _by_cast(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Compiled: the plain cast, which the compiler fuses with the scaling into one pass."""
    return rows.float() * scales[:, None]


#: fp8 rows (float8_e4m3fn [n, width]) with their float32 row scales as the per-row extra
FP8_ROWS = PackedFormat("fp8_e4m3", eager=_by_table, traced=_by_cast)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, decoder: str = "auto",
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """float8 values and their per-row float32 scales -> `dtype` (the product is formed in float32),
    by `weights.decode.decode_rows` (`decoder`: one of `weights.decode.DECODERS`; `out`: a contiguous
    tensor of q's size and `dtype` to write into)."""
    width = q.shape[-1]
    rows, row_scales = q.reshape(-1, width), scale.reshape(-1).float()
    return decode_rows(rows, width, FP8_ROWS, dtype, q.device, extra=row_scales, decoder=decoder,
                       out=out).view(q.shape)


# -- fp8 matmuls ---------------------------------------------------------------------------------------

FP8_MATMULS = ("decode", "scaled_mm", "auto")
"""How an fp8 linear computes. `decode`: weight decoded to the compute dtype, then a plain matmul
(exact with respect to the stored weight; every device). `scaled_mm`: the activations are quantized
to e4m3 per row and multiplied by the fp8 weight on fp8 tensor cores (`torch._scaled_mm`, row-wise
scales), faster where supported and not bit-equal to `decode`. `auto`: `scaled_mm` for bf16
activations on a GPU with fp8 tensor cores (compute capability 8.9+), else `decode`.

Whether `torch._scaled_mm` runs on a given GPU, dtype and torch build is not read from a table (row-wise
kernels came to sm89, sm100 and sm120 at different torch versions): it is the `scaled_mm` kernel of
`lingbot_core.kernels`, tried on its first call, its first rows compared with the decoded matmul's, and
where it refuses or differs every fp8 linear decodes for the rest of the process (one warning). A layer
whose sizes `_scaled_mm` cannot take decodes too. So neither choice raises mid-forward; an explicit
`scaled_mm` that cannot run on the device is refused when the handle opens (`kernels.probe`)."""

#: rows of a scaled_mm call's first result compared with the decoded matmul's
CHECK_ROWS = 64
#: how far (relative error) a scaled_mm result may be from the decoded matmul's: the activations are
#: rounded to e4m3 (3 mantissa bits); measured 0.026 on random rows (torch's CPU kernel)
SCALED_MM_TOLERANCE = 0.125
#: compute capability from which a GPU has fp8 tensor cores (Ada, sm89): where `auto` tries scaled_mm
FP8_CORES = (8, 9)


def scaled_mm_problem(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int,
                      capability: tuple[int, int] | None = None) -> str | None:
    """Why `torch._scaled_mm` cannot be tried for this linear whatever the GPU, or None: this torch
    lacks it, the device is not CUDA, or a size is not a multiple of 16 (its documented input rules).
    Whether it runs on this GPU, dtype and torch is its trial's to say (`lingbot_core.kernels`);
    `dtype` and `capability` are kept for callers and not consulted."""
    if not hasattr(torch, "_scaled_mm") or not fp8_available():
        return "this torch has no torch._scaled_mm"
    if torch.device(device).type != "cuda":
        return f"fp8 matmuls need a CUDA device, not {torch.device(device).type}"
    if out_features % 16 or in_features % 16:
        return f"fp8 matmuls need both sizes to be multiples of 16, not {out_features}x{in_features}"
    return None


def _has_fp8_cores(device: torch.device, capability: tuple[int, int] | None) -> bool:
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    return tuple(capability) >= FP8_CORES


def choose_fp8_matmul(wanted: str, device: torch.device, dtype: torch.dtype, out_features: int, in_features: int,
                      capability: tuple[int, int] | None = None) -> str:
    """The path an fp8 linear takes for `wanted` (one of `FP8_MATMULS`): `decode`, or `scaled_mm` (tried
    under `lingbot_core.kernels`' rule, see `FP8_MATMULS`). Never raises for a device or dtype: `scaled_mm`
    where `scaled_mm_problem` finds one decodes (the handle refuses it at open on such a device); `auto`
    tries scaled_mm for bf16 on a GPU with fp8 tensor cores only. `capability` overrides the device's (tests)."""
    if wanted not in FP8_MATMULS:
        raise ValueError(f"unknown fp8 matmul {wanted!r}; choose one of {', '.join(FP8_MATMULS)}")
    if wanted == "decode" or scaled_mm_problem(device, dtype, out_features, in_features):
        return "decode"
    if wanted == "auto" and (dtype != torch.bfloat16 or not _has_fp8_cores(torch.device(device), capability)):
        return "decode"
    return "scaled_mm"


def scaled_mm_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ (q * scale)^T + bias` on fp8 tensor cores: x quantized to e4m3 with one scale per row."""
    rows = x.reshape(-1, x.shape[-1])
    row_scale = (rows.abs().amax(dim=-1, keepdim=True).float() / E4M3_MAX).clamp_(min=1e-12)
    xq = (rows.float() / row_scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(xq, q.t(), scale_a=row_scale, scale_b=scale.float().view(1, -1),
                           bias=bias, out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], q.shape[0])


def tried_scaled_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    decoded: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`scaled_mm_linear` under the trial rule of `lingbot_core.kernels` (kernel `scaled_mm`), with the
    decoded matmul as its plain path: `decoded()` gives the weight decoded to x's dtype. Its first
    call per device, dtype and torch compares its first `CHECK_ROWS` rows with the decoded matmul's."""
    def plain() -> torch.Tensor:
        return F.linear(x, decoded(), bias)

    def against_decode(out: torch.Tensor) -> str | None:
        rows = x.reshape(-1, x.shape[-1])[:CHECK_ROWS]
        got = out.reshape(-1, out.shape[-1])[:CHECK_ROWS]
        return kernels.differs(got, F.linear(rows, decoded(), bias), SCALED_MM_TOLERANCE)

    return kernels.run("scaled_mm", lambda: scaled_mm_linear(x, q, scale, bias), plain, device=x.device,
                       dtype=x.dtype, check=against_decode)


@kernels.trial_for("scaled_mm")
def _scaled_mm_trial(device: torch.device, dtype: torch.dtype, variant: str = "") -> str | None:
    """`kernels.probe`'s small trial: a 64x64 fp8 linear on 32 rows of `dtype` on `device`, judged by the
    trial rule; why it cannot be tried at all (`scaled_mm_problem`), or None."""
    problem = scaled_mm_problem(device, dtype, 64, 64)
    if problem:
        return problem
    g = torch.Generator().manual_seed(0)
    q, scale = quantize_fp8(torch.randn(64, 64, generator=g) * 0.02)
    q, scale = q.to(device), scale.to(device)
    x = torch.randn(32, 64, generator=g).to(device=device, dtype=dtype)
    tried_scaled_mm(x, q, scale, None, lambda: dequantize_fp8(q, scale, dtype, decoder="eager"))
    return None


@kernels.trial_for("compiled_decoder")
def _decoder_trial(device: torch.device, dtype: torch.dtype, variant: str = "") -> str | None:
    """`kernels.probe`'s small trial of the compiled decoders: the compiled fp8 decoder (or the format
    `variant` names, where it is fp8) over 4 rows of 64 values into `dtype` on `device`, judged by the
    trial rule. It lives here, not in `decode` (which knows no format and must not import this module)."""
    if variant and variant != FP8_ROWS.name:
        return None  # nothing small to try for this format here: the first real decode is its trial
    q, scale = quantize_fp8(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)))
    decode_rows(q.to(device), 64, FP8_ROWS, dtype, device, extra=scale.to(device), decoder="compiled")
    return None
