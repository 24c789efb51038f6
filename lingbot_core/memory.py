"""Where the components live, how much accelerator memory a run needs, and the `auto` offload choice.

`memory_report(handle)` answers "where is everything now" from the tensors themselves. The
estimate answers "which mode fits my card" before anything is loaded: weights from the checkpoint's
file sizes (scaled to the load dtype), activations from the requested geometry. `choose_mode` picks
the fastest mode expected to fit: none > model > group > sequential.

The activation model (documented constants; the estimate is of `torch.cuda.max_memory_allocated`).
Calibration: the published peaks of the reference (TI2V 192x320x49: none 14.3 GB, model 9.9 GB,
sequential 1.78 GB; T2V 480x832x121: none 27.1 GiB with 2.4 GB of per-token modulation we do not
spend) all give a VAE decode factor of 18.6-19.6 on top of the bf16 weights. The GPU check prints
estimate against measured peak per mode.
- DiT forward (batch 1; CFG runs two forwards one after the other): ~`DIT_ACT_FACTOR` copies of the
  hidden state S x D in the compute dtype live at once (residual stream, modulated input, q/k/v,
  attention output, the FFN's two intermediate-width tensors at I/D times the width), plus the
  fp32 latents and the flow prediction, plus the MoE routing buffers (S x k x D fp32).
- Attention through SDPA flash / memory-efficient kernels is linear in S; the math fallback would
  be quadratic and is not assumed.
- VAE decode of the Wan VAE is causal and frame-chunked: its peak scales with one chunk of the
  output at the widest decoder stage, H x W x `VAE_DECODE_CHANNELS` x 4 bytes x
  `VAE_DECODE_FACTOR`; tiling caps H x W at the tile size. The whole output video (F x H x W x 3
  fp32) lives alongside.
- The text encoder needs ~`TEXT_ACT_BYTES_PER_TOKEN` per token per layer-width at its dtype.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

GiB = 1024**3
MODE_ORDER = ("none", "model", "group", "sequential")  # fastest first
DIT_ACT_FACTOR = 14
VAE_DECODE_CHANNELS = 384
VAE_DECODE_FACTOR = 19
TEXT_TOKENS = 1024
TEXT_ACT_BYTES_PER_TOKEN = 64 * 1024
RESERVE_BYTES = int(0.8 * GiB)  # allocator slack and fragmentation, added when deciding what fits


# -- what is where now -------------------------------------------------------------------------------

def _location(t: torch.Tensor) -> str:
    if t.device.type == "meta":
        return "meta"
    if t.device.type == "cpu":
        return "pinned CPU" if t.is_pinned() else "CPU"
    return f"accelerator ({t.device})"


@dataclass
class ComponentMemory:
    name: str
    loaded: bool
    bytes_by_location: dict[str, int] = field(default_factory=dict)

    @property
    def where(self) -> str:
        if not self.loaded:
            return "not loaded"
        if not self.bytes_by_location:
            return "no weights"
        return ", ".join(f"{loc} {b / GiB:.2f} GiB" if b >= GiB // 100 else f"{loc} {b / 2**20:.1f} MiB"
                         for loc, b in sorted(self.bytes_by_location.items(), key=lambda kv: -kv[1]))


@dataclass
class MemoryReport:
    components: list[ComponentMemory]
    device: str
    mode: str

    def one_line(self) -> str:
        return "; ".join(f"{c.name}: {c.where}" for c in self.components)

    def __str__(self) -> str:
        lines = [f"LingBot memory ({self.mode} offload, execution device {self.device})"]
        lines += [f"  {c.name:<13} {c.where}" for c in self.components]
        totals = {}
        for c in self.components:
            for loc, b in c.bytes_by_location.items():
                totals[loc] = totals.get(loc, 0) + b
        lines.append("  total         " + (", ".join(f"{loc} {b / GiB:.2f} GiB" for loc, b in sorted(totals.items()))
                                          or "nothing loaded"))
        return "\n".join(lines)


def memory_report(handle) -> MemoryReport:
    """Where each component's tensors live now, and their bytes per location."""
    from .handle import ALL_COMPONENTS

    shared = handle.shared
    out = []
    for name in ALL_COMPONENTS:
        module = shared.loaded.get(name)
        if not isinstance(module, torch.nn.Module):
            if name in ("processor", "scheduler"):
                continue
            out.append(ComponentMemory(name, False))
            continue
        seen: set[tuple[str, int]] = set()
        usage: dict[str, int] = {}
        for t in [*module.parameters(), *module.buffers()]:
            key = (str(t.device), t.data_ptr() if t.device.type != "meta" else id(t))
            if key in seen:
                continue
            seen.add(key)
            loc = _location(t)
            usage[loc] = usage.get(loc, 0) + t.numel() * t.element_size()
        out.append(ComponentMemory(name, True, usage))
    mode = shared.installed.settings.mode if shared.installed is not None else handle.offload.mode
    return MemoryReport(out, str(handle.device), mode)


