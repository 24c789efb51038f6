"""The tensor checks every loader uses: the shapes a config implies (its skeleton built on `meta`,
memoised), a stored tensor set held against them (`tensor_set_problems`, `compare_shapes`), and the
NaN/inf scan of a loaded component (`scan_non_finite`, the one check that reads tensors).

Callers check a checkpoint's configs first (`checkpoints.configs`), so no skeleton is built from an
unbounded value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .safetensors_header import StoredTensor

CheckFailed = CheckpointError  # the name used inside this module


# -- shapes ----------------------------------------------------------------------------------------

_SHAPE_MEMO: dict[tuple[str, str], dict[str, tuple[int, ...]]] = {}


def _memo(kind: str, config: Mapping[str, Any], build) -> dict[str, tuple[int, ...]]:
    key = (kind, json.dumps(config, sort_keys=True, default=str))
    if key not in _SHAPE_MEMO:
        if len(_SHAPE_MEMO) > 32:
            _SHAPE_MEMO.clear()
        _SHAPE_MEMO[key] = build()
    return _SHAPE_MEMO[key]


def _skeleton_shapes(make, where: str) -> dict[str, tuple[int, ...]]:
    from ..interrupt import check_interrupt, interruptible_build

    check_interrupt()
    with interruptible_build() as cancelled:
        try:
            with torch.device("meta"):
                module = make()
        except Exception as err:  # the library's own error about a config it cannot build
            if cancelled:
                raise
            raise CheckFailed(f"{where}: the config cannot build the model ({type(err).__name__}: "
                              f"{str(err)[:300]}). Re-download the checkpoint.") from err
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def dit_shapes(config: Mapping[str, Any], where: str) -> dict[str, tuple[int, ...]]:
    from ..models.transformer import LingBotVideoTransformer3DModel

    clean = {k: v for k, v in config.items() if not k.startswith("_")}
    return _memo("dit", clean, lambda: _skeleton_shapes(
        lambda: LingBotVideoTransformer3DModel.from_config(clean), where))


def vae_shapes(config: Mapping[str, Any], where: str) -> dict[str, tuple[int, ...]]:
    from diffusers import AutoencoderKLWan

    clean = {k: v for k, v in config.items() if not k.startswith("_")}
    return _memo("vae", clean, lambda: _skeleton_shapes(lambda: AutoencoderKLWan.from_config(clean), where))


def text_encoder_shapes(folder: Path, config: Mapping[str, Any], where: str) -> dict[str, tuple[int, ...]]:
    def build() -> dict[str, tuple[int, ...]]:
        from transformers import AutoConfig, Qwen3VLForConditionalGeneration

        try:
            hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=False, local_files_only=True)
        except Exception as err:
            raise CheckFailed(f"{where}: transformers cannot read it ({type(err).__name__}: {str(err)[:300]}). "
                              "Re-download the checkpoint.") from err
        return _skeleton_shapes(lambda: Qwen3VLForConditionalGeneration._from_config(hf_config), where)

    return _memo("text_encoder", config, build)


def compare_shapes(component: str, where: Path, stored: Mapping[str, StoredTensor],
                   expected: Mapping[str, tuple[int, ...]], *, strict_names: bool = True,
                   ignore_missing: Iterable[str] = ()) -> None:
    """Stored tensors against the shapes the config implies.

    ``strict_names`` False compares only the tensors present under both names (for stores whose key
    names a library may remap on load, or that carry extra quantization scales); wrong shapes are
    always refused.
    """
    # fp8 stores keep their own packed layout; their shapes are checked by the weights loader
    comparable = {k: expected[k] if v.dtype.startswith("F8") and k in expected else v.shape
                  for k, v in stored.items() if strict_names or k in expected}
    problems = tensor_set_problems(comparable, expected,
                                   ignore_missing=ignore_missing if strict_names else expected)
    if problems:
        raise CheckFailed(f"{component}: the weights in {where} do not match its config: {'; '.join(problems)}. "
                          "The folder is incomplete or from another model; re-download it.")


def tensor_set_problems(stored: Mapping[str, Any], expected: Mapping[str, Any], *,
                        ignore_missing: Iterable[str] = ()) -> list[str]:
    """What differs between stored tensor shapes and the shapes a config implies, one phrase per kind.

    The one comparison behind every "the weights do not match the config" error (open-time checks,
    the state-dict check, the weights loader); each caller wraps the phrases in its own error.
    """
    missing = sorted(set(expected) - set(stored) - set(ignore_missing))
    unexpected = sorted(set(stored) - set(expected))
    wrong = sorted(k for k in set(stored) & set(expected) if tuple(stored[k]) != tuple(expected[k]))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensors (e.g. {', '.join(map(shown_name, missing[:3]))})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensors (e.g. {', '.join(map(shown_name, unexpected[:3]))})")
    if wrong:
        k = wrong[0]
        problems.append(f"{len(wrong)} tensors with the wrong shape (e.g. {shown_name(k)}: stored "
                        f"{_shown_shape(stored[k])}, config implies {list(expected[k])})")
    return problems


SHOWN_NAME = 120
"""Characters of a tensor name a message shows (a file may name a tensor with 20 MB)."""


def shown_name(name: str) -> str:
    """A tensor name as a message shows it: clipped to `SHOWN_NAME` characters."""
    return name if len(name) <= SHOWN_NAME else f"{name[:SHOWN_NAME - 3]}..."


def _shown_shape(shape: Any) -> str:
    text = str(list(shape))
    return text if len(text) <= 80 else text[:77] + "...]"


# -- weights after loading -------------------------------------------------------------------------

def scan_non_finite(module: torch.nn.Module, component: str, where: Path) -> None:
    """Refuse a loaded component whose weights hold NaN or infinity (a corrupt or broken export).

    One float32-accumulated sum per tensor: NaN or inf anywhere makes the sum non-finite, and no
    temporary the size of the tensor is allocated; only a suspicious tensor gets the exact check.
    Tensors on the meta device (not materialised yet) are skipped. Packed fp8/GGUF weights (integer
    bytes) get their own cheap check (`weights.scan`: NaN fp8 codes, non-finite scales and block fields).
    """
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.device.type == "meta" or not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        with torch.no_grad():
            if math.isfinite(_sum(tensor)):
                continue
            bad = sum(int((~torch.isfinite(chunk.float())).sum()) for chunk in _chunks(tensor))
        if bad == 0:
            continue  # a finite tensor whose sum overflowed float32 (not seen in practice)
        raise CheckFailed(f"{component}: weight {name} in {where} holds {bad} NaN/inf value(s); the file is "
                          "corrupt or was exported wrongly. Re-download it.")
    from .scan import packed_non_finite

    for name, what in packed_non_finite(module):
        raise CheckFailed(f"{component}: quantized weight {name} in {where} holds {what}, so it decodes to NaN/inf; "
                          "the file is corrupt or was exported wrongly. Re-download it, or re-create it with "
                          "`python -m lingbot_core.quantize` from the original checkpoint.")


_NATIVE_SUM = (torch.float32, torch.float16, torch.bfloat16)


def _chunks(tensor: torch.Tensor, size: int = 1 << 24) -> Iterable[torch.Tensor]:
    flat = tensor.detach().reshape(-1)
    return (flat[i:i + size] for i in range(0, flat.numel(), size))


def _sum(tensor: torch.Tensor) -> float:
    """A float32-accumulated sum; dtypes without a native sum (fp8) go through small float chunks."""
    if tensor.dtype in _NATIVE_SUM:
        return float(tensor.sum(dtype=torch.float32))
    if tensor.dtype == torch.float64:
        return float(tensor.sum())
    return float(sum(chunk.float().sum() for chunk in _chunks(tensor)))
