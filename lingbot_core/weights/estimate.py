"""Bytes a DiT will take once loaded, from file headers only (nothing is read or loaded).

This is what the memory report will show after loading and what the `auto` offload estimate plans
with: quantized tensors count their stored bytes (fp8 values + scales, GGUF blocks), plain tensors
their bytes in the dtype they load as.
"""

from __future__ import annotations

from pathlib import Path

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


def dit_load_bytes(files: list[Path], dtype: torch.dtype | None, weights: str = "auto") -> int:
    """Bytes of a DiT loaded from `files` with this dtype (None: as stored) and weights mode."""
    if not files:
        return 0
    if files[0].suffix == ".gguf":
        return sum(f.stat().st_size for f in files)  # blocks stay packed; the header is negligible
    from .sources import read_safetensors_header

    total = 0
    for f in files:
        for key, info in read_safetensors_header(f).items():
            if key == "__metadata__":
                continue
            shape = tuple(info["shape"])
            numel = 1
            for n in shape:
                numel *= n
            stored_bits = _BITS.get(info["dtype"], 32)
            if info["dtype"].startswith("F8") or key.endswith(".scale"):
                total += numel * stored_bits // 8
            elif weights == FP8 and _quantizable_on_load(key, shape):
                total += numel + 4 * (numel // shape[-1])
            elif _keeps_fp32(key):
                total += numel * 4
            else:
                bits = torch.finfo(dtype).bits if dtype is not None else stored_bits
                total += numel * bits // 8
    return total


def dit_compute_bytes(files: list[Path], dtype: torch.dtype | None) -> int:
    """Bytes per activation value the DiT computes in (dtype, else the stored dtype of its plain weights)."""
    if dtype is not None:
        return torch.finfo(dtype).bits // 8
    if not files or files[0].suffix == ".gguf":
        return 2
    from .sources import read_safetensors_header

    info = read_safetensors_header(files[0]).get("patch_embedder.weight")
    return _BITS.get(info["dtype"], 16) // 8 if info else 2
