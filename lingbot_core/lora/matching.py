"""Matching a LoRA file against a DiT: which parameter each target changes, checked before any work.

A file's targets resolve through the model's parameter and module names (kohya's underscored paths
included). Quantized layers (fp8/GGUF, `lingbot_core.weights`) are listed under their logical names
and marked, so a LoRA on them becomes a runtime delta (`runtime.py`) instead of a merge.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..components import DITS, REFINER, TRANSFORMER
from .files import LoraError, LoraFile, _Group

DIT_COMPONENTS = DITS
TARGETS = ("auto", TRANSFORMER, REFINER, "both")


@dataclass(frozen=True)
class Patch:
    """One parameter's change from one file: a low-rank pair or a full delta (CPU tensors)."""

    param: str
    kind: str  # "lora" or "diff"
    down: torch.Tensor | None = None
    up: torch.Tensor | None = None
    diff: torch.Tensor | None = None
    scale: float = 1.0
    keys: tuple[str, ...] = ()


@dataclass
class MatchReport:
    """What a LoRA matched on one component."""

    component: str
    patches: list[Patch]
    unmatched: list[str]  # file keys that name nothing in this model
    total_keys: int

    @property
    def modules(self) -> int:
        return len({p.param.rsplit(".", 1)[0] if p.param.endswith((".weight", ".bias")) else p.param
                    for p in self.patches})

    def summary(self) -> str:
        text = f"{self.component}: {len(self.patches)} parameters in {self.modules} modules"
        if self.unmatched:
            text += f"; {len(self.unmatched)} of {self.total_keys} keys matched nothing (e.g. {self.unmatched[0]})"
        return text


