"""Modules that keep a quantized weight and decode it on the device, one layer at a time.

The stored bytes are integer tensors (fp8 values as uint8, their float32 scales as int32 bit
patterns, GGUF blocks as uint8), so a dtype cast of the model (`.to(bf16)`, `.float()`) can never
expand or round them, while every device move (`.to(device)`, accelerate and diffusers offload hooks,
pinning) moves exactly the stored bytes. `memory_report` therefore counts quantized bytes.

For adapters (LoRA): `QuantizedLinear.dequantized_weight(dtype)` returns the layer's weight as a
plain tensor, and `add_delta` adds a low-rank delta to the output. `QuantizedExperts.add_delta`
does the same per expert: the MoE block calls `project(name, e, rows)` for the experts it routes
to, so an expert LoRA costs only the routed experts' factors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import gguf_codec
from .decode import check_decoder
from .fp8 import FP8_MATMULS, choose_fp8_matmul, dequantize_fp8, quantize_fp8, tried_scaled_mm

FP8 = "fp8_e4m3"
#: values (all three weights) one span of experts may hold on the grouped path, by device type: on a
#: CPU 8 experts at real width (fastest of 1/3/8/16 in `python bench/speed_dit.py --only spans`: a
#: span splits evenly between the threads, and fewer, larger grouped matmuls);
#: elsewhere 256M values bound the accelerator transient (54 experts, 0.5 GB of bf16)
GROUPED_SPAN_VALUES: dict[str, int] = {"cpu": 40 << 20}
DEFAULT_GROUPED_SPAN_VALUES = 1 << 28


@dataclass(frozen=True)
class Packing:
    """How one weight is stored: `fp8_e4m3` (values + per-row scales) or a GGUF type."""

    kind: str  # "fp8_e4m3" or "gguf"
    shape: tuple[int, ...]  # the logical (dequantized) shape
    gguf_type: int = 0

    @property
    def label(self) -> str:
        return FP8 if self.kind == FP8 else gguf_codec.type_name(self.gguf_type)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def pack_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight -> (uint8 fp8 bytes, int32 scale bits): what the quantized modules hold."""
    q, scale = quantize_fp8(weight)
    return q.view(torch.uint8), scale.view(torch.int32)


