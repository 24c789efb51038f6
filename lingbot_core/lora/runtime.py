"""LoRA on quantized layers: a delta added to the layer's output at run time, the packed weight untouched.

fp8/GGUF layers (`weights.modules`) hold packed bytes a merge cannot change exactly, so each patch on
them becomes a function the layer adds to its output (`QuantizedLinear.add_delta`), or, for stacked
experts, a per-expert function run only for the experts the block routes tokens to
(`QuantizedExperts.add_delta`). What was added is written on the model's `ModelState.runtime`, so
`remove_deltas` takes off exactly ours.
"""

from __future__ import annotations

import torch

from ..weights.state import ModelState
from .matching import Patch


def add_deltas(module: torch.nn.Module, state: ModelState, live: list[tuple[float, Patch]],
               quantized: dict[str, tuple[str, str]]) -> list[tuple[float, Patch]]:
    """Add a runtime delta for every patch on a quantized layer; returns the patches left to merge."""
    if not any(p.param in quantized for _s, p in live):
        return live
    layers = dict(module.named_modules())
    for strength, patch in live:
        if patch.param not in quantized:
            continue
        owner, kind = quantized[patch.param]
        coefficient = strength if patch.kind == "diff" else strength * patch.scale
        layer = layers[owner]
        if kind == "linear":
            fn = _runtime_delta(patch, coefficient)
            layer.add_delta(fn)
            state.runtime.append((layer, fn))
        else:  # stacked experts: a per-expert delta on w1/w2/w3, run only for the routed experts
            state.runtime.append((layer, layer.add_delta(patch.param.rsplit(".", 1)[1],
                                                          _expert_runtime_delta(patch, coefficient))))
    return [(s, p) for s, p in live if p.param not in quantized]


def remove_deltas(state: ModelState) -> None:
    """Take off the runtime deltas `add_deltas` added (and only those)."""
    for layer, fn in state.runtime:
        if fn in layer.deltas:
            layer.deltas.remove(fn)
    state.runtime.clear()


def _runtime_delta(patch: Patch, coefficient: float):
    """`x -> coefficient * x @ (up @ down)^T` (or `x @ diff^T`), computed in float32 on x's device.

    The factors stay on the CPU and travel with each call, so every offload mode computes the same
    thing; the quantized weight itself is never touched.
    """
    import torch.nn.functional as F

    if patch.kind == "diff":
        diff = patch.diff

        def delta(x: torch.Tensor) -> torch.Tensor:
            return F.linear(x.float(), diff.to(x.device, torch.float32)) * coefficient
    else:
        down, up = patch.down, patch.up

        def delta(x: torch.Tensor) -> torch.Tensor:
            h = F.linear(x.float(), down.to(x.device, torch.float32))
            return F.linear(h, up.to(x.device, torch.float32)) * coefficient
    return delta


def _expert_runtime_delta(patch: Patch, coefficient: float):
    """`(e, rows) -> coefficient * rows @ (up[e] @ down[e])^T` (or `rows @ diff[e]^T`) in float32.

    Factors are [E, r, in] / [E, out, r] (a diff is [E, out, in]) and stay on the CPU; only expert
    e's slice travels to the rows' device, and only for the experts the block routes tokens to.
    """
    import torch.nn.functional as F

    if patch.kind == "diff":
        diff = patch.diff

        def delta(e: int, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x.float(), diff[e].to(x.device, torch.float32)) * coefficient
    else:
        down, up = patch.down, patch.up

        def delta(e: int, x: torch.Tensor) -> torch.Tensor:
            h = F.linear(x.float(), down[e].to(x.device, torch.float32))
            return F.linear(h, up[e].to(x.device, torch.float32)) * coefficient
    return delta