def _layout(model: torch.nn.Module) -> dict[str, Any]:
    """Parameter shapes plus the module/parameter lookup tables a file's names resolve through.

    Quantized layers (fp8/GGUF, `lingbot_core.weights`) hold packed bytes, not a float weight; they
    are listed under their logical names (`to_q.weight`, `experts.w1`) and marked `quantized`, so
    a LoRA on them becomes a runtime delta instead of a merge.
    """
    from ..weights.modules import QuantizedExperts, QuantizedLinear

    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    quantized: dict[str, tuple[str, str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            params[f"{name}.weight"] = tuple(module.packing.shape)
            quantized[f"{name}.weight"] = (name, "linear")
        elif isinstance(module, QuantizedExperts):
            for w in QuantizedExperts.NAMES:
                params[f"{name}.{w}"] = tuple(module.packings[w].shape)
                quantized[f"{name}.{w}"] = (name, "experts")
    modules = {n for n, _ in model.named_modules() if n}
    underscored = {n.replace(".", "_"): n for n in [*modules, *params]}
    return {"params": params, "modules": modules, "underscored": underscored, "quantized": quantized}


def _resolve(group: _Group, layout: dict[str, Any]) -> tuple[str | None, str | None] | None:
    """(parameter the factors/.diff change, parameter .diff_b changes), or None when the model has no
    such target. A parameter path (stacked experts, the router) is its own target."""
    base = group.base
    if group.underscored:
        base = layout["underscored"].get(base)
        if base is None:
            return None
    params, modules = layout["params"], layout["modules"]
    if base in params:
        return base, None
    if base in modules and f"{base}.weight" in params:
        return f"{base}.weight", (f"{base}.bias" if f"{base}.bias" in params else None)
    return None


def _factor_patch(group: _Group, param: str, shape: tuple[int, ...], name: str) -> Patch:
    t = group.tensors
    if "down" not in t or "up" not in t:
        have = next(iter(group.keys.values()))
        missing = "up" if "down" in t else "down"
        raise LoraError(f"{name}: {have} has no matching {missing} factor; the file is incomplete")
    down, up = t["down"], t["up"]
    where = f"{name}: {group.keys['down']}"
    if down.ndim != up.ndim or down.ndim not in (2, 3):
        raise LoraError(f"{where}: factors shaped {tuple(down.shape)} and {tuple(up.shape)} are not a LoRA pair "
                        "(2-D, or 3-D for stacked experts)")
    rank = int(down.shape[-2])
    if rank == 0:
        raise LoraError(f"{where}: rank 0 (factors {tuple(down.shape)} and {tuple(up.shape)} hold nothing); "
                        "the file is empty or broken")
    if int(up.shape[-1]) != rank:
        raise LoraError(f"{where}: rank mismatch, down has rank {rank} {tuple(down.shape)} but up has "
                        f"{int(up.shape[-1])} {tuple(up.shape)}")
    if down.ndim == 3:
        if len(shape) != 3:
            raise LoraError(f"{where}: 3-D (per-expert) factors for {param}, which is {len(shape)}-D {shape}")
        if down.shape[0] != shape[0] or up.shape[0] != shape[0]:
            raise LoraError(f"{where}: the LoRA has {int(down.shape[0])} experts, {param} has {shape[0]}; it was "
                            "made for another model")
        out_shape = (int(up.shape[0]), int(up.shape[1]), int(down.shape[2]))
    else:
        if len(shape) != 2:
            raise LoraError(f"{where}: 2-D factors for {param}, which is {len(shape)}-D {shape}")
        out_shape = (int(up.shape[0]), int(down.shape[1]))
    if out_shape != shape:
        raise LoraError(f"{where}: the delta would be {out_shape} but {param} is {shape}; the LoRA was made for a "
                        "model of another size")
    scale = 1.0
    if "alpha" in t:
        alpha = t["alpha"]
        if alpha.numel() != 1:
            raise LoraError(f"{name}: {group.keys['alpha']} must hold one number, it has {alpha.numel()}")
        alpha_value = float(alpha.float().reshape(()).item())
        if not math.isfinite(alpha_value):
            raise LoraError(f"{name}: {group.keys['alpha']} is not finite")
        scale = alpha_value / rank
    group.require_finite("down", name)
    group.require_finite("up", name)
    keys = tuple(group.keys[r] for r in ("down", "up", "alpha") if r in group.keys)
    return Patch(param, "lora", down=down, up=up, scale=scale, keys=keys)


def _diff_patch(group: _Group, param: str, shape: tuple[int, ...], name: str, role: str) -> Patch:
    diff = group.tensors[role]
    if tuple(diff.shape) != shape:
        raise LoraError(f"{name}: {group.keys[role]} is {tuple(diff.shape)} but {param} is {shape}")
    group.require_finite(role, name)
    return Patch(param, "diff", diff=diff, keys=(group.keys[role],))


def match(lora: LoraFile, model: torch.nn.Module | dict[str, Any], component: str, *,
          apply_to: str = "auto") -> MatchReport:
    """Resolve `lora`'s keys on one DiT (a module, or a layout from `_layout`)."""
    layout = model if isinstance(model, dict) else _layout(model)
    patches, unmatched, total = [], [], 0
    for group in lora.groups.values():
        if not _group_targets(group, component, apply_to):
            continue
        total += len(group.keys)
        found = _resolve(group, layout)
        if found is None:
            unmatched.extend(group.keys.values())
            continue
        weight, bias = found
        roles = set(group.tensors)
        if "diff" in roles and roles & {"down", "up"}:
            raise LoraError(f"{lora.name}: {group.keys['diff']} and a LoRA pair both change {weight}; keep one")
        if "diff_b" in roles:
            if bias is None:
                unmatched.append(group.keys["diff_b"])
            else:
                patches.append(_diff_patch(group, bias, layout["params"][bias], lora.name, "diff_b"))
        if "diff" in roles:
            patches.append(_diff_patch(group, weight, layout["params"][weight], lora.name, "diff"))
        elif roles & {"down", "up", "alpha"}:
            patches.append(_factor_patch(group, weight, layout["params"][weight], lora.name))
    return MatchReport(component, patches, sorted(unmatched), total)


def _group_targets(group: _Group, component: str, apply_to: str) -> bool:
    """auto: the DiT the key's prefix names (no prefix: the base DiT); otherwise every key on the
    DiT(s) asked for, whatever its prefix."""
    if apply_to == "auto":
        return (group.component or TRANSFORMER) == component
    return apply_to == "both" or apply_to == component


def _partial_hint(report: MatchReport) -> str:
    names = " ".join(report.unmatched)
    if "shared_experts" in names or ".experts." in names or "router" in names:
        return " (it looks made for the MoE model)"
    blocks = [int(m) for m in re.findall(r"blocks[._](\d+)[._]", names)]
    if blocks:
        return f" (it reaches block {max(blocks)}: made for a deeper model)"
    return ""


def dit_layout(handle: Any, component: str) -> dict[str, Any]:
    """Parameter names and shapes of a handle's DiT without loading its weights when it is not loaded."""
    module = handle.shared.loaded.get(component)
    if isinstance(module, torch.nn.Module):
        return _layout(module)
    from ..models.transformer import LingBotVideoTransformer3DModel

    info = handle.info
    resolved = info.sources.get(component) if info is not None else None
    if resolved is not None and resolved.config is not None:  # a single DiT file: its inferred config
        config = resolved.config
    elif handle.folder is None:
        raise LoraError(f"the {component} is not loaded and this handle has no checkpoint folder to read it from")
    else:
        source = handle.shared.transformer_source if component == TRANSFORMER else None
        folder = source[0] / source[1] if source else handle.folder / component
        config = LingBotVideoTransformer3DModel.load_config(folder)
    with torch.device("meta"):
        skeleton = LingBotVideoTransformer3DModel.from_config(config)
    return _layout(skeleton)
