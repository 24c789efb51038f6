"""Regional torch.compile: the DiT's repeated blocks compiled once, their hooks left outside.

Why not `torch.compile(model)`: the whole forward holds host work (text layout, rotary table
lookups) and placement hooks; compiling it takes minutes and breaks graphs. diffusers' regional
compile (`ModelMixin.compile_repeated_blocks`, which reads `_repeated_blocks`) compiles each
block's whole `__call__`, so the hooks that offload modes attach to a block (diffusers group
offload, disk streaming's pre/post hooks) would run inside the compiled region and break it. Here
each block's computation (`JointBlock.compute`) is compiled instead and `JointBlock.forward` calls it:
block-level hooks stay outside. The compiled computation is carried by a named hook on each block
(`CompiledRegion`, `lingbot.compiled_region` in `lingbot_core.hooks`), so compiled regions are listed,
counted and removed like every other hook; it is `lasting` (an offload mode's strip leaves it on) and
passes calls through itself, so its place among the block's hooks does not matter. All blocks share one compiled function, so one graph serves every
block (the block is an argument; its parameters are graph inputs, not constants). Consequences:
- a LoRA merge or a disk/offload rebind changes parameter values or objects, not shapes or dtypes,
  so it does not recompile;
- `dynamic=True`: a new sequence length reuses the graph instead of compiling a new one;
- the MoE FFN routes with fixed shapes in half precision (`models/moe.py`), so it compiles without
  graph breaks; fp8 / GGUF decode runs inside the region (the compiler fuses it);
- the MoE FFN in float32 (which `torch._grouped_mm` cannot trace) runs its expert loop as one
  opaque op of fixed output shape (`moe.expert_loop`): no graph break, no recompile per routing;
- leaf-level hooks (`sequential` offload, whose accelerate hooks sit on every linear; disk
  streaming with per-layer units) would be inside the block's region. `run_compiled` keeps them
  outside: the weight-moving hooks inside the block (`WEIGHT_MOVERS`) run their pre-forwards
  first (the block's weights come in, as under `group`; the sequential estimate already counts a
  block), the compiled computation runs on the plain modules (their hook-wrapped `forward`s set
  aside), then the post-forwards send the weights back. Any other hook inside (a torch hook, a
  hook of unknown kind) and the block runs eagerly, as before, never half-compiled;
- the compiled region is a fast kernel of `lingbot_core.kernels` (`compiled_blocks`): where its first
  call fails to compile (an old GPU triton has no code for, a missing compiler) or differs from the
  eager block, the blocks run eagerly for the rest of the process, with one warning.
"""

from __future__ import annotations

import shutil
from typing import Any

import torch
import torch.nn as nn

from .. import hooks, kernels

__all__ = ["COMPILED_REGION", "COMPILE_CHOICES", "WEIGHT_MOVERS", "CompiledRegion", "compile_blocks", "compile_problem",
           "compiled_blocks", "run_compiled", "uncompile_blocks"]

#: how far (relative error) a compiled block's first output may be from the eager block's: the compiler
#: fuses and reorders float ops (bf16 rounds between them)
COMPILE_TOLERANCE = 2e-2

COMPILE_CHOICES = ("off", "blocks")
"""`off`: eager. `blocks`: regional compile of the repeated blocks (inductor, dynamic shapes)."""

_COMPILED: dict[tuple[str, bool], Any] = {}

WEIGHT_MOVERS = ("accelerate", "lingbot.disk_stream")
"""Hooks (`lingbot_core.hooks` names) that only bring a module's weights in before its forward and
take them out after, whatever the inputs: they can run around a compiled block instead of inside it."""


COMPILED_REGION = "lingbot.compiled_region"


@hooks.named(COMPILED_REGION, "regional compile: the block's forward runs its computation compiled (models/compile.py)",
             lasting=True)
class CompiledRegion(hooks.Hook):
    """The compiled computation of one repeated block (`compute`); the block's forward finds it here and
    runs it (`run_compiled`). The hook itself passes every call through unchanged."""

    def __init__(self, compute: Any):
        super().__init__()
        self.compute = compute


def hooks_inside(block: nn.Module) -> list[tuple[nn.Module, list[Any]]] | None:
    """(module, its hooks) for every hooked module inside `block` (the block's own hooks run outside
    anyway); None when one of them cannot be moved outside (a torch hook, or not a `WEIGHT_MOVERS` hook)."""
    found = []
    for module in block.modules():
        if module is block:
            continue
        if module._forward_pre_hooks or module._forward_hooks:
            return None
        attached = hooks.attached(module)
        if attached:
            if any(name not in WEIGHT_MOVERS for name, _hook in attached):
                return None
            found.append((module, [hook for _name, hook in attached]))
        elif "forward" in module.__dict__:  # a wrapped forward with no hook we know
            return None
    return found


