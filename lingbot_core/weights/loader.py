"""Load a LingBot DiT (transformer/ or refiner/) tensor by tensor, never holding more than it must.

The model is built on the `meta` device (no memory), then every tensor is read from its
file straight into its target form and assigned: plain weights in their target dtype, quantized
weights (pre-quantized fp8, GGUF blocks, or fp8 quantized here on load) into `QuantizedLinear` /
`QuantizedExperts`. Peak host memory is the finished model plus the tensor being converted; a bf16
checkpoint never passes through float32.

dtype: `None` ("auto") keeps each tensor's stored dtype; a dtype converts to it. Either way the
reference's fp32-kept modules (norms, modulation, router, ...) are float32. Quantized layers
compute in `compute dtype`: the dtype asked for, else the stored dtype of the plain weights (bf16 for
a published checkpoint; bf16 when everything is quantized).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..components import DITS, TRANSFORMER
from ..errors import WeightsError
from . import gguf_codec
from .checks import shown_name, tensor_set_problems
from .converted import Planned
from .disk import note_exact
from .fp8 import require_fp8
from .modules import FP8, Packing, QuantizedExperts, QuantizedLinear, pack_fp8
from .resolve import ComponentSource, check_weights_mode_for, folder_source
from .sources import SCALE_SUFFIX, Entry, GGUFSource
from .state import ModelState

WEIGHT_MODES = ("auto", FP8)
# Small layers kept in the compute dtype when quantizing on load (64-wide input / output).
NOT_QUANTIZED_ON_LOAD = ("patch_embedder", "proj_out")
_CPU = torch.device("cpu")


def quantizable(key: str, shape: tuple[int, ...], keeps_fp32=None) -> bool:
    """Whether a stored tensor is a weight we quantize: a linear weight or an expert stack, not one of
    the reference's fp32-kept modules, not the 64-wide patch embedder / output projection."""
    if keeps_fp32 is None:
        from ..models.precision import stays_float32 as keeps_fp32
    return (len(shape) >= 2 and key.endswith((".weight", ".experts.w1", ".experts.w2", ".experts.w3"))
            and not keeps_fp32(key) and key.split(".")[0] not in NOT_QUANTIZED_ON_LOAD)


def _auto_compute_dtype(entries: dict[str, Entry]) -> torch.dtype:
    probe = entries.get("patch_embedder.weight")
    if probe is None or probe.quantized:
        return torch.bfloat16
    if probe.kind == "plain" and not probe.decode:
        return probe.dtype if probe.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16
    return torch.float32 if probe.gguf_type == 0 else torch.bfloat16


def check_entries(component: str, where: Path, entries: dict[str, Entry], expected: dict[str, tuple[int, ...]]) -> None:
    """Names and logical shapes of the stored tensors against the config; raise naming the tensor."""
    problems = tensor_set_problems({k: e.shape for k, e in entries.items()}, expected)
    integer = sorted(k for k, e in entries.items() if e.kind == "plain" and not e.dtype.is_floating_point)
    if integer:  # a weight stored as integers would be cast and run: silently wrong frames
        k = integer[0]
        raise WeightsError(f"{component}: weight {shown_name(k)} in {where} is stored as "
                           f"{str(entries[k].dtype).replace('torch.', '')} ({len(integer)} integer tensors in all); "
                           "DiT weights are floats (F32/F16/BF16, F8_E4M3 with scales, or GGUF). The file is corrupt "
                           "or not a LingBot-Video DiT.")
    if problems:
        raise WeightsError(f"{component}: the weights in {where} do not match its config.json: {'; '.join(problems)}. "
                           "The file is incomplete or from another model; re-download or re-create it.")


def _owner(model: nn.Module, key: str) -> tuple[nn.Module, str]:
    path, _, leaf = key.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, child = _owner(model, name)
    setattr(parent, child, new)


