"""The memory report: where each component's tensors are now, and how many bytes each place holds.

Bytes are those of the storages actually held (quantized weights at their stored size, a tied
embedding and head once). Under `sequential` the weights show as `meta`: between calls their
bytes live in accelerate's offload map on the CPU. Under disk-backed offload the DiTs' weights show
as `disk`: their only home is the checkpoint file (or the converted-weights cache), read a unit at a
time, so they hold no host memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..components import WEIGHTED
from .tensors import module_tensors, unique_storages

GiB = 1024**3
REPORTED = WEIGHTED  # the components with weights, in the table's order


def location(t: torch.Tensor) -> str:
    if t.device.type == "meta":
        return "meta"
    if t.device.type == "cpu":
        return "pinned CPU" if t.is_pinned() else "CPU"
    return f"accelerator ({t.device})"


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB // 100 else f"{nbytes / 2**20:.1f} MiB"


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def weight_format(module: Any) -> tuple[str, str]:
    """(how the weights are held, the dtype the matmuls compute in) for a loaded component, e.g.
    ("GGUF Q4_0 + bf16", "bf16") for a GGUF DiT (its plain layers in bf16), ("bf16", "bf16") plain."""
    from ..weights.modules import stored_formats

    plain: dict[torch.dtype, int] = {}
    compute: dict[torch.dtype, int] = {}
    packed = stored_formats(module)
    for sub in module.modules():
        dtype = getattr(sub, "compute_dtype", None)
        if isinstance(dtype, torch.dtype):
            compute[dtype] = compute.get(dtype, 0) + 1
    packed_ids = {id(t) for sub in module.modules() if isinstance(getattr(sub, "compute_dtype", None), torch.dtype)
                  for t in sub.parameters(recurse=False)}
    for t in module.parameters():
        if id(t) not in packed_ids and t.is_floating_point():
            plain[t.dtype] = plain.get(t.dtype, 0) + t.numel()
    for sub in module.modules():  # plain linear layers compute in their weight's dtype
        if isinstance(sub, torch.nn.Linear) and sub.weight.is_floating_point():
            compute[sub.weight.dtype] = compute.get(sub.weight.dtype, 0) + 1
    main_plain = max(plain, key=plain.get) if plain else None
    stored = [("GGUF " + label if label != "fp8" and not label.startswith("fp8") else label)
              for label in sorted(packed, key=lambda k: -packed[k])]
    if main_plain is not None:
        stored.append(dtype_name(main_plain))
    computes = max(compute, key=compute.get) if compute else main_plain
    return " + ".join(stored) or "no weights", dtype_name(computes) if computes is not None else "-"


@dataclass
class ComponentMemory:
    name: str
    loaded: bool
    bytes_by_location: dict[str, int] = field(default_factory=dict)
    stored: str = ""  # how the weights are held ("bf16", "GGUF Q4_0 + bf16", "fp8_e4m3 + bf16")
    compute: str = ""  # the dtype its matmuls run in

    @property
    def format(self) -> str:
        """"GGUF Q4_0 + bf16, computes bf16", or "" when not loaded."""
        return f"{self.stored}, computes {self.compute}" if self.stored else ""

    @property
    def where(self) -> str:
        if not self.loaded:
            return "not loaded"
        if not self.bytes_by_location:
            return "no weights"
        ranked = sorted(self.bytes_by_location.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{place} {_size(n)}" for place, n in ranked)


@dataclass
class MemoryReport:
    components: list[ComponentMemory]
    device: str
    mode: str
    ffn_chunks: dict[str, tuple[int | None, str]] = field(default_factory=dict)  # DiT -> (chunk, why), last run
    # the text encoder's last generation (a rewrite): context tokens and bytes by part
    # (`estimate.generation_bytes`: kv_cache, prefill, logits), held on the execution device while it ran
    generation: tuple[int, dict[str, int]] | None = None
    parallel: str | None = None  # a parallel run: the layout (the bytes above are this rank's)
    # on CUDA: each stage's last measured peak with its estimate (`calibration.MeasuredPeak`)
    measured: list[Any] = field(default_factory=list)
    # each optional fast kernel this process tried, with its verdict (`lingbot_core.kernels.summary_lines`)
    kernels: list[str] = field(default_factory=list)

    def kernel_lines(self) -> list[str]:
        return [f"fast kernel {line}" for line in self.kernels]

    def measured_lines(self) -> list[str]:
        return [f"measured {peak.line()}" for peak in self.measured]

    def parallel_line(self) -> list[str]:
        if self.parallel is None:
            return []
        return [f"parallel {self.parallel}; the bytes above are this process's (FSDP shards count their part)"]

    def generation_line(self) -> list[str]:
        if self.generation is None:
            return []
        tokens, parts = self.generation
        return [f"text_encoder generation (last rewrite): {tokens} tokens of context, about "
                f"{_size(sum(parts.values()))} on top of the weights (KV cache {_size(parts.get('kv_cache', 0))}, "
                f"prefill {_size(parts.get('prefill', 0))}, logits {_size(parts.get('logits', 0))})"]

    def chunk_lines(self) -> list[str]:
        """Which FFN/MoE chunk each DiT's last run used, and why."""
        return [f"{name} FFN/MoE: " + (f"{chunk}-token chunks" if chunk else "whole sequence") + f" ({why})"
                for name, (chunk, why) in sorted(self.ffn_chunks.items())]

    def one_line(self) -> str:
        parts = [f"{c.name}: {c.where}" + (f" ({c.format})" if c.format else "") for c in self.components]
        return "; ".join(parts + self.chunk_lines() + self.generation_line() + self.parallel_line()
                         + self.measured_lines() + self.kernel_lines())

    def totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.components:
            for place, n in c.bytes_by_location.items():
                out[place] = out.get(place, 0) + n
        return out

    def __str__(self) -> str:
        rows = [f"LingBot memory ({self.mode} offload, execution device {self.device})"]
        rows += [f"  {c.name:<13} {c.where}" + (f"  [{c.format}]" if c.format else "") for c in self.components]
        summary = ", ".join(f"{place} {n / GiB:.2f} GiB" for place, n in sorted(self.totals().items()))
        rows.append(f"  {'total':<13} {summary or 'nothing loaded'}")
        rows += [f"  {line}" for line in self.chunk_lines() + self.generation_line() + self.parallel_line()
                 + self.measured_lines() + self.kernel_lines()]
        return "\n".join(rows)