# -- estimate ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    height: int = 480
    width: int = 832
    num_frames: int = 121
    cfg: bool = True
    refine: tuple[int, int] | None = None  # (height, width) of the refiner pass, if any
    vae_tiling: bool = False


@dataclass(frozen=True)
class ModelSizes:
    """Weight bytes at load dtype, and the DiT shape the activation model needs."""

    text_encoder: int
    transformer: int
    vae: int
    refiner: int = 0
    hidden: int = 2048
    depth: int = 24
    intermediate: int = 6144
    experts_per_token: int = 0
    text_hidden: int = 2560
    dit_bytes_per_value: int = 2
    largest_block: int = 0  # bytes of one DiT block (group / sequential units)
    text_largest_layer: int = 0

    @classmethod
    def from_handle(cls, handle) -> ModelSizes:
        """Read sizes from the checkpoint files (nothing is loaded), scaled to the load dtypes."""
        return cls.from_shared(handle.shared)

    @classmethod
    def from_shared(cls, shared) -> ModelSizes:
        """`from_handle` for the components a handle shares (offload resolves `auto` from these)."""
        info = shared.info
        if info is None:
            raise ValueError("size estimates need a handle opened from a checkpoint folder")
        cfg = info.transformer_config
        dtypes = shared.dtypes

        def scaled(name: str, stored_bytes: int) -> int:
            if name in ("transformer", "refiner"):  # as the weights loader will hold them (fp8/GGUF packed)
                from .weights.estimate import dit_load_bytes

                return dit_load_bytes(info.weight_files.get(name, []), dtypes.get(name),
                                      getattr(shared, "weights", "auto"))
            dtype = dtypes.get(name) or torch.float32
            return stored_bytes * torch.finfo(dtype).bits // _stored_bits(info.weight_files.get(name, []))

        dit = scaled("transformer", info.component_bytes("transformer"))
        depth = int(cfg.get("depth", 24))
        text = scaled("text_encoder", info.component_bytes("text_encoder"))
        return cls(
            text_encoder=text,
            transformer=dit,
            vae=scaled("vae", info.component_bytes("vae")),
            refiner=scaled("refiner", info.component_bytes("refiner")) if info.has_refiner else 0,
            hidden=int(cfg.get("hidden_size", 2048)),
            depth=depth,
            intermediate=int(cfg.get("intermediate_size", 6144)) if not cfg.get("num_experts") else
            int(cfg.get("moe_intermediate_size", 768)) * int(cfg.get("num_experts_per_tok", 8)),
            experts_per_token=int(cfg.get("num_experts_per_tok", 0)) if cfg.get("num_experts") else 0,
            dit_bytes_per_value=_dit_value_bytes(info.weight_files.get("transformer", []), dtypes.get("transformer")),
            largest_block=math.ceil(dit / max(depth, 1)),
            text_largest_layer=math.ceil(text / 40),
        )


def sizes_from_modules(components: dict[str, Any]) -> ModelSizes:
    """Sizes of components already in memory (benchmarks build them without a checkpoint folder)."""
    def nbytes(name: str) -> int:
        module = components.get(name)
        if not isinstance(module, torch.nn.Module):
            return 0
        return sum(p.numel() * p.element_size() for p in module.parameters())

    dit = components["transformer"]
    cfg = dit.config
    moe = bool(cfg.num_experts)
    text = nbytes("text_encoder")
    return ModelSizes(
        text_encoder=text, transformer=nbytes("transformer"), vae=nbytes("vae"), refiner=nbytes("refiner"),
        hidden=cfg.hidden_size, depth=cfg.depth,
        intermediate=cfg.moe_intermediate_size * cfg.num_experts_per_tok if moe else cfg.intermediate_size,
        experts_per_token=cfg.num_experts_per_tok if moe else 0,
        dit_bytes_per_value=dit.patch_embedder.weight.element_size(),
        largest_block=max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in dit.blocks),
        text_largest_layer=math.ceil(text / 40),
    )


def _dit_value_bytes(files: list, dtype: torch.dtype | None) -> int:
    from .weights.estimate import dit_compute_bytes

    return dit_compute_bytes(files, dtype)


def _stored_bits(files: list) -> int:
    """The dominant dtype width of stored safetensors (headers only)."""
    import json
    import struct

    counts: dict[int, int] = {}
    widths = {"F32": 32, "F16": 16, "BF16": 16, "F64": 64, "F8_E4M3": 8, "F8_E5M2": 8, "I64": 64, "I32": 32}
    for path in files:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            size = meta["data_offsets"][1] - meta["data_offsets"][0]
            bits = widths.get(meta["dtype"], 32)
            counts[bits] = counts.get(bits, 0) + size
    return max(counts, key=counts.get) if counts else 32


