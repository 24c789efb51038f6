"""A handle's run decided before it starts, from the memory estimate and what the handle knows: the
device's capacity and the model's sizes (the estimate's inputs), how many tokens one FFN/MoE pass
takes (`ffn_chunk_for`), whether CFG runs as one batch-2 forward (`cfg_batch_fits`), both at once
for a denoise stage (`sampling_figures`), and what
MagCache's calibration is keyed by (`step_cache_identity`). Nothing here loads a model or refuses a
request: the checks that use these figures are `stage_inputs`'.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .. import sampling
from ..components import DITS
from .estimate import AUTO_CHUNK, Geometry, GiB, ModelSizes, ffn_chunk_tokens
from .estimate import cfg_batch_fits as batch_fits


def device_capacity(device: torch.device) -> int | None:
    """All memory of the execution device (GPU total, or the host's physical RAM); None if unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError, RuntimeError, AssertionError):
        return None
    return None


_SIZES: weakref.WeakKeyDictionary[Any, tuple[Any, Any, Exception | None]] = weakref.WeakKeyDictionary()


def model_sizes(shared: Any, *, strict: bool = False) -> ModelSizes | None:
    """The model's sizes for the estimate, the one reading every decision uses (`auto`'s choice, the fit
    checks, a stage's estimate, the sampling figures): a loaded component counts the bytes its tensors hold,
    one not loaded what it will hold (`ModelSizes.from_checkpoint`; components given in memory:
    `ModelSizes.from_modules`). None: unknown (components without a DiT, files that cannot be read);
    `strict`: raise what made them unknown instead. Cached per shared components, their load dtypes and
    what is loaded."""
    key = (id(shared.info), tuple(sorted((k, str(v)) for k, v in (shared.dtypes or {}).items())),
           tuple(sorted(shared.loaded)))
    try:
        cached = _SIZES.get(shared)
    except TypeError:
        cached = None
    if cached is None or cached[0] != key:
        try:
            if shared.info is not None:  # opened from a checkpoint (a folder and/or files)
                cached = (key, ModelSizes.from_checkpoint(shared.info, shared.dtypes, shared.loaded, shared.weights), None)
            else:
                cached = (key, ModelSizes.from_modules(shared.loaded), None)
        except Exception as exc:  # noqa: BLE001 - kept for `strict`; the estimates go on without sizes
            cached = (key, None, exc)
        try:
            _SIZES[shared] = cached
        except TypeError:
            pass
    if strict and cached[2] is not None:
        raise cached[2]
    return cached[1]


@dataclass(frozen=True)
class Facts:
    """What the decisions below read of a handle, read once (`facts`): a plain record, so a decision
    never reaches back into the handle or its placement."""

    device: torch.device
    sizes: ModelSizes | None  # None: unknown (components without a DiT)
    capacity: int | None  # the device's whole memory; None: unknown
    chunk_setting: Any  # the Loader's ffn_chunk: tokens, None (off) or "auto"
    mode: str | None = None  # the concrete offload mode installed (None: nothing installed yet)
    budget: int | None = None  # the budget `auto` planned with, else `capacity`
    streamed: frozenset[str] = frozenset()  # DiTs the installed mode streams from disk


def facts(handle: Any) -> Facts:
    """The handle's `Facts` now (its installed mode included, when there is one)."""
    from .modes.disk import streams_from_disk

    device = torch.device(handle.device)
    capacity = device_capacity(device)
    placement = handle.shared.placement
    placed = placement.mode
    auto = placement.auto
    budget = auto.budget if auto is not None and auto.estimates else capacity
    streamed = frozenset(n for n in DITS if placed is not None and streams_from_disk(placed.settings, n))
    return Facts(device=device, sizes=model_sizes(handle.shared), capacity=capacity, chunk_setting=handle.shared.ffn_chunk,
                 mode=placed.name if placed is not None else None, budget=budget, streamed=streamed)


@dataclass(frozen=True)
class RequestFit:
    """A request's need against the execution device's whole memory (the memory estimate)."""

    needed: int  # bytes at the request's size, under the most frugal mode (or one VAE pass)
    capacity: int  # the device's whole memory
    largest: tuple[int, int] | None = None  # (height, width) at the same aspect that fits; when it does not


def request_fit(facts: Facts, *, height: int, width: int, num_frames: int, cfg: bool = True,
                refine: tuple[int, int] | None = None, phase: str | None = None) -> RequestFit | None:
    """What one request needs at the least (sequential offload: the smallest weight working set plus
    its activations; ``phase="decode"``: the VAE's weights and one pass) against the device's whole
    memory, and where it does not fit, the largest size at its aspect that does. None when the sizes or
    the capacity are unknown."""
    from .estimate import activation_bytes, estimate_peak, resolve_chunk

    sizes, capacity = facts.sizes, facts.capacity
    if sizes is None or capacity is None:
        return None

    def need(h: int, w: int, frames: int) -> int:
        geometry = Geometry(height=h, width=w, num_frames=frames, cfg=cfg, refine=refine,
                            ffn_chunk=facts.chunk_setting)
        if phase == "decode":
            return sizes.vae + activation_bytes(sizes, geometry)["decode"]
        return estimate_peak("sequential", sizes, resolve_chunk("sequential", sizes, geometry, capacity))

    needed = need(height, width, num_frames)
    if needed <= capacity:
        return RequestFit(needed, capacity)
    return RequestFit(needed, capacity, _largest_fitting(need, height, width, num_frames, capacity))


def _largest_fitting(need: Any, height: int, width: int, num_frames: int, capacity: int) -> tuple[int, int] | None:
    """The largest (height, width) at the same aspect (multiples of 16) whose need fits, if any."""
    aspect = width / height
    low, high = 1, max(1, height // 16)
    best = None
    while low <= high:
        mid = (low + high) // 2
        h = mid * 16
        w = max(16, int(round(h * aspect / 16)) * 16)
        if need(h, w, num_frames) <= capacity:
            best, low = (h, w), mid + 1
        else:
            high = mid - 1
    return best


def cfg_batch_fits(facts: Facts, mode: str, *, height: int, width: int, num_frames: int) -> bool:
    """Whether one batch-2 CFG forward is expected to fit the execution device under offload `mode`
    (the memory estimate against the device's whole memory); False when either is unknown."""
    if facts.sizes is None or facts.capacity is None:
        return False
    return batch_fits(mode, facts.sizes, Geometry(height=height, width=width, num_frames=num_frames), facts.capacity)


def cfg_batch_auto(facts: Facts, mode: str, transformer: str, *, packed: bool, height: int, width: int,
                   num_frames: int) -> tuple[bool, str]:
    """What `cfg_batch="auto"` does in a stage (the mode installed, `transformer` loaded; `packed`: its
    weights are stored quantized): (batch, why). It batches where one batch-2 forward is expected to be
    faster (`estimate.cfg_batch_gain`: a GPU, quantized weights, a DiT streamed from disk) and the memory
    estimate says it fits."""
    from .estimate import cfg_batch_gain

    gain = cfg_batch_gain(facts.device.type, packed=packed, streamed=transformer in facts.streamed)
    if gain is None:
        return False, "two forwards per step (on a CPU with plain weights one batch-2 forward is slower)"
    if not cfg_batch_fits(facts, mode, height=height, width=width, num_frames=num_frames):
        return False, "two forwards per step (batch 2 is not expected to fit)"
    return True, f"one batch-2 forward per step ({gain}; it fits the memory estimate)"


def ffn_chunk_for(facts: Facts, mode: str, *, height: int, width: int, num_frames: int, cfg: bool,
                  cfg_batch: bool) -> tuple[int | None, str]:
    """(tokens per FFN/MoE pass, why) for one denoise call under offload `mode`: the handle's explicit
    setting, else ("auto") the largest of `FFN_CHUNKS` that brings the memory estimate within the
    budget `auto` planned with (or the device's whole memory), None when the whole sequence fits or
    the budget is unknown."""
    setting = facts.chunk_setting
    if setting != AUTO_CHUNK:
        return setting, "set on the Loader" if setting else "chunking off"
    if facts.sizes is None or facts.budget is None:
        return None, "auto: no memory estimate"
    geometry = Geometry(height=height, width=width, num_frames=num_frames, cfg=cfg, cfg_batch=cfg_batch)
    chunk = ffn_chunk_tokens(mode, facts.sizes, geometry, int(facts.budget), phases=("denoise",))
    return chunk, (f"auto: the unchunked run is not expected to fit {facts.budget / GiB:.1f} GiB under '{mode}'"
                   if chunk else "auto: the whole sequence fits")


@dataclass(frozen=True)
class SamplingFigures:
    """What a denoise stage decides inside the door (its mode installed, its DiT loaded), in one call."""

    cfg_batch: bool  # CFG's two branches as one batch-2 forward
    cfg_batch_why: str | None  # what the stage logs about `cfg_batch` (None: nothing to say)
    ffn_chunk: int | None  # tokens per FFN/MoE pass (None: the whole sequence)
    ffn_chunk_why: str


def sampling_figures(facts: Facts, transformer: str, request: Geometry, *, packed: bool, cfg_batch: str,
                     splits_cfg: bool, set_on_model: int | None) -> SamplingFigures:
    """A denoise call's batching and chunking under the installed offload mode (`facts`, read inside the
    stage) for `request` (its size and whether CFG runs). `cfg_batch` is the option ("off", "on", "auto");
    `packed`: the DiT's weights are stored quantized; `splits_cfg`: the two branches run on two rank rows
    already; `set_on_model`: a chunk set on the DiT itself (`set_ffn_chunk`), which wins over the handle's `auto`."""
    mode = facts.mode or "none"
    cfg = request.cfg
    geometry = dict(height=request.height, width=request.width, num_frames=request.num_frames)
    why = None
    if not cfg and cfg_batch != "off":
        why = f"cfg_batch={cfg_batch}: nothing to batch at cfg <= 1 (one DiT pass per step)"
    if not cfg or cfg_batch == "off" or splits_cfg:
        batch = False
    elif cfg_batch == "on":
        batch = True
    else:
        batch, auto_why = cfg_batch_auto(facts, mode, transformer, packed=packed, **geometry)
        why = f"cfg_batch=auto: {auto_why}"
    if set_on_model is not None and facts.chunk_setting == AUTO_CHUNK:
        chunk, chunk_why = set_on_model, "set on the model"
    else:
        chunk, chunk_why = ffn_chunk_for(facts, mode, cfg=cfg, cfg_batch=batch, **geometry)
    return SamplingFigures(cfg_batch=batch, cfg_batch_why=why, ffn_chunk=chunk, ffn_chunk_why=chunk_why)


def dit_identity(handle: Any, transformer: str) -> tuple[dict[str, Any], int]:
    """(the DiT's config as parsed, bytes per activation value), read without loading it when the
    handle was opened from files (the config and the headers read at open)."""
    from ..models.config import DiTConfig

    source = handle.info.sources.get(transformer) if handle.info is not None else None
    if source is not None:
        from ..models.transformer import LingBotVideoTransformer3DModel
        from ..weights.estimate import dit_compute_bytes

        raw = source.config if source.config is not None else LingBotVideoTransformer3DModel.load_config(source.config_dir)
        width = dit_compute_bytes(source, handle.shared.dtypes.get(transformer))
    else:
        raw = dict(handle.component(transformer).config)
        width = torch.finfo(handle.dtype_of(transformer)).bits // 8
    return DiTConfig.from_mapping(raw).to_mapping(), width


def step_cache_identity(handle: Any, *, transformer: str, sampler: Any, steps: int, shift: float, sigmas: Any,
                        guidance_scale: float) -> dict[str, Any]:
    """What MagCache's ratios depend on (its calibration file is named by this): the model, its
    compute width, the sampler and its schedule. Computable before anything loads."""
    config, width = dit_identity(handle, transformer)
    return {"transformer": transformer, "folder": str(handle.folder or ""), "config": config,
            "bytes_per_value": width, "sampler": repr(sampling.get_sampler(sampler)), "steps": int(steps),
            "shift": float(shift), "sigmas": None if sigmas is None else [float(v) for v in sigmas],
            "guidance_scale": float(guidance_scale)}