def component_memory(name: str, module: Any, state: Any = None) -> ComponentMemory:
    """Bytes per location of one component; `state` (its `weights.state.ModelState`) says which
    weights live only in their file."""
    if not isinstance(module, torch.nn.Module):
        return ComponentMemory(name, False)
    from ..weights.disk import disk_homed

    usage: dict[str, int] = {}
    on_disk = disk_homed(module, state if state is not None and state.belongs_to(module) else None)
    for t, nbytes in unique_storages(t for _o, _k, _n, t in module_tensors(module)):
        place = "disk" if id(t) in on_disk else location(t)
        usage[place] = usage.get(place, 0) + nbytes
    return ComponentMemory(name, True, usage, *weight_format(module))


def build_report(loaded: Mapping[str, Any], device: torch.device, mode: str,
                 ffn_chunks: Mapping[str, tuple[int | None, str]] | None = None,
                 generation: tuple[int, dict[str, int]] | None = None, *,
                 states: Mapping[str, Any] | None = None) -> MemoryReport:
    """`states`: the components' `weights.state.ModelState`s (which weights live only in their file)."""
    from .. import kernels

    states = states or {}
    return MemoryReport([component_memory(n, loaded.get(n), states.get(n)) for n in REPORTED], str(device), mode,
                        dict(ffn_chunks or {}), generation, kernels=kernels.summary_lines())
