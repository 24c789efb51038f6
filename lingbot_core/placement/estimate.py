"""How much accelerator memory (and host RAM) a request needs under each mode.

Pure arithmetic: checkpoint facts and a request in, bytes out (the free-memory budget is read by
the door, after the host has been asked to free its own models). Weights count the bytes a
component really holds: the tensors themselves once loaded (stored dtype, quantized or not),
else the checkpoint files scaled to the load dtype. Each mode's peak formula lives with the mode
(`modes/*.estimate`); `fit.choose_mode` picks the fastest mode expected to fit from these numbers.

Host RAM (`host_bytes`): under an offloading mode with `offload_to="ram"` every component's home
copy is in host memory; with `offload_to="disk"` the DiTs' home is their file (the page cache, which
the kernel gives back under pressure, is not counted), so their share is the unit being read
(`modes.disk.unit_bytes`). `fit.choose_mode` skips a mode whose host need exceeds a host budget when
it is given one (the door reads the host's available memory when it plans for an accelerator).

The activation model (documented constants; the estimate is of `torch.cuda.max_memory_allocated`).
Calibration: the published peaks of the reference (TI2V 192x320x49: none 14.3 GB, model 9.9 GB,
sequential 1.78 GB; T2V 480x832x121: none 27.1 GiB with 2.4 GB of per-token modulation we do not
spend) all give a VAE decode factor of 18.6-19.6 on top of the bf16 weights. docs/benchmarks.md
("The estimate against the one GPU measurement") sets the estimate against those figures term by term;
on a real GPU every stage measures its peak and a per-device file (`calibration`) keeps later
estimates on that device from being below what it measured.
- DiT forward (batch 1; CFG runs two forwards one after the other, or with `cfg_batch` one batch-2
  forward whose hidden-state and routing terms are twice as large): ~`DIT_ACT_FACTOR` copies of the
  hidden state S x D in the compute dtype live at once (residual stream, modulated input, q/k/v,
  attention output, the FFN's two intermediate-width tensors at I/D times the width), plus the
  fp32 latents and the flow prediction, plus the MoE routing buffers (S x k x D fp32).
  With token-chunked FFN/MoE (`Geometry.ffn_chunk`, `JointBlock._ffn_branch`) the FFN's
  intermediates and the routing buffers hold one chunk of C tokens, not S: min(S, C) replaces S in
  those two terms; `ffn_chunk_tokens` picks the largest C (from `FFN_CHUNKS`) that fits a budget.
- Attention through SDPA flash / memory-efficient kernels is linear in S; the math fallback would
  be quadratic and is not assumed.
- VAE decode of the Wan VAE is causal and frame-chunked: its peak scales with one chunk of the
  output at the widest decoder stage, H x W x `VAE_DECODE_CHANNELS` x 4 bytes x
  `VAE_DECODE_FACTOR`; tiling caps H x W at the tile size. The whole output video (F x H x W x 3
  fp32) lives alongside.
- The text encoder needs ~`TEXT_ACT_BYTES_PER_TOKEN` per token per layer-width at its dtype.
- A prompt rewrite on the text encoder (`Geometry.rewrite_tokens`, the longest context one of its
  calls holds: prompt plus new tokens) is its own phase, "rewrite": the KV cache for those tokens
  at the text encoder's shape (2 x layers x KV heads x head width per token, in its dtype), the
  prefill's activations as above, and the logits (vocabulary x fp32, a few copies). Its weights are
  the text phase's; the streaming modes also bring the (tied) LM head, as large as the embedding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..components import DITS, REFINER, TRANSFORMER
from . import calibration
from .modes import MODE_CLASSES
from .tensors import module_tensors, stored_bytes, unique_storages

GiB = 1024**3
DIT_ACT_FACTOR = 14
VAE_DECODE_CHANNELS = 384
VAE_DECODE_FACTOR = 19
TEXT_TOKENS = 1024
TEXT_ACT_BYTES_PER_TOKEN = 64 * 1024
RESERVE_BYTES = int(0.8 * GiB)  # allocator slack and fragmentation, added when deciding what fits
CUBLAS_WORKSPACE_BYTES = 32 * 2**20
"""The cuBLAS workspace of the stream the matmuls run on: torch allocates it through its caching allocator
(so `max_memory_allocated` counts it) and keeps it, 4096 KiB x 8 by default from compute capability 9.0 on
and 4096 KiB x 2 + 16 KiB x 8 before (`CUBLAS_WORKSPACE_CONFIG`; aten/src/ATen/cuda/CublasHandlePool.cpp,
cuBLASLt sharing it by default). The larger one is counted, in every phase."""
MOE_REFINE_SIZE = (1088, 1920)
TEXT_LAYERS_GUESS = 40  # Qwen3-VL-4B: 36 language layers + the vision tower's share
QWEN3_VL_4B_TEXT = {"num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                    "hidden_size": 2560}
"""The text encoder's language-model shape when its config cannot be read (the published model's)."""
LOGIT_COPIES = 3  # generation: the last position's logits in fp32, the processed scores, the pick


@dataclass(frozen=True)
class Geometry:
    """One request, as far as memory is concerned (H x W x frames, and what runs after it)."""

    height: int
    width: int
    num_frames: int
    cfg: bool = True
    refine: tuple[int, int] | None = None  # (height, width) of the refiner pass, if any
    vae_tiling: bool = False
    release_base: bool = False  # the refine stage drops the base DiT before the refiner loads
    cfg_batch: bool = False  # CFG's two branches as one batch-2 DiT forward
    # tokens per FFN/MoE pass: None, the whole sequence at once; "auto", what the run will use, the
    # largest of `FFN_CHUNKS` a memory budget needs (`resolve_chunk`; without a budget: unchunked)
    ffn_chunk: int | str | None = None
    # a prompt rewrite on the text encoder in this run: the longest context (prompt + new tokens)
    # one of its calls holds (0: none; `rewrite.local_backend.context_tokens` computes it)
    rewrite_tokens: int = 0
    # a parallel run (`ParallelShare`): ranks sharing one DiT forward's sequence (Ulysses)
    ulysses: int = 1


@dataclass(frozen=True, kw_only=True)
class ModelSizes:
    """Weight bytes held per component, and the DiT shape the activation model needs."""

    text_encoder: int
    transformer: int
    vae: int
    refiner: int = 0
    # the DiT's shape
    hidden: int
    depth: int
    intermediate: int  # per token: the dense FFN width, or active experts x expert width
    experts_per_token: int = 0
    dit_bytes_per_value: int = 2
    # the largest unit group / sequential offload holds at once
    largest_block: int
    text_largest_layer: int
    # the text encoder's language model, for generation (a rewrite): KV cache bytes per token,
    # vocabulary, and the LM head's bytes (tied to the embedding)
    text_kv_bytes_per_token: int = 0
    text_vocab: int = 0
    text_head: int = 0
    # host bytes of each component's tensors once pinned (`pinned_bytes`: every tensor rounded up to a
    # power of two); None where the tensor sizes are unknown (`host_bytes` then counts the bound, 2x)
    pinned_transformer: int | None = None
    pinned_refiner: int | None = None
    pinned_text_encoder: int | None = None

    def pinned(self, name: str) -> int:
        """Host bytes component `name` holds pinned (its pinned figure, else the bound: twice its bytes);
        0 for a component the model does not have (a root without refiner/), whatever its pinned figure."""
        held, given = getattr(self, name), getattr(self, f"pinned_{name}")
        if not held:
            return 0
        return held * PINNED_BOUND if given is None else given

    @classmethod
    def from_checkpoint(cls, info: Any, dtypes: Mapping[str, torch.dtype | None],
                        loaded: Mapping[str, Any] | None = None, weights: str = "auto") -> ModelSizes:
        """Loaded components count the bytes their tensors hold. The DiTs not loaded yet count what
        the weights loader will hold (`weights.estimate`: fp8 values + scales, GGUF blocks, plain
        tensors at their load dtype); the other components their files scaled to the load dtype."""
        from ..weights.estimate import dit_compute_bytes, dit_load_bytes, dit_tensor_bytes

        if info is None:
            raise ValueError("size estimates need a handle opened from a checkpoint folder")
        loaded = loaded or {}
        cfg = info.transformer_config

        def held(name: str) -> int:
            if name == REFINER and not info.has_refiner:
                return 0
            if isinstance(loaded.get(name), torch.nn.Module):
                return stored_bytes(loaded[name], include_meta=True)
            if name in DITS:
                return dit_load_bytes(info.sources.get(name), dtypes.get(name), weights)
            on_disk = info.component_bytes(name)
            dtype = dtypes.get(name, torch.float32)
            values = getattr(info.file_sources.get(name), "values", 0)
            if values:  # a single file (any storage, fp8 included) loads its values in `dtype` (None: float32)
                return values * torch.finfo(dtype or torch.float32).bits // 8
            if dtype is None:
                return on_disk
            return on_disk * torch.finfo(dtype).bits // _stored_bits(info.sources.get(name))

        def pinned(name: str) -> int | None:
            if name == REFINER and not info.has_refiner:
                return 0
            if isinstance(loaded.get(name), torch.nn.Module):
                return module_pinned_bytes(loaded[name])
            if name in DITS:
                sizes = dit_tensor_bytes(info.sources.get(name), dtypes.get(name), weights)
            else:
                sizes = _tensor_bytes(info.sources.get(name), dtypes.get(name, torch.float32))
            return pinned_bytes(sizes) if sizes else None

        moe = bool(cfg.get("num_experts"))
        dit, text = held(TRANSFORMER), held("text_encoder")
        depth = int(cfg.get("depth", 24))
        return cls(
            text_encoder=text, transformer=dit, vae=held("vae"), refiner=held(REFINER),
            hidden=int(cfg.get("hidden_size", 2048)), depth=depth,
            intermediate=(int(cfg.get("moe_intermediate_size", 768)) * int(cfg.get("num_experts_per_tok", 8))
                          if moe else int(cfg.get("intermediate_size", 6144))),
            experts_per_token=int(cfg.get("num_experts_per_tok", 0)) if moe else 0,
            dit_bytes_per_value=dit_compute_bytes(info.sources.get(TRANSFORMER), dtypes.get(TRANSFORMER)),
            largest_block=math.ceil(dit / max(depth, 1)),
            text_largest_layer=math.ceil(text / TEXT_LAYERS_GUESS),
            **text_generation_shape(text_config_of(info), dtypes.get("text_encoder") or torch.float32),
            pinned_transformer=pinned(TRANSFORMER), pinned_refiner=pinned(REFINER),
            pinned_text_encoder=pinned("text_encoder"),
        )

    @classmethod
    def from_modules(cls, components: Mapping[str, Any]) -> ModelSizes:
        """Sizes of components already in memory (benchmarks build them without a checkpoint)."""
        from ..models.precision import matmul_dtype

        dit = components.get(TRANSFORMER)
        if dit is None:
            raise ValueError("size estimates need the DiT: open the handle from a checkpoint, or give it a "
                             f"'{TRANSFORMER}' component")
        cfg = dit.config
        moe = bool(cfg.num_experts)
        text = stored_bytes(components.get("text_encoder"), include_meta=True)
        return cls(
            text_encoder=text, transformer=stored_bytes(dit, include_meta=True),
            vae=stored_bytes(components.get("vae"), include_meta=True),
            refiner=stored_bytes(components.get(REFINER), include_meta=True),
            hidden=cfg.hidden_size, depth=cfg.depth,
            intermediate=cfg.moe_intermediate_size * cfg.num_experts_per_tok if moe else cfg.intermediate_size,
            experts_per_token=cfg.num_experts_per_tok if moe else 0,
            dit_bytes_per_value=torch.finfo(matmul_dtype(dit.patch_embedder)).bits // 8,
            largest_block=max(stored_bytes(b, include_meta=True) for b in dit.blocks),
            text_largest_layer=math.ceil(text / TEXT_LAYERS_GUESS),
            **module_generation_shape(components.get("text_encoder")),
            pinned_transformer=module_pinned_bytes(dit), pinned_refiner=module_pinned_bytes(components.get(REFINER)),
            pinned_text_encoder=module_pinned_bytes(components.get("text_encoder")),
        )


def text_config_of(info: Any) -> dict[str, Any] | None:
    """The text encoder's config.json (a folder's, or the one a single file resolved with); None
    when it cannot be read (the estimate then assumes `QWEN3_VL_4B_TEXT`)."""
    import json

    source = (getattr(info, "sources", None) or {}).get("text_encoder") or \
        (getattr(info, "file_sources", None) or {}).get("text_encoder")
    given = getattr(source, "config", None)
    if isinstance(given, Mapping):
        return dict(given)
    folder = getattr(source, "config_dir", None)
    if folder is None and getattr(info, "folder", None) is not None:
        folder = info.folder / "text_encoder"
    try:
        path = folder / "config.json"
        if path.stat().st_size > 1 << 20:  # a config is a few KB; never read a large file here
            return None
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, TypeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def text_generation_shape(config: Mapping[str, Any] | None, dtype: torch.dtype) -> dict[str, int]:
    """`ModelSizes`' generation fields from a Qwen3-VL config (its `text_config`) at `dtype`."""
    text = dict(QWEN3_VL_4B_TEXT)
    given = (config or {}).get("text_config", config) or {}
    if isinstance(given, Mapping):
        text.update({k: v for k, v in given.items() if k in text and isinstance(v, int) and v > 0})
        heads = given.get("num_attention_heads")
        if "head_dim" not in given and isinstance(heads, int) and heads > 0 and "hidden_size" in given:
            text["head_dim"] = int(given["hidden_size"]) // heads
        if "num_key_value_heads" not in given and isinstance(heads, int) and heads > 0:
            text["num_key_value_heads"] = heads
    width = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    return {"text_kv_bytes_per_token": 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * text["head_dim"]
            * width, "text_vocab": text["vocab_size"], "text_head": text["vocab_size"] * text["hidden_size"] * width}


