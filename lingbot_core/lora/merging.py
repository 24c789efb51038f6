"""Merging a LoRA stack into a DiT's float weights, exactly reversible.

Arithmetic (float32 whatever the weight dtype, cast back once): W' = W + sum over the stack of
float32(strength * scale) * (up.float() @ down.float()) (batched per expert for 3-D factors),
diffs add float32(strength) * diff. scale = alpha / rank when the file has an alpha, else 1.
The factors are upcast *before* the product: multiplying bf16 factors in bf16 is visibly wrong.

Exactness: the first LoRA on a parameter keeps a pristine CPU copy of it (only the targeted
parameters) on the model's `ModelState`; every application starts from that copy and removal
copies it back, so removing a LoRA or changing its strength restores the weights bit for bit.
Patches on quantized layers become runtime deltas instead (`runtime.py`).

FSDP (`distributed/fsdp.py`): a sharded parameter is a DTensor whose rank holds some rows. The pristine
copy is then this rank's rows only, and the merge adds this rank's rows of the delta (the whole delta
is formed on every rank from the LoRA file, which each rank reads, then cut by the parameter's own
placement: no communication), so merging costs each rank its share and comes off bit for bit too.
"""

from __future__ import annotations

import torch

from ..weights.state import ModelState
from .files import LoraError
from .matching import Patch, _layout
from .runtime import add_deltas, remove_deltas


def pristine_copies(state: ModelState | None) -> dict[str, torch.Tensor]:
    """The saved originals of the parameters a LoRA changed on the model `state` belongs to (empty when none)."""
    return dict(state.pristine) if state is not None else {}


def _local(param: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds of `param`: its rows of a sharded (DTensor) parameter, else itself."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def _local_rows(param: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """This process's part of a whole-parameter `delta`, cut the way `param` is sharded."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return delta
    # src_data_rank=None: every rank holds the same whole delta, so each keeps its own part, no transfer
    return distribute_tensor(delta, param.device_mesh, param.placements, src_data_rank=None).to_local()


def restore(module: torch.nn.Module, state: ModelState) -> None:
    """Put back the original value of every parameter a LoRA changed (bit-exact) and forget the copies;
    take off the runtime deltas it added to quantized layers."""
    remove_deltas(state)
    saved, state.pristine = state.pristine, {}
    if not saved:
        return
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, original in saved.items():
            _local(params[name]).copy_(original)


def _delta(patch: Patch, coefficient: torch.Tensor) -> torch.Tensor:
    if patch.kind == "diff":
        return coefficient * patch.diff.float()
    return coefficient * torch.matmul(patch.up.float(), patch.down.float())


def merge(module: torch.nn.Module, state: ModelState, patches: list[tuple[float, Patch]]) -> None:
    """W' = pristine(W) + sum of deltas, in float32, cast back to W's dtype once."""
    restore(module, state)
    live = [(s, p) for s, p in patches if s != 0.0]
    if not live:
        return
    live = add_deltas(module, state, live, _layout(module)["quantized"])
    if not live:
        return
    params = dict(module.named_parameters())
    by_param: dict[str, list[tuple[float, Patch]]] = {}
    for strength, patch in live:
        by_param.setdefault(patch.param, []).append((strength, patch))
    from ..weights.disk import materialize

    if materialize(module, state, set(by_param)):  # disk offload: the targeted weights were still in their file
        params = dict(module.named_parameters())
    for name in by_param:
        param = params[name]
        if param.device.type == "meta":
            raise LoraError(f"cannot merge a LoRA into {name}: its weights are on the meta device (the stage door "
                            "must hand plain modules to LoRA application)")
        if not param.dtype.is_floating_point or param.dtype.itemsize < 2:
            raise LoraError(f"cannot merge a LoRA into {name} stored as {param.dtype}: merged LoRAs need "
                            "bf16/fp16/fp32 weights")
    saved = {name: _local(params[name]).detach().to("cpu", copy=True) for name in by_param}
    state.pristine = saved
    with torch.no_grad():
        for name, items in by_param.items():
            acc = saved[name].float()
            for strength, patch in items:
                scale = strength if patch.kind == "diff" else strength * patch.scale
                term = _local_rows(params[name], _delta(patch, torch.tensor(scale, dtype=torch.float32)))
                acc = acc + term.to(acc.device)
            target = _local(params[name])
            target.copy_(acc.to(target.dtype))