class _Loader:
    def __init__(self, model: nn.Module, source: Any, dtype: torch.dtype | None, weights: str, keeps_fp32,
                 streamed: bool = False):
        self.model, self.source, self.dtype, self.weights = model, source, dtype, weights
        self.keeps_fp32 = keeps_fp32
        self.streamed = streamed  # tensors kept exactly as stored are not read: they stay on meta (disk offload)
        self.entries: dict[str, Entry] = source.entries
        self.compute = dtype or _auto_compute_dtype(self.entries)
        self.done: set[str] = set()
        self.spans: dict = {}  # model tensor name -> FileSpan, for tensors kept exactly as stored
        self.read = 0  # tensors read from the files (not left on meta)
        # streamed: the converted tensors, made later into the converted-weights cache (weights.converted)
        self.conversions: list[tuple[list[Planned], Any]] | None = [] if streamed else None

    # -- reading --------------------------------------------------------------------------------
    def target_dtype(self, key: str) -> torch.dtype:
        if self.keeps_fp32(key):
            return torch.float32
        if self.dtype is not None:
            return self.dtype
        entry = self.entries[key]
        if entry.kind == "plain" and entry.dtype.is_floating_point and not entry.decode:
            return entry.dtype
        return self.compute

    def _stored_as(self, key: str, dtype: torch.dtype) -> bool:
        """Is `key` stored exactly as `dtype` (so its bytes in the file are the tensor)?"""
        entry = self.entries[key]
        if entry.kind == "plain":  # a stack stored per expert is not one span; a decoded GGUF tensor not either
            return entry.dtype == dtype and not entry.parts and not entry.decode
        return (entry.kind == "gguf" and not entry.parts and gguf_codec.is_plain(entry.gguf_type)
                and GGUFSource._plain_dtype(entry) == dtype)

    def _span_or_read(self, name: str, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor kept as stored: recorded with its disk home, and read unless the load is streamed."""
        span = self.spans[name] = self.source.span(key, dtype, shape)
        if self.streamed:
            return torch.empty(shape, dtype=dtype, device="meta")
        self.read += 1
        return span.read(_CPU)

    def _converted(self, specs: list[Planned], produce) -> list[torch.Tensor]:
        """Tensors that must be converted: made now, or (streamed) planned for the converted-weights
        cache and left on meta, their disk home being that cache."""
        def made():
            self.read += 1
            return produce()

        if self.conversions is None:
            return list(made())
        self.conversions.append((specs, made))
        return [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in specs]

    def plain(self, key: str) -> torch.Tensor:
        self.done.add(key)
        dtype = self.target_dtype(key)
        shape = tuple(self.entries[key].shape)
        if self._stored_as(key, dtype):
            return self._span_or_read(key, key, dtype, shape)
        return self._converted([Planned(key, dtype, shape)], lambda: [self.source.plain(key, dtype)])[0]

    def packed(self, key: str, quantize: bool, data_key: str = "", scale_key: str = ""
               ) -> tuple[Packing, torch.Tensor | list[torch.Tensor], torch.Tensor | None]:
        """How the quantized module holds `key`: stored fp8/GGUF bytes, or fp8 made here from a plain tensor.

        `data_key` / `scale_key`: the model's names for the packed tensors (their disk homes are recorded).
        A GGUF expert stack stored per expert stays per expert: a list of tensors, `data_key.{e}` each.
        """
        entry = self.entries[key]
        self.done.add(key)
        if entry.kind == "fp8":
            require_fp8()
            shape = tuple(entry.shape)
            data = self._span_or_read(data_key, key, torch.uint8, shape)
            scale = self._span_or_read(scale_key, key + SCALE_SUFFIX, torch.int32, shape[:-1])
            return Packing(FP8, entry.shape), data, scale
        if entry.kind == "gguf" and entry.parts:
            shape = (*entry.shape[1:-1], gguf_codec.bytes_per_row(entry.gguf_type, entry.shape[-1]))
            parts = [self._span_or_read(f"{data_key}.{e}", stored, torch.uint8, shape)
                     for e, stored in enumerate(entry.parts)]
            return Packing("gguf", entry.shape, entry.gguf_type), parts, None
        if entry.kind == "gguf":
            shape = (*entry.shape[:-1], gguf_codec.bytes_per_row(entry.gguf_type, entry.shape[-1]))
            data = self._span_or_read(data_key, key, torch.uint8, shape)
            return Packing("gguf", entry.shape, entry.gguf_type), data, None
        if quantize:
            shape = tuple(entry.shape)
            data, scale = self._converted([Planned(data_key, torch.uint8, shape),
                                           Planned(scale_key, torch.int32, shape[:-1])],
                                          lambda: pack_fp8(self.source.plain(key)))
            return Packing(FP8, entry.shape), data, scale
        raise AssertionError(key)

    # -- modules --------------------------------------------------------------------------------
    def quantize_here(self, name: str) -> bool:
        return (self.weights == FP8 and not self.keeps_fp32(name)
                and name.split(".")[0] not in NOT_QUANTIZED_ON_LOAD)

    def linear(self, name: str, module: nn.Linear) -> None:
        key = f"{name}.weight"
        entry = self.entries[key]
        if not entry.quantized and not self.quantize_here(name):
            return
        if self.keeps_fp32(name):
            # a quantized file may pack the router or modulation too: they compute in float32 here
            self.assign(key)
            return
        packing, data, scale = self.packed(key, True, f"{name}.qdata", f"{name}.qscale")
        bias = self.plain(f"{name}.bias") if module.bias is not None else None
        _replace(self.model, name, QuantizedLinear(packing, data, scale, bias, self.compute))

    def experts(self, name: str) -> None:
        keys = [f"{name}.{w}" for w in QuantizedExperts.NAMES]
        if not any(self.entries[k].quantized for k in keys) and not self.quantize_here(name):
            return
        packed = {w: self.packed(k, True, f"{name}.{w}_qdata", f"{name}.{w}_qscale")
                  for w, k in zip(QuantizedExperts.NAMES, keys)}
        _replace(self.model, name, QuantizedExperts(packed, self.compute))

    def assign(self, key: str) -> None:
        owner, leaf = _owner(self.model, key)
        tensor = self.plain(key)
        if leaf in owner._parameters:
            owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        else:
            owner._buffers[leaf] = tensor


def check_weights_mode(weights: str) -> None:
    """Refuse an unknown mode, or fp8 on a torch without float8 dtypes, before anything loads."""
    if weights not in WEIGHT_MODES:
        raise WeightsError(f"unknown weights mode {weights!r}; choose one of {', '.join(WEIGHT_MODES)}")
    if weights == FP8:
        require_fp8()


def load_dit(where: ComponentSource | str | os.PathLike, subfolder: str = TRANSFORMER, *,
             dtype: torch.dtype | None = None, weights: str = "auto", streamed: bool = False,
             state: ModelState | None = None) -> nn.Module:
    """A DiT loaded tensor by tensor (see the module docstring) from a resolved source
    (`weights.resolve`: its headers were read when it resolved, and are not read again), or from the
    folder `where/subfolder` (resolved here).

    `weights`: "auto" loads what is stored (plain, pre-quantized fp8 or GGUF); "fp8_e4m3" also
    quantizes plain linear weights and expert stacks on load. `streamed` (disk-backed offload,
    `weights.disk`): the tensors kept exactly as stored are not read at all; they stay on `meta` with
    their disk home in `state.spans`; converted tensors are made once into the converted-weights cache
    (`weights.converted`) and stream from there, so nothing is held in memory.
    `state` (a fresh `weights.state.ModelState`) receives what the load found: the disk homes of the
    tensors kept exactly as stored, which of them hold their file's bytes, the format and the number of
    tensors read (the handle keeps it as the model's state; without one, nothing is kept).
    """
    from ..models.moe import ExpertWeights
    from ..models.precision import stays_float32 as keeps_fp32
    from ..models.transformer import LingBotVideoTransformer3DModel

    check_weights_mode(weights)
    if isinstance(where, ComponentSource):
        resolved = where
    else:
        resolved = folder_source(Path(where) / subfolder, subfolder if subfolder in DITS else TRANSFORMER)
    check_weights_mode_for(resolved, weights)
    config = (resolved.config if resolved.config is not None
              else LingBotVideoTransformer3DModel.load_config(resolved.config_dir))
    from ..interrupt import interruptible_build

    with interruptible_build(), torch.device("meta"):  # a cancel stops a deep skeleton within a second
        model = LingBotVideoTransformer3DModel.from_config(config)
    source = resolved.open()
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_entries(resolved.component, resolved.where, source.entries, expected)

    loader = _Loader(model, source, dtype, weights, keeps_fp32, streamed)
    # ComfyUI runs nodes under inference_mode; tensors made there carry no version counter, which disk
    # offload needs to tell a weight still equal to its file from one changed in place (weights.disk).
    with torch.inference_mode(False), torch.no_grad():
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear):
                loader.linear(name, module)
            elif isinstance(module, ExpertWeights):
                loader.experts(name)
        for key in expected:
            if key not in loader.done:
                loader.assign(key)
        if loader.conversions:
            from .converted import cached

            recipe = {"dtype": str(dtype), "weights": weights, "compute": str(loader.compute)}
            loader.spans.update(cached(source.files, recipe, loader.conversions))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.device.type == "meta" and n not in loader.spans]
    if left:
        raise RuntimeError(f"{resolved.component}: no stored value for {', '.join(left[:3])} (a loader bug)")
    state = (state if state is not None else ModelState()).bind(model)
    state.format = describe(model, source)
    state.spans = loader.spans  # disk homes of the tensors kept exactly as stored (weights.disk)
    state.reads = loader.read  # tensors read into memory by this load (0 span-backed ones when streamed)
    note_exact(model, state)  # what was read holds its file's bytes (disk offload may drop and re-read it)
    return model.eval().requires_grad_(False)


def describe(model: nn.Module, source: Any) -> str:
    """e.g. 'gguf: Q4_0 x98, F32 x12' or 'safetensors: bfloat16' (what the memory report shows)."""
    from .modules import stored_formats

    counts = stored_formats(model)
    plain = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()
                    if p.dtype.is_floating_point})
    parts = [f"{k} x{v}" for k, v in sorted(counts.items())] + plain
    return f"{source.kind}: {', '.join(parts)}"