def module_generation_shape(encoder: Any) -> dict[str, int]:
    """`text_generation_shape` of a loaded text encoder (its config, its parameters' dtype)."""
    if not isinstance(encoder, torch.nn.Module):
        return text_generation_shape(None, torch.bfloat16)
    config = getattr(encoder, "config", None)
    as_dict = config.to_dict() if hasattr(config, "to_dict") else None
    dtype = next((p.dtype for p in encoder.parameters() if p.is_floating_point()), torch.float32)
    return text_generation_shape(as_dict, dtype)


def generation_bytes(kv_bytes_per_token: int, vocab: int, tokens: int) -> dict[str, int]:
    """Accelerator bytes a text-encoder generation holding `tokens` tokens of context adds, by part:
    the KV cache, the prefill's activations (bounded by the context) and the logits."""
    tokens = max(int(tokens), 0)
    return {"kv_cache": tokens * kv_bytes_per_token, "prefill": tokens * TEXT_ACT_BYTES_PER_TOKEN,
            "logits": LOGIT_COPIES * vocab * 4 if tokens else 0}


def _stored_bits(source: Any) -> int:
    """The dtype width holding most bytes of a component's safetensors files (from the headers read
    when it resolved)."""
    from ..weights.safetensors_header import SAFETENSORS_ITEMSIZE

    by_width: dict[int, int] = {}
    if source is None or source.format.name != "safetensors":
        return 32
    for entry in source.stored_tensors().values():
        width = 8 * SAFETENSORS_ITEMSIZE.get(entry.dtype, 4)
        by_width[width] = by_width.get(width, 0) + entry.nbytes
    return max(by_width, key=by_width.get) if by_width else 32


