"""Bytes a DiT will take once loaded, from file headers only (nothing is read or loaded).

This is what the memory report will show after loading and what the `auto` offload estimate plans
with: quantized tensors count their stored bytes (fp8 values + scales, GGUF blocks), plain tensors
their bytes in the dtype they load as.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .modules import FP8

_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "F8_E4M3": 8, "F8_E5M2": 8, "I64": 64, "I32": 32, "I16": 16,
         "I8": 8, "U8": 8, "BOOL": 8}


def _keeps_fp32(key: str) -> bool:
    from ..models.precision import stays_float32 as keeps_fp32

    return keeps_fp32(key)


def _quantizable_on_load(key: str, shape: tuple[int, ...]) -> bool:
    from .loader import quantizable

    return quantizable(key, shape)


def _headers(source: Any) -> list | None:
    """Safetensors headers of a resolved source (read when it resolved) or of files (read now);
    None for a GGUF source."""
    if source is None:
        return []
    if isinstance(source, (list, tuple)):
        if source and Path(source[0]).suffix == ".gguf":
            return None
        from .safetensors_header import read_safetensors_file

        return [read_safetensors_file(Path(f)) for f in source]
    return source.headers if source.format.name == "safetensors" else None


def dit_load_bytes(source: Any, dtype: torch.dtype | None, weights: str = "auto") -> int:
    """Bytes of a DiT loaded from `source` (a resolved `ComponentSource`, or its files) with this dtype
    (None: as stored) and weights mode."""
    sizes = dit_tensor_bytes(source, dtype, weights)
    if sizes is None:  # GGUF: blocks stay packed; the header is negligible
        files = source if isinstance(source, (list, tuple)) else source.files
        return sum(Path(f).stat().st_size for f in files)
    return sum(sizes)


def dit_tensor_bytes(source: Any, dtype: torch.dtype | None, weights: str = "auto") -> list[int] | None:
    """`dit_load_bytes` tensor by tensor (fp8 on load: the values and their scales as two); None for a
    GGUF source (its sizes are not read here)."""
    headers = _headers(source)
    if headers is None:
        return None
    out = []
    for header in headers:
        for key, info in header.tensors.items():
            shape = info.shape
            numel = 1
            for n in shape:
                numel *= n
            stored_bits = _BITS.get(info.dtype, 32)
            if info.dtype.startswith("F8") or key.endswith(".scale"):
                out.append(numel * stored_bits // 8)
            elif weights == FP8 and _quantizable_on_load(key, shape):
                out += [numel, 4 * (numel // shape[-1])]
            elif _keeps_fp32(key):
                out.append(numel * 4)
            else:
                bits = torch.finfo(dtype).bits if dtype is not None else stored_bits
                out.append(numel * bits // 8)
    return out


def dit_compute_bytes(source: Any, dtype: torch.dtype | None) -> int:
    """Bytes per activation value the DiT computes in (dtype, else the stored dtype of its plain weights)."""
    if dtype is not None:
        return torch.finfo(dtype).bits // 8
    headers = _headers(source)
    if not headers:
        return 2
    info = headers[0].tensors.get("patch_embedder.weight")
    return _BITS.get(info.dtype, 16) // 8 if info else 2
