"""Regional torch.compile: the DiT's repeated blocks compiled once, their hooks left outside.

Why not `torch.compile(model)`: the whole forward holds host work (text layout, rotary table
lookups) and placement hooks; compiling it takes minutes and breaks graphs. diffusers' regional
compile (`ModelMixin.compile_repeated_blocks`, which reads `_repeated_blocks`) compiles each
block's whole `__call__`, so the hooks that offload modes attach to a block (diffusers group
offload, disk streaming's pre/post hooks) would run inside the compiled region and break it. Here
each block's computation (`JointBlock.compute`) is compiled instead and `JointBlock.forward` calls it:
block-level hooks stay outside. All blocks share one compiled function, so one graph serves every
block (the block is an argument; its parameters are graph inputs, not constants). Consequences:
- a LoRA merge or a disk/offload rebind changes parameter values or objects, not shapes or dtypes,
  so it does not recompile;
- `dynamic=True`: a new sequence length reuses the graph instead of compiling a new one;
- the MoE FFN routes with fixed shapes in half precision (`models/moe.py`), so it compiles without
  graph breaks; fp8 / GGUF decode runs inside the region (the compiler fuses it);
- leaf-level hooks (`sequential` offload, whose accelerate hooks sit on every linear; disk
  streaming with per-leaf units) would be inside any block region: a block with a hook inside it
  runs eagerly (`transformer._hooked_inside`), so such modes run as before, never half-compiled.
"""

from __future__ import annotations

import shutil
from typing import Any

import torch
import torch.nn as nn

__all__ = ["COMPILE_CHOICES", "compile_blocks", "compile_problem", "compiled_blocks", "uncompile_blocks"]

COMPILE_CHOICES = ("off", "blocks")
"""`off`: eager. `blocks`: regional compile of the repeated blocks (inductor, dynamic shapes)."""

_COMPILED: dict[tuple[str, bool], Any] = {}


def _compiled_compute(backend: str, dynamic: bool) -> Any:
    """One compiled `JointBlock.compute` per (backend, dynamic), shared by every block of every model."""
    from .transformer import JointBlock

    key = (backend, dynamic)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(JointBlock.compute, backend=backend, dynamic=dynamic)
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
    call). Returns the number of blocks set up; `uncompile_blocks` undoes it."""
    compute = _compiled_compute(backend, dynamic)
    names = set(getattr(model, "_repeated_blocks", ()))
    count = 0
    for module in model.modules():
        if type(module).__name__ in names:
            module.compiled_compute = compute
            count += 1
    return count


def uncompile_blocks(model: nn.Module) -> None:
    for module in model.modules():
        if getattr(module, "compiled_compute", None) is not None:
            module.compiled_compute = None


def compiled_blocks(model: nn.Module) -> int:
    """How many blocks of `model` run through a compiled computation."""
    return sum(1 for m in model.modules() if getattr(m, "compiled_compute", None) is not None)