def unpack(packing: Packing, data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
           decoder: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """The stored bytes decoded to `dtype` (`decoder`: one of `weights.decode.DECODERS`), into `out`
    (contiguous, the packing's shape and `dtype`) where given."""
    if packing.kind == FP8:
        return dequantize_fp8(data.view(torch.float8_e4m3fn), scale.view(torch.float32), dtype, decoder, out)
    return gguf_codec.dequantize(data, packing.gguf_type, packing.shape, dtype, decoder, out)


class QuantizedLinear(nn.Module):
    """A Linear whose weight is stored packed and decoded to the input's dtype on every call."""

    def __init__(self, packing: Packing, data: torch.Tensor, scale: torch.Tensor | None,
                 bias: torch.Tensor | None, compute_dtype: torch.dtype):
        super().__init__()
        self.packing = packing
        self.out_features, self.in_features = packing.shape
        self.compute_dtype = compute_dtype
        self.qdata = _param(data)
        self.qscale = _param(scale) if scale is not None else None
        self.bias = _param(bias) if bias is not None else None
        self.deltas: list[Callable[[torch.Tensor], torch.Tensor]] = []
        self.fp8_matmul = "decode"  # fp8 only: one of weights.fp8.FP8_MATMULS (`set_fp8_matmul`)
        self.decoder = "auto"  # one of weights.decode.DECODERS (`set_decoder`)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as a plain [out, in] tensor of `dtype` (the compute dtype by default), on its device."""
        return unpack(self.packing, self.qdata, self.qscale, dtype or self.compute_dtype, self.decoder)

    @property
    def weight(self) -> torch.Tensor:
        """Decoded on access, for code that reads `.weight` (its dtype is the compute dtype)."""
        return self.dequantized_weight()

    def add_delta(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Add `fn(x)` to every output (a runtime LoRA delta); `deltas.clear()` removes them."""
        self.deltas.append(fn)

    def matmul_path(self, x: torch.Tensor) -> str:
        """`decode` or `scaled_mm`: how this layer multiplies `x` (see `weights.fp8.FP8_MATMULS`)."""
        if self.packing.kind != FP8 or self.fp8_matmul == "decode":
            return "decode"
        return choose_fp8_matmul(self.fp8_matmul, x.device, x.dtype, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        if self.matmul_path(x) == "scaled_mm":  # tried (lingbot_core.kernels); decodes where it refuses
            out = tried_scaled_mm(x, self.qdata.view(torch.float8_e4m3fn), self.qscale.view(torch.float32), bias,
                                  lambda: self.dequantized_weight(x.dtype))
        else:
            out = F.linear(x, self.dequantized_weight(x.dtype), bias)
        for fn in self.deltas:
            out = out + fn(x).to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"stored={self.packing.label}, compute={str(self.compute_dtype).replace('torch.', '')}")


class _ExpertView:
    """`experts.w1[e]` decodes expert e only: the routed-expert loop touches the experts it uses."""

    def __init__(self, owner: QuantizedExperts, name: str):
        self._owner, self._name = owner, name

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._owner.packings[self._name].shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._owner.compute_dtype

    def __getitem__(self, e: int) -> torch.Tensor:
        return self._owner.expert(self._name, e)

    def to(self, dtype: torch.dtype) -> torch.Tensor:  # the grouped path: every expert at once
        return self._owner.stack(self._name, dtype)


def _stored(value: torch.Tensor | list[torch.Tensor] | None) -> nn.Parameter | nn.ParameterList | None:
    """A stacked tensor as one parameter, a per-expert list as a ParameterList (`[e]` indexes both)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return nn.ParameterList([_param(t) for t in value])
    return _param(value)


class QuantizedExperts(nn.Module):
    """MoE expert weights (w1, w3: [E, I, D]; w2: [E, D, I]) kept packed, one expert decoded at a time.

    Each weight is held as the file stores it: one stacked [E, ...] tensor (`w1_qdata`), or one tensor
    per expert (`w1_qdata.0` ... as a ParameterList), so offload and disk streaming move exactly the
    stored bytes either way; the decoded expert is the same.
    """

    NAMES = ("w1", "w2", "w3")
    decodes_per_expert = True  # the MoE loop decodes one expert at a time; the grouped path calls `stack`

    def __init__(self, packed: dict[str, tuple[Packing, torch.Tensor | list[torch.Tensor],
                                               torch.Tensor | list[torch.Tensor] | None]],
                 compute_dtype: torch.dtype):
        super().__init__()
        self.compute_dtype = compute_dtype
        self.packings: dict[str, Packing] = {}
        for name in self.NAMES:
            packing, data, scale = packed[name]
            self.packings[name] = packing
            setattr(self, f"{name}_qdata", _stored(data))
            setattr(self, f"{name}_qscale", _stored(scale))
        self.num_experts = self.packings["w1"].shape[0]
        self.decoder = "auto"  # one of weights.decode.DECODERS (`set_decoder`)
        # (weight name, fn(expert, rows)): output deltas of runtime adapters, see `add_delta`
        self.deltas: list[tuple[str, Callable[[int, torch.Tensor], torch.Tensor]]] = []

    def add_delta(self, name: str, fn: Callable[[int, torch.Tensor], torch.Tensor]) -> tuple[str, Callable]:
        """Add `fn(e, rows)` to expert e's `name` projection of `rows` (a runtime LoRA delta on w1/w2/w3).

        Returns the entry; `deltas.remove(entry)` (or `deltas.clear()`) takes it off again.
        """
        if name not in self.NAMES:
            raise ValueError(f"experts have no weight {name!r}; they hold {', '.join(self.NAMES)}")
        entry = (name, fn)
        self.deltas.append(entry)
        return entry

    def project(self, name: str, e: int, rows: torch.Tensor) -> torch.Tensor:
        """`rows @ W_e^T` for expert e's weight `name`, decoded now, plus any runtime deltas on it."""
        out = F.linear(rows, self.expert(name, e))
        for target, fn in self.deltas:
            if target == name:
                out = out + fn(e, rows).to(out.dtype)
        return out

    def expert(self, name: str, e: int, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        packing = self.packings[name]
        data = getattr(self, f"{name}_qdata")[e]
        scale = getattr(self, f"{name}_qscale")
        one = Packing(packing.kind, packing.shape[1:], packing.gguf_type)
        return unpack(one, data, scale[e] if scale is not None else None, dtype or self.compute_dtype, self.decoder,
                      out)

    def per_expert(self, name: str) -> bool:
        """Whether weight `name` is held one tensor per expert (as a per-expert GGUF file stores it)."""
        return isinstance(getattr(self, f"{name}_qdata"), nn.ParameterList)

    def grouped_span(self, device: torch.device) -> int:
        """How many experts the grouped path decodes at a time on `device` (`models.moe`): all three
        weights of a span together hold at most `GROUPED_SPAN_VALUES` values (by device type), so the
        decoded experts never all exist at once (3 x 128 experts at real width are 1.2 GB of bf16); on
        a CPU a multiple of the threads, since a grouped matmul splits its experts between them."""
        per_expert = sum(math.prod(self.packings[name].shape[1:]) for name in self.NAMES)
        kind = torch.device(device).type
        span = max(1, GROUPED_SPAN_VALUES.get(kind, DEFAULT_GROUPED_SPAN_VALUES) // per_expert)
        if kind == "cpu":
            threads = max(1, torch.get_num_threads())
            span = max(span // threads * threads, min(span, threads))
        return span

    def stack(self, name: str, dtype: torch.dtype | None = None, experts: slice | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """Experts of `name` decoded at once, [E, out, in] (the grouped-matmul path): all of them, or the
        contiguous range `experts` (a slice with no step); into `out` (contiguous, that shape) where given."""
        part = slice(0, self.num_experts) if experts is None else slice(*experts.indices(self.num_experts)[:2])
        dtype = dtype or self.compute_dtype
        if self.per_expert(name):
            if out is None:
                return torch.stack([self.expert(name, e, dtype) for e in range(part.start, part.stop)])
            for i, e in enumerate(range(part.start, part.stop)):
                self.expert(name, e, dtype, out[i])
            return out
        packing = self.packings[name]
        scale = getattr(self, f"{name}_qscale")
        one = Packing(packing.kind, (part.stop - part.start, *packing.shape[1:]), packing.gguf_type)
        return unpack(one, getattr(self, f"{name}_qdata")[part], scale[part] if scale is not None else None,
                      dtype, self.decoder, out)

    @property
    def w1(self) -> _ExpertView:
        return _ExpertView(self, "w1")

    @property
    def w2(self) -> _ExpertView:
        return _ExpertView(self, "w2")

    @property
    def w3(self) -> _ExpertView:
        return _ExpertView(self, "w3")

    def extra_repr(self) -> str:
        layout = ", per expert" if self.per_expert("w1") else ""
        return f"experts={self.num_experts}, stored={self.packings['w1'].label}{layout}"


def set_fp8_matmul(model: nn.Module, wanted: str) -> int:
    """Set how every fp8 linear of `model` multiplies (one of `FP8_MATMULS`, chosen per call and
    device by `weights.fp8.choose_fp8_matmul`); returns how many layers it set."""
    if wanted not in FP8_MATMULS:
        raise ValueError(f"unknown fp8 matmul {wanted!r}; choose one of {', '.join(FP8_MATMULS)}")
    count = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear) and m.packing.kind == FP8:
            m.fp8_matmul = wanted
            count += 1
    return count


def set_decoder(model: nn.Module, wanted: str) -> int:
    """Set how every packed weight of `model` decodes (one of `weights.decode.DECODERS`); returns how
    many modules it set."""
    check_decoder(wanted)
    count = 0
    for m in model.modules():
        if isinstance(m, (QuantizedLinear, QuantizedExperts)):
            m.decoder = wanted
            count += 1
    return count


def packed_tensors(module: nn.Module) -> list[tuple[str, Packing, torch.Tensor, torch.Tensor | None]]:
    """(stored tensor name relative to `module`, packing, data, scale) for each packed weight it holds
    directly: `weight` of a QuantizedLinear, `w1`/`w2`/`w3` of QuantizedExperts; [] for other modules."""
    if isinstance(module, QuantizedLinear):
        return [("weight", module.packing, module.qdata, module.qscale)]
    if isinstance(module, QuantizedExperts):
        out = []
        for name in module.NAMES:
            packing = module.packings[name]
            data, scale = getattr(module, f"{name}_qdata"), getattr(module, f"{name}_qscale")
            if module.per_expert(name):  # named as the file names them: `w1.{e}`
                one = Packing(packing.kind, packing.shape[1:], packing.gguf_type)
                out.extend((f"{name}.{e}", one, data[e], scale[e] if scale is not None else None)
                           for e in range(module.num_experts))
            else:
                out.append((name, packing, data, scale))
        return out
    return []


def stored_formats(model: nn.Module) -> dict[str, int]:
    """Count of quantized modules per stored format (for reports)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            counts[m.packing.label] = counts.get(m.packing.label, 0) + 1
        elif isinstance(m, QuantizedExperts):
            label = m.packings["w1"].label
            counts[label] = counts.get(label, 0) + 1
    return counts
