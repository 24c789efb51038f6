"""Mixed precision for the DiT: which tensors are stored in float32 whatever the model dtype is.

The published checkpoints run their bulk matmuls in bf16 but keep everything that sets a scale in
float32: the timestep path (embedding MLP, both modulation projections, the per-block modulation
table), every norm gain, and the MoE router (its scores decide which experts run, so a rounding
change there changes outputs discretely). A tensor belongs to this float32 set when one segment of
its dotted state-dict name is one of the names below, the same test diffusers applies to
`_keep_in_fp32_modules` when it loads a checkpoint with `torch_dtype`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["FLOAT32_NAMES", "cast_split_precision", "is_split_precision_cast", "matmul_dtype", "stays_float32"]

_TIMESTEP_PATH = ("time_embedder", "time_modulation", "norm_out_modulation", "scale_shift_table")
_NORM_GAINS = ("norm", "norm1", "norm2", "norm_q", "norm_k", "norm_post_attn", "norm_post_ffn", "norm_out")
_EXPERT_CHOICE = ("router",)

FLOAT32_NAMES: tuple[str, ...] = _TIMESTEP_PATH + _NORM_GAINS + _EXPERT_CHOICE
_FLOAT32_SET = frozenset(FLOAT32_NAMES)


def stays_float32(tensor_name: str) -> bool:
    """True for a parameter/buffer name (e.g. `blocks.3.attn.norm_q.weight`) in the float32 set."""
    return not _FLOAT32_SET.isdisjoint(tensor_name.split("."))


def is_split_precision_cast(dtype: torch.dtype | None) -> bool:
    """A requested dtype the float32 set must be protected from: any floating type but float32."""
    return dtype is not None and dtype.is_floating_point and dtype != torch.float32


def cast_split_precision(model: nn.Module, dtype: torch.dtype, *, non_blocking: bool = False) -> None:
    """Store every floating tensor of `model` in `dtype`, except the float32 set, in place.

    Works module by module on the tensors each one owns, so the parameter objects (and whatever
    holds references to them, such as hooks and optimisers) survive the cast.
    """
    for prefix, module in model.named_modules():
        for store in (module._parameters, module._buffers):
            for local_name, tensor in store.items():
                if tensor is None or not tensor.is_floating_point():
                    continue
                full_name = f"{prefix}.{local_name}" if prefix else local_name
                wanted = torch.float32 if stays_float32(full_name) else dtype
                if tensor.dtype != wanted:
                    tensor.data = tensor.data.to(dtype=wanted, non_blocking=non_blocking)


def matmul_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype a linear layer computes in: its weight's, or a quantized layer's compute dtype
    (whose packed weight is decoded only when it computes; see `lingbot_core.weights.modules`)."""
    packed = getattr(layer, "compute_dtype", None)
    return packed if isinstance(packed, torch.dtype) else layer.weight.dtype