def _tensor_bytes(source: Any, dtype: torch.dtype | None) -> list[int]:
    """Bytes of each tensor of a (non-DiT) component's safetensors files once loaded in `dtype` (as stored
    when None); empty when its files are not safetensors (the sizes are then unknown)."""
    from ..weights.safetensors_header import SAFETENSORS_ITEMSIZE

    if source is None or getattr(getattr(source, "format", None), "name", None) != "safetensors":
        return []
    out = []
    for entry in source.stored_tensors().values():
        itemsize = SAFETENSORS_ITEMSIZE.get(entry.dtype, 4)
        out.append(entry.nbytes * torch.finfo(dtype).bits // (8 * itemsize) if dtype is not None else entry.nbytes)
    return out


def pinned_bytes(tensor_bytes: Iterable[int]) -> int:
    """Host bytes that pinning tensors of these sizes one by one takes (`Tensor.pin_memory()`, which
    diffusers' group offloading with a stream calls once per tensor of every group). torch's pinned-memory
    allocator (`CachingHostAllocator::allocate` in ATen/core/CachingHostAllocator.h) rounds each request
    up to the next power of two, unless `PYTORCH_ALLOC_CONF` sets a `pinned_max_round_threshold` below it."""
    return sum(1 << (int(n) - 1).bit_length() for n in tensor_bytes if n > 0)


def module_pinned_bytes(module: Any) -> int:
    """`pinned_bytes` of a module's storages (a `meta` one counts its size as loaded)."""
    if not isinstance(module, torch.nn.Module):
        return 0
    return pinned_bytes(n for _t, n in unique_storages(t for _o, _k, _n, t in module_tensors(module)))


def activation_bytes(sizes: ModelSizes, geometry: Geometry) -> dict[str, int]:
    """Peak activation bytes per phase for one request (see the module docstring for the model)."""
    latent_frames = (geometry.num_frames - 1) // 4 + 1

    def dit(height: int, width: int) -> int:
        whole = latent_frames * (height // 16) * (width // 16) + TEXT_TOKENS
        tokens = -(-whole // geometry.ulysses)  # Ulysses: each rank's blocks run on its chunk of the sequence
        chunk = geometry.ffn_chunk if isinstance(geometry.ffn_chunk, int) else None
        ffn_tokens = min(tokens, chunk) if chunk else tokens
        per_value = sizes.hidden * sizes.dit_bytes_per_value
        hidden = tokens * per_value * DIT_ACT_FACTOR
        ffn = ffn_tokens * per_value * 2 * sizes.intermediate / max(sizes.hidden, 1)
        routing = ffn_tokens * max(sizes.experts_per_token, 0) * sizes.hidden * 4
        latents = 3 * 16 * latent_frames * (height // 8) * (width // 8) * 4
        gathered = whole * per_value if geometry.ulysses > 1 else 0  # the chunks gathered after the last block
        batch = 2 if geometry.cfg and geometry.cfg_batch else 1
        return int(batch * (hidden + ffn + routing + gathered) + latents)

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
    if geometry.rewrite_tokens > 0:
        phases["rewrite"] = sum(generation_bytes(sizes.text_kv_bytes_per_token, sizes.text_vocab,
                                                 geometry.rewrite_tokens).values())
    return {phase: nbytes + CUBLAS_WORKSPACE_BYTES for phase, nbytes in phases.items()}


@dataclass(frozen=True)
class ParallelShare:
    """How a parallel layout (`lingbot_core.distributed.ParallelLayout`) divides one request per GPU.

    Ulysses divides the DiT's per-token activations by its degree (each rank's blocks hold a chunk
    of the sequence; the whole output is gathered once at the end). CFG parallel runs one branch per
    rank (never a batch-2 forward). FSDP divides the DiTs' block weights by the world size, plus one
    block gathered whole while it runs; the float32 set it leaves whole (norms, modulation, router;
    well under 1% of a block) is counted as sharded. Only rank 0 holds the text encoder and the VAE.
    Every mode but `none` is refused on several processes, so the estimate is `none`'s.
    """

    cfg: int = 1
    ulysses: int = 1
    fsdp: bool = False

    @property
    def world(self) -> int:
        return self.cfg * self.ulysses

    @classmethod
    def of(cls, layout: Any) -> ParallelShare:
        return cls(int(layout.cfg), int(layout.ulysses), bool(getattr(layout, "fsdp", False)))

    def per_rank(self, sizes: ModelSizes, geometry: Geometry, *, leader: bool = True) -> tuple[ModelSizes, Geometry]:
        """`sizes` and `geometry` as one rank sees them (`leader`: rank 0, which also encodes and decodes)."""
        def dit(held: int) -> int:
            return held // self.world + sizes.largest_block if self.fsdp and held else held

        ranked = replace(sizes, transformer=dit(sizes.transformer), refiner=dit(sizes.refiner),
                         text_encoder=sizes.text_encoder if leader else 0, vae=sizes.vae if leader else 0)
        return ranked, replace(geometry, ulysses=self.ulysses, cfg_batch=geometry.cfg_batch and self.cfg == 1)

    def peak(self, sizes: ModelSizes, geometry: Geometry, *, leader: bool = True) -> int:
        """The expected peak bytes on one GPU of the layout (rank 0's by default: the largest; the other
        ranks only sample, so only the DiT phases count for them)."""
        phases = None if leader else ("denoise", "refine")
        return estimate_peak("none", *self.per_rank(sizes, geometry, leader=leader), phases)


def estimate_peak(mode: str, sizes: ModelSizes, geometry: Geometry, phases: tuple[str, ...] | None = None) -> int:
    """Expected peak accelerator bytes of one request under `mode` (the mode's own formula);
    `phases` (names of `activation_bytes`): the peak over those phases only (one stage's call)."""
    if mode not in MODE_CLASSES:
        raise ValueError(f"no estimate for mode {mode!r}")
    activations = activation_bytes(sizes, geometry)
    if phases is not None:
        activations = {k: v for k, v in activations.items() if k in phases}
    # on a device with a calibration file entry (the door plans inside `calibration.on_device`): never
    # below the ratio measured there
    return calibration.scaled(mode, MODE_CLASSES[mode].estimate(sizes, geometry, activations))


def cfg_batch_fits(mode: str, sizes: ModelSizes, geometry: Geometry, budget_bytes: int) -> bool:
    """Whether CFG as one batch-2 forward is expected to fit `budget_bytes` under `mode` (with the
    allocator reserve), i.e. whether `cfg_batch="auto"` batches."""
    batched = Geometry(**{**geometry.__dict__, "cfg": True, "cfg_batch": True})
    return estimate_peak(mode, sizes, batched) + RESERVE_BYTES <= budget_bytes


def cfg_batch_gain(device_type: str, *, packed: bool, streamed: bool) -> str | None:
    """Why one batch-2 CFG forward is expected to beat two batch-1 forwards on a `device_type` device
    whose DiT holds quantized weights (`packed`) or streams them from its file (`streamed`); None where
    two forwards are the faster choice, so `cfg_batch="auto"` does not batch there.

    Batching pays where a forward has a fixed cost per weight that one batch-2 forward pays once: a
    GPU (kernel launches, under-filled kernels, offload transfers), quantized weights (each forward
    decodes them), disk streaming (each forward reads them). On a CPU with plain weights nothing is
    shared, and at real width the batch-2 forward measured 1.14-1.16x the time of the two forwards
    (dense bf16, issue 36; docs/speed.md)."""
    if device_type != "cpu":
        return f"on {device_type}, one forward's fixed costs serve both branches"
    if packed:
        return "the quantized weights decode once for both branches"
    if streamed:
        return "the DiT's weights are read from disk once for both branches"
    return None


FFN_CHUNKS = (65536, 32768, 16384, 8192, 4096)  # tokens per FFN/MoE pass, tried largest first
AUTO_CHUNK = "auto"
NO_CHUNK = "off"  # the Loaders' word for "never chunk" (the handle's None)
FFN_CHUNK_CHOICES = (AUTO_CHUNK, NO_CHUNK, *(str(n) for n in (*FFN_CHUNKS, 2048, 1024, 512, 256)))
"""What the Loaders' `ffn_chunk` widget offers (`handle.ffn_chunk_setting` reads it): auto's candidates and
smaller chunks down to 256 tokens (fewer tokens per pass cost Python work per block, so the list stops there)."""


def ffn_chunk_tokens(mode: str, sizes: ModelSizes, geometry: Geometry, budget_bytes: int,
                     phases: tuple[str, ...] | None = None) -> int | None:
    """Tokens per FFN/MoE pass for `mode` within `budget_bytes` (over `phases`, see `estimate_peak`):
    None when the whole sequence fits or chunks gain nothing, else the largest of `FFN_CHUNKS` that
    fits, else the smallest of them (the budget is then out of reach by chunks alone; the caller's
    own check reports it)."""
    whole = estimate_peak(mode, sizes, replace(geometry, ffn_chunk=None), phases)
    if whole + RESERVE_BYTES <= budget_bytes:
        return None
    for chunk in FFN_CHUNKS:
        if estimate_peak(mode, sizes, replace(geometry, ffn_chunk=chunk), phases) + RESERVE_BYTES <= budget_bytes:
            return chunk
    smallest = FFN_CHUNKS[-1]
    return smallest if estimate_peak(mode, sizes, replace(geometry, ffn_chunk=smallest), phases) < whole else None


def resolve_chunk(mode: str, sizes: ModelSizes, geometry: Geometry, budget_bytes: int | None) -> Geometry:
    """`geometry` with an `"auto"` FFN chunk replaced by the one a run under `mode` uses within
    `budget_bytes` (`ffn_chunk_tokens`; None: unchunked when the budget is unknown); an explicit
    chunk (or None) is kept."""
    if geometry.ffn_chunk != AUTO_CHUNK:
        return geometry
    chunk = None if budget_bytes is None else ffn_chunk_tokens(mode, sizes, geometry, budget_bytes)
    return replace(geometry, ffn_chunk=chunk)


def host_bytes(mode: str, sizes: ModelSizes, offload_to: str = "ram", *, pinned: bool | None = True) -> int:
    """Host RAM the weights need under `mode` and `offload_to` at their peak (see the module docstring).

    `pinned`, for a mode that pins its host copies (`Mode.pins`: `group` with a prefetch stream, what
    `auto` installs on CUDA): True, a pinned copy of every grouped tensor (`ModelSizes.pinned` bytes), pinned
    one tensor at a time (`modes.group.pin_in_place`) so one tensor is held twice while it installs, at most
    the largest of a DiT block and the text encoder's embedding; None, pageable copies pinned group by group
    as they travel (diffusers' `low_cpu_mem_usage`): the groups in flight, two, at most twice their bytes
    each, stay in torch's pinned cache; False, nothing pinned (no stream)."""
    if mode not in MODE_CLASSES:
        raise ValueError(f"no estimate for mode {mode!r}")
    cls = MODE_CLASSES[mode]
    if cls.keeps_resident:
        return 0  # everything lives on the accelerator
    from .modes.disk import unit_bytes

    dits = ("transformer", "refiner") if offload_to != "disk" else ()
    held = {"text_encoder": sizes.text_encoder, "vae": sizes.vae}
    held.update({n: getattr(sizes, n) for n in dits})
    grouped = [n for n in held if n in cls.pins]
    disk = unit_bytes(mode, sizes) if offload_to == "disk" else 0
    if not grouped or pinned is False:
        return sum(held.values()) + disk
    if pinned is None:
        in_flight = 2 * PINNED_BOUND * max(sizes.largest_block, sizes.text_largest_layer)
        return sum(held.values()) + disk + in_flight
    steady = sum(sizes.pinned(n) if n in grouped else b for n, b in held.items())
    return steady + max(sizes.largest_block, sizes.text_head) + disk


PINNED_BOUND = 2
"""A tensor pinned alone takes less than twice its bytes (the power-of-two rounding of `pinned_bytes`):
what `host_bytes` counts where the tensor sizes are unknown (a GGUF or single-file component)."""


MEMINFO = "/proc/meminfo"
CGROUP_LIMITS = (  # (limit, usage, stat file, its reclaimable-cache key): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
     "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"),
)
UNLIMITED = 1 << 60  # a cgroup v1 limit at or above this is "no limit" (the kernel's page-rounded LONG_MAX)


def _read_small(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read(1 << 16)
    except OSError:
        return None


def _cgroup_available() -> int | None:
    """What the process's memory cgroup (a container's limit) still allows: limit - usage + its inactive
    page cache (reclaimed before the cgroup's OOM killer runs); None without a limit."""
    for limit_file, usage_file, stat_file, cache_key in CGROUP_LIMITS:
        limit, usage = _read_small(limit_file), _read_small(usage_file)
        if limit is None or usage is None:
            continue
        try:
            limit_bytes, used = int(limit.strip()), int(usage.strip())
        except ValueError:  # "max": no limit
            return None
        if limit_bytes >= UNLIMITED:
            return None
        cache = 0
        for line in (_read_small(stat_file) or "").splitlines():
            key, _, value = line.partition(" ")
            if key == cache_key and value.strip().isdigit():
                cache = int(value)
        return max(limit_bytes - used + cache, 0)
    return None


def available_host_bytes() -> int | None:
    """The host RAM a run may still take, None where unknown: the kernel's `MemAvailable` (free plus
    reclaimable cache; psutil's figure where there is no /proc/meminfo), capped by the memory cgroup's
    limit when the process runs in one (a container: its limit, not the machine's RAM, decides when the
    OOM killer ends the process)."""
    found = None
    for line in (_read_small(MEMINFO) or "").splitlines():
        if line.startswith("MemAvailable:"):
            try:
                found = int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                pass
            break
    if found is None:
        try:
            import psutil

            found = int(psutil.virtual_memory().available)
        except Exception:  # noqa: BLE001 - not installed, or no figure on this platform
            found = None
    capped = _cgroup_available()
    if capped is not None:
        return capped if found is None else min(found, capped)
    return found


def geometry_from(options: Mapping[str, Any], variant: str, ffn_chunk: int | str | None = AUTO_CHUNK) -> Geometry:
    """The request `auto` plans for, from its options (MoE plans for the refiner unless told not to);
    `ffn_chunk`: the handle's FFN chunk setting (`"auto"`: chunked when the budget needs it)."""
    refine = options.get("refine", MOE_REFINE_SIZE if variant == "moe" else None)
    return Geometry(height=int(options.get("height", 480)), width=int(options.get("width", 832)),
                    num_frames=int(options.get("num_frames", 121)), cfg=bool(options.get("cfg", True)),
                    refine=tuple(refine) if refine else None, vae_tiling=bool(options.get("vae_tiling", False)),
                    release_base=bool(options.get("release_base", False)), ffn_chunk=ffn_chunk,
                    rewrite_tokens=int(options.get("rewrite_tokens", 0)))