def activation_bytes(sizes: ModelSizes, geometry: Geometry) -> dict[str, int]:
    """Peak activation bytes per phase for one request (see the module docstring for the model)."""
    def dit(height: int, width: int) -> int:
        latent_frames = (geometry.num_frames - 1) // 4 + 1
        tokens = latent_frames * (height // 16) * (width // 16) + TEXT_TOKENS
        width_factor = DIT_ACT_FACTOR + 2 * sizes.intermediate / max(sizes.hidden, 1)
        hidden = tokens * sizes.hidden * sizes.dit_bytes_per_value * width_factor
        routing = tokens * max(sizes.experts_per_token, 0) * sizes.hidden * 4
        latents = 3 * 16 * latent_frames * (height // 8) * (width // 8) * 4
        return int(hidden + routing + latents)

    def vae(height: int, width: int, tiled: bool) -> int:
        h, w = (min(height, 384), min(width, 640)) if tiled else (height, width)
        chunk = h * w * VAE_DECODE_CHANNELS * 4 * VAE_DECODE_FACTOR
        video = geometry.num_frames * height * width * 3 * 4 * 2
        return int(chunk + video)

    phases = {
        "text": TEXT_TOKENS * TEXT_ACT_BYTES_PER_TOKEN,
        "denoise": dit(geometry.height, geometry.width),
        "decode": vae(geometry.height, geometry.width, geometry.vae_tiling),
    }
    if geometry.refine is not None:
        rh, rw = geometry.refine
        phases["refine"] = dit(rh, rw)
        phases["refine_decode"] = vae(rh, rw, True)
    return phases


def estimate_peak(mode: str, sizes: ModelSizes, geometry: Geometry) -> int:
    """Expected peak accelerator bytes of one request under `mode` (documented, deliberately simple)."""
    act = activation_bytes(sizes, geometry)
    dit_for = {"denoise": sizes.transformer, "refine": sizes.refiner or sizes.transformer}
    if mode == "none":
        # Everything resident; with a refiner the base is released before it loads.
        weights = sizes.text_encoder + sizes.vae + max(sizes.transformer, sizes.refiner)
        return weights + max(act.values())
    per_phase = []
    for phase, a in act.items():
        if mode == "model":
            weights = {"text": sizes.text_encoder, "denoise": dit_for["denoise"], "refine": dit_for["refine"]}.get(
                phase, sizes.vae)
        elif mode == "group":  # two blocks in flight (prefetch) plus the top-level group; the VAE whole
            weights = {"text": 2 * sizes.text_largest_layer, "denoise": 3 * sizes.largest_block,
                       "refine": 3 * sizes.largest_block}.get(phase, sizes.vae)
        elif mode == "sequential":  # one leaf (or one preloaded MoE FFN) at a time; the VAE whole
            weights = {"text": sizes.text_largest_layer, "denoise": sizes.largest_block,
                       "refine": sizes.largest_block}.get(phase, sizes.vae)
        else:
            raise ValueError(f"no estimate for mode {mode!r}")
        per_phase.append(weights + a)
    return max(per_phase)


@dataclass
class AutoChoice:
    mode: str
    estimates: dict[str, int]
    budget: int
    reason: str


def choose_mode(sizes: ModelSizes, geometry: Geometry, budget_bytes: int, *, after: str | None = None) -> AutoChoice:
    """The fastest mode whose estimate fits `budget_bytes` (sequential if none does).

    `after` skips modes up to and including it (the one-step fallback after an out-of-memory error).
    """
    order = list(MODE_ORDER)
    if after is not None:
        order = order[order.index(after) + 1:] or [MODE_ORDER[-1]]
    estimates = {m: estimate_peak(m, sizes, geometry) for m in MODE_ORDER}
    for mode in order:
        if estimates[mode] + RESERVE_BYTES <= budget_bytes:
            reason = (f"'{mode}' is the fastest mode expected to fit: needs ~{estimates[mode] / GiB:.1f} GiB of "
                      f"{budget_bytes / GiB:.1f} GiB free")
            if after is not None:
                reason = f"after running out of memory under '{after}', {reason}"
            return AutoChoice(mode, estimates, budget_bytes, reason)
    mode = order[-1]
    return AutoChoice(mode, estimates, budget_bytes,
                      f"nothing is expected to fit in {budget_bytes / GiB:.1f} GiB (sequential needs "
                      f"~{estimates['sequential'] / GiB:.1f} GiB); using '{mode}', the smallest")


def free_accelerator_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    raise ValueError(f"auto offload needs an accelerator to measure; the device is {device}")


def describe(choice: AutoChoice) -> str:
    table = ", ".join(f"{m} ~{b / GiB:.1f} GiB" for m, b in choice.estimates.items())
    return f"auto offload: {choice.reason} (estimates: {table})"


def geometry_from(options: dict[str, Any], variant: str) -> Geometry:
    refine = options.get("refine")
    if refine is None and variant == "moe":
        refine = (1088, 1920)
    return Geometry(height=int(options.get("height", 480)), width=int(options.get("width", 832)),
                    num_frames=int(options.get("num_frames", 121)), cfg=bool(options.get("cfg", True)),
                    refine=tuple(refine) if refine else None, vae_tiling=bool(options.get("vae_tiling", False)))