def run_compiled(block: nn.Module, compute: Any, *args: Any) -> Any:
    """One call of `block` through `compute`, its compiled computation, weight-moving hooks inside it run
    around the call (see the module docstring); eagerly when a hook inside cannot be moved out.

    The compiled region is the `compiled_blocks` kernel of `lingbot_core.kernels`: its first call per
    device, dtype and torch compiles and is compared with the eager block; a compiler failure (no
    triton for this GPU, an op it cannot lower) or a mismatch runs the blocks eagerly from then on, with
    one warning, and that call gives the eager output."""
    inside = hooks_inside(block)
    if inside is None:
        return block.compute(*args)
    x = args[0]
    dtype = block.compute_dtype() if hasattr(block, "compute_dtype") else x.dtype

    def against_eager(out: torch.Tensor) -> str | None:
        return kernels.differs(out, block.compute(*args), COMPILE_TOLERANCE)

    return kernels.run("compiled_blocks", lambda: _through(block, compute, inside, *args), lambda: block.compute(*args),
                       device=x.device, dtype=dtype, check=against_eager)


def _through(block: nn.Module, compute: Any, inside: list[tuple[nn.Module, list[Any]]], *args: Any) -> Any:
    """`compute(block, *args)` with the weight-moving hooks `inside` the block run around it."""
    if not inside:
        return compute(block, *args)
    entered: list[tuple[nn.Module, Any]] = []
    wrapped: list[tuple[nn.Module, Any]] = []
    try:
        for module, module_hooks in inside:
            for hook in module_hooks:
                hook.pre_forward(module)
                entered.append((module, hook))
        for module, _hooks in inside:
            wrapped.append((module, module.__dict__.pop("forward", None)))
        return compute(block, *args)
    finally:
        for module, forward in wrapped:
            if forward is not None:
                module.__dict__["forward"] = forward
        for module, hook in reversed(entered):
            hook.post_forward(module, None)


def _compiled_compute(block_type: type, backend: str, dynamic: bool) -> Any:
    """One compiled `block_type.compute` (`JointBlock`'s) per (backend, dynamic), shared by every block of
    every model."""
    key = (backend, dynamic)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(block_type.compute, backend=backend, dynamic=dynamic)
    return _COMPILED[key]


def compile_problem(device: torch.device | str, backend: str = "inductor") -> str | None:
    """Why `backend` cannot compile for `device` here, or None (checked before anything loads)."""
    if backend != "inductor":
        return None
    device = torch.device(device)
    if device.type == "cpu" and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "compile=blocks on the CPU needs a C++ compiler (g++ or clang++) on PATH; install one or set compile=off"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "compile=blocks on CUDA needs the `triton` package; install it or set compile=off"
    return None


def compile_blocks(model: nn.Module, *, backend: str = "inductor", dynamic: bool = True) -> int:
    """Compile the computation of each repeated block of `model` (compilation happens at the first
    call): a `CompiledRegion` hook on each. Returns the number of blocks set up; compiling again
    replaces the hooks; `uncompile_blocks` (or `hooks.strip`) takes them off."""
    names = set(getattr(model, "_repeated_blocks", ()))
    count = 0
    for module in model.modules():
        if type(module).__name__ in names:
            hooks.detach(module, COMPILED_REGION)
            hooks.attach(module, CompiledRegion(_compiled_compute(type(module), backend, dynamic)))
            count += 1
    return count


def uncompile_blocks(model: nn.Module) -> None:
    """Take every compiled region off `model` (its blocks run eagerly again)."""
    for module in model.modules():
        hooks.detach(module, COMPILED_REGION)


def compiled_blocks(model: nn.Module) -> int:
    """How many blocks of `model` run through a compiled computation."""
    return sum(1 for _module, _hook in hooks.hooks_named(model, COMPILED_REGION))


@kernels.trial_for("compiled_blocks")
def _compiled_blocks_trial(device: torch.device, dtype: torch.dtype, variant: str = "") -> str | None:
    """`kernels.probe`'s trial: why the compiler cannot build for `device` (`compile_problem`), or None.
    Compiling a real block takes a minute: the first real call is the trial that runs one."""
    return compile_problem(device)
