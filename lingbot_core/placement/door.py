"""The one door every stage enters, and what acts on placement from outside a stage.

`stage(handle, *components)` is both the hook-reset helper and the execution-device helper. On
entry it (re)loads what was released, applies the view's per-view state (see "View state"
below), installs the view's offload settings on the shared components if they differ from what
is installed (transactionally), brings every component to the clean state of the mode, acquires
what the stage names and yields the handle's execution device. On exit — success, exception or
interrupt — it returns every component to the clean state, so nothing stays on the device that
the mode does not allow.

View state (the extension point for per-view settings such as a LoRA stack). A view carries a
tuple of objects, `handle.view_states`, each with:

    kind: str                                  # one state per kind on a view, e.g. "lora"
    apply(components, names) -> None           # put this state on components[n] for n in names
    remove(components, names) -> None          # take it off again

`components` is a `weights.state.Models`: the modules by name, and `components.state(n)`, the
owner of component n's mutable state (where a LoRA keeps its pristine copies). A state needs these three
and value equality (a frozen dataclass is ideal: equal states are not re-applied). At stage
entry the placement (`Placement.apply_view_states`, the one owner of what each component carries)
compares the view's states with what the shared components carry; when a kind
differs, or a component was (re)loaded since, it suspends the offload installation (hooks off,
every tensor back in its CPU home: plain modules), calls `remove` of the old state and `apply` of
the new one on the loaded module components (`text_encoder`, `transformer`, `refiner`, `vae`), and
installs the offload mode again, so hooks see the modules as the state left them (added LoRA
layers included). Under `none` the modules are plain already and nothing is suspended: the states
change them where they are (on the device; FSDP's shards as they are). This runs under the shared
lock, before anything is acquired.

Modes and their clean state (what may stay on the accelerator between stages):

| mode         | mechanism                                                   | resident between stages |
|--------------|-------------------------------------------------------------|-------------------------|
| `none`       | components moved to the device                              | everything loaded       |
| `model`      | a stage's components moved whole (rebinding each tensor     | nothing                 |
|              | between its CPU home and a device copy); no hooks           |                         |
| `sequential` | accelerate `cpu_offload` per leaf (weights on `meta` between | nothing                |
|              | calls); Qwen's vision tower and each MoE FFN preload as a   |                         |
|              | unit; the VAE moves whole                                   |                         |
| `group`      | diffusers block-level group offloading (prefetch stream and | nothing                 |
|              | pinned memory on CUDA) for the DiTs and the Qwen layer      |                         |
|              | stacks; the VAE moves whole                                 |                         |

`offload_to="disk"` (`modes/disk.py`) wraps a mode: the DiTs' CPU home is their checkpoint file,
read one streaming unit at a time right before it computes (the mode's `disk_unit`: `model` reads
the whole DiT per forward as a `model` unit, `group` a `block`, `sequential` a `layer`) and dropped
after, so a DiT holds no host copy between stages either; every other component follows the mode.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Protocol

import torch

from ..interrupt import checkpoints
from . import calibration, estimate, fit, plan, state
from .modes import MODE_ORDER
from .report import MemoryReport, build_report
from .settings import OffloadSettings
from .state import Placement
from .tensors import stored_bytes


class SharedComponents(Protocol):
    """What the door reads of a `lingbot_core.handle.SharedComponents` (not imported: the handle
    depends on placement)."""

    info: Any  # a CheckpointInfo, or None for a handle built from components
    dtypes: dict[str, torch.dtype | None]
    weights: str
    ffn_chunk: Any
    loaded: dict[str, Any]
    states: dict[str, Any]
    lock: Any
    placement: Placement

    def get(self, name: str, *, streamed: bool = False) -> Any: ...


class PipelineHandle(Protocol):
    """What the door reads of a `lingbot_core.handle.PipelineHandle` view."""

    shared: SharedComponents
    device: torch.device
    offload: OffloadSettings
    view_states: tuple[Any, ...]
    parallel: Any

    def with_device(self, device: str | torch.device) -> PipelineHandle: ...
log = logging.getLogger("lingbot_core.offload")

MemoryListener = Callable[[str, Any, torch.device, int], None]
"""`(component, module, device, nbytes)`, run before placement needs `nbytes` of device memory: before a
whole component is moved onto the device, and before `auto` reads the free memory (component "auto
plan", module None). A host such as ComfyUI frees its own models here."""
SettleListener = Callable[[SharedComponents, torch.device], None]
"""`(shared, device)`, run after every stage; a host tracks what stays resident with it."""


def add_listeners(handle: PipelineHandle, *, memory: MemoryListener | None = None,
                  settle: SettleListener | None = None,
                  free: Callable[[torch.device], int] | None = None) -> None:
    """Run `memory` / `settle` for this handle's components (every view of it; another handle's
    stages never call them). Adding one a second time is a no-op. `free`: the host's reading of the free
    accelerator bytes, which auto offload then plans with instead of the driver's figure (a host whose
    allocator pages weights in and out, such as ComfyUI's dynamic VRAM, knows better what is free)."""
    placement = handle.shared.placement
    with handle.shared.lock:
        for listener, listeners in ((memory, placement.memory_listeners), (settle, placement.settle_listeners)):
            if listener is not None and listener not in listeners:
                listeners.append(listener)
        if free is not None:
            placement.free_reader = free


def module_bytes(module: Any) -> int:
    """Bytes a component holds in real storage (weights on `meta` count nothing)."""
    return stored_bytes(module)


# -- settings ----------------------------------------------------------------------------------------

def configure_offload(handle: PipelineHandle, mode: str, device: str | torch.device | None = None,
                      offload_to: str = "ram", **options: Any) -> PipelineHandle:
    """A view of `handle` with these offload settings, installed now on the shared components.

    Idempotent (the same settings twice install one set of hooks), switchable in any order, and
    transactional: if installing fails part way, the previous installation is restored exactly
    and the original error is raised.
    """
    view = handle.with_device(device) if device is not None else handle
    view = view.with_offload(mode, offload_to=offload_to, **options)  # validates before anything moves
    with view.shared.lock:
        _ensure(view)
    return view


def _free_budget(shared: SharedComponents, device: torch.device, wanted: int) -> int:
    """Free accelerator bytes, read after asking the host to make `wanted` bytes free."""
    for listener in list(shared.placement.memory_listeners):
        listener("auto plan", None, device, wanted)
    return free_bytes(shared, device)


def free_bytes(shared: SharedComponents, device: torch.device) -> int:
    """Free accelerator bytes as the host reads them (`add_listeners(free=...)`), else as the driver does."""
    reader = shared.placement.free_reader
    return max(int(reader(device)), 0) if reader is not None else free_accelerator_bytes(device)


def free_accelerator_bytes(device: torch.device) -> int:
    """Bytes a new allocation on `device` can have: what the driver reports free plus what torch's caching
    allocator holds reserved but unused (earlier stages' freed blocks, which `mem_get_info` counts as used
    but torch hands out again without asking the driver; ComfyUI's `get_free_memory` counts them the same way)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached = int(torch.cuda.memory_reserved(device)) - int(torch.cuda.memory_allocated(device))
        return int(free) + max(cached, 0)
    raise ValueError(f"auto offload needs an accelerator to measure; the device is {device}")


def _group_defaults(device: torch.device) -> tuple[tuple[str, Any], ...]:
    return (("use_stream", device.type == "cuda"),)


def resolve(shared: SharedComponents, requested: OffloadSettings,
            device: torch.device, layout: Any = None) -> tuple[OffloadSettings, fit.AutoChoice | None]:
    """Concrete settings for a request; `auto` picks a mode from the memory estimate (with a parallel
    `layout`: 'none', the one mode that runs on several processes, estimated per GPU). The choice is
    `fit`'s; the door reads what it decides with: the model's sizes and the budgets (asking the host first)."""
    if requested.mode != "auto":
        return requested, None
    budget = requested.option("budget_bytes")
    with calibration.on_device(calibration.device_name(device)):  # never below what this device measured
        if layout is not None:
            sizes = plan.model_sizes(shared)
            variant = shared.info.variant if shared.info else "dense"
            geometry = estimate.geometry_from(dict(requested.options), variant, None) if sizes is not None else None
            if sizes is not None and budget is None and device.type == "cuda":
                budget = free_bytes(shared, device)
            choice = fit.choose_parallel(estimate.ParallelShare.of(layout), layout.describe(), sizes, geometry, budget)
        elif budget is None and device.type == "cpu":
            choice = fit.AutoChoice("none", {}, 0, "the execution device is the CPU, so offloading saves nothing")
        else:
            sizes = plan.model_sizes(shared, strict=True)
            geometry = estimate.geometry_from(dict(requested.options), shared.info.variant if shared.info else "dense",
                                              shared.ffn_chunk)
            host_budget = requested.option("host_budget_bytes")
            if host_budget is None:  # always read (a VRAM budget given or not): a host run out of RAM is killed
                host_budget = estimate.available_host_bytes()
            if budget is None:
                wanted = estimate.estimate_peak("none", sizes, geometry) + estimate.RESERVE_BYTES
                budget = _free_budget(shared, device, wanted)
            choice = fit.choose_mode(sizes, geometry, int(budget), host_budget=host_budget,
                                     offload_to=requested.offload_to)
    if choice.fits:
        log.info(fit.describe(choice) if choice.estimates else f"auto offload: {choice.reason}")
    else:  # loud: the run may end in an out-of-memory error; the reason says what to change
        log.warning(fit.describe(choice))
    options = _group_defaults(device) if choice.mode == "group" else ()
    return OffloadSettings(choice.mode, options, choice.offload_to or requested.offload_to), choice


Plan = tuple[OffloadSettings, "fit.AutoChoice | None"] | None
"""What `_plan` decided: the concrete settings to install (and `auto`'s choice), or None when the
view's settings are installed already."""


def _plan(handle: PipelineHandle) -> Plan:
    placement = handle.shared.placement
    if placement.matches(handle.offload, handle.device):
        return None
    from ..distributed.stage import active_layout

    return resolve(handle.shared, handle.offload, handle.device, active_layout(handle))


def _load(handle: PipelineHandle, names: tuple[str, ...], plan: Plan) -> None:
    """(Re)load what was released; a DiT that will stream from disk loads with its weights left in the file."""
    from .modes.disk import streams_from_disk

    shared = handle.shared
    concrete = plan[0] if plan is not None else shared.placement.mode.settings
    for name in names:
        shared.get(name, streamed=streams_from_disk(concrete, name))


def _ensure(handle: PipelineHandle) -> None:
    """Make the view's settings the installed ones (call under the shared lock)."""
    handle.shared.placement.ensure(handle.shared.loaded, handle.offload, handle.device, _plan(handle))


def effective_mode(handle: PipelineHandle) -> str:
    """The concrete mode this view runs under (auto resolved), installing it if needed."""
    with handle.shared.lock:
        _ensure(handle)
        return handle.shared.placement.mode.name


def installed_mode(handle: PipelineHandle) -> str | None:
    """The concrete mode installed on the shared components now (None: nothing installed)."""
    mode = handle.shared.placement.mode
    return mode.name if mode is not None else None


def has_fallen_back(handle: PipelineHandle) -> bool:
    """Has `auto` moved to a smaller mode after running out of memory?"""
    return handle.shared.placement.fell_back


# -- the stage door -------------------------------------------------------------------------------------

def execution_device(handle: PipelineHandle, name: str | None = None) -> torch.device:
    """The device a stage builds its inputs on: the handle's. With `name`, check the component agrees."""
    if name is not None:
        state.check_device(name, handle.shared.loaded.get(name), handle.device)
    return handle.device


def sampling_figures(handle: PipelineHandle, dit: str, *, packed: bool, cfg_batch: str, splits_cfg: bool,
                     set_on_model: int | None) -> plan.SamplingFigures:
    """Inside a sampling stage, entered with its request's `geometry`: how it runs under the installed mode
    (`plan.sampling_figures`: CFG as one batch or two, the FFN/MoE chunk of `dit`). The stage's peak is then
    set against the estimate for the request as it runs; the memory report shows the chunk. `packed`: the DiT's
    weights are stored quantized; `cfg_batch`: the option; `splits_cfg`: the branches run on two rank rows;
    `set_on_model`: a chunk set on the DiT itself."""
    from ..distributed.stage import active_layout

    placement = handle.shared.placement
    request = placement.stage_geometry
    if request is None:
        raise RuntimeError("sampling_figures runs inside a stage entered with its request's geometry")
    # the processes of a parallel run share every forward, so they must batch alike, and `auto` decides from
    # this process's memory (its GPU, what it holds): rank 0 could run two forwards a step and rank 1 one
    ranks_agree = cfg_batch == "auto" and request.cfg and not splits_cfg and active_layout(handle) is not None
    figures = plan.sampling_figures(plan.facts(handle), dit, request, packed=packed,
                                    cfg_batch="off" if ranks_agree else cfg_batch, splits_cfg=splits_cfg,
                                    set_on_model=set_on_model)
    if ranks_agree:
        figures = replace(figures, cfg_batch_why="cfg_batch=auto: two forwards per step (the processes of a parallel "
                                                 "run share each forward and would each decide from their own "
                                                 "memory; cfg_batch on batches on all of them)")
    placement.stage_geometry = replace(request, cfg_batch=figures.cfg_batch, ffn_chunk=figures.ffn_chunk)
    placement.ffn_chunks[dit] = (figures.ffn_chunk, figures.ffn_chunk_why)
    return figures


def note_generation(handle: PipelineHandle, encoder: torch.nn.Module, prompt_tokens: int, new_tokens: int) -> None:
    """Inside a rewrite's stage, after `encoder` generated: what its generation held (the context's tokens and
    the bytes by part at the encoder's own shape, `estimate.generation_bytes`); the memory report shows it."""
    shape = estimate.module_generation_shape(encoder)
    tokens = prompt_tokens + new_tokens
    handle.shared.placement.generation = (
        tokens, estimate.generation_bytes(shape["text_kv_bytes_per_token"], shape["text_vocab"], tokens))


def _stage_estimate(handle: PipelineHandle, phase: str | None) -> int | None:
    """The estimate of one stage's peak under the installed mode, for the request it was entered with (and
    ran: `sampling_figures`); None: no phase, or no sizes to go on."""
    mode = installed_mode(handle)
    geometry = handle.shared.placement.stage_geometry
    if phase is None or mode is None:
        return None
    if geometry is None:  # the text phases do not depend on the video's size
        geometry = estimate.Geometry(16, 16, 1)
    if phase in ("refine", "refine_decode") and geometry.refine is None:  # a refiner pass at this size
        geometry = replace(geometry, refine=(geometry.height, geometry.width))
    sizes = plan.model_sizes(handle.shared)
    if sizes is None:  # in-memory components without a DiT
        return None
    try:
        return estimate.estimate_peak(mode, sizes, geometry, (phase,))
    except ValueError:  # a phase this request does not have: nothing to set the peak against
        return None


@contextmanager
def stage(handle: PipelineHandle, *components: str, label: str | None = None, phase: str | None = None,
          geometry: estimate.Geometry | None = None) -> Iterator[torch.device]:
    """Acquire `components` for one stage and yield the execution device; restore the clean state after.

    On CUDA the stage's peak is measured (`calibration`): with `phase` (a name of `estimate.activation_bytes`)
    and the request's `geometry`, next to its estimate under the installed mode. A sampling stage learns how
    it runs inside (`sampling_figures`)."""
    shared = handle.shared
    placement = shared.placement
    label = label or "+".join(components)
    with shared.lock:
        measuring = calibration.start(handle.device, placement.resident_bytes(shared.loaded))
        placement.stage_geometry = geometry  # the stage's request (a sampling stage: as it runs, `sampling_figures`)
        plan = _plan(handle)  # decided before loading: how a DiT loads depends on where it will live
        _load(handle, components, plan)
        placement.apply_view_states(shared.loaded, handle.view_states)
        placement.ensure(shared.loaded, handle.offload, handle.device, plan)
        try:
            placement.enter(shared.loaded, components, label, handle.device)
            with checkpoints({name: shared.loaded.get(name) for name in components}):
                yield handle.device
            if measuring is not None:  # a stage that finished: its peak and its estimate
                placement.measured[label] = calibration.finish(
                    measuring, handle.device, label, placement.mode.name,
                    _stage_estimate(handle, phase))
        finally:
            placement.leave(shared.loaded, components, label)
            for listener in list(placement.settle_listeners):
                listener(shared, handle.device)
            if log.isEnabledFor(logging.DEBUG):  # per stage: DEBUG (a run logs one INFO summary)
                log.debug("after %s: %s", label, memory_report(handle).one_line())


def resident_components(handle: PipelineHandle) -> set[str]:
    """Components the offload state holds on the accelerator right now."""
    return set(handle.shared.placement.resident)


def resident_bytes(shared: SharedComponents) -> int:
    """Bytes of the components held on the accelerator between stages (what a host may ask back)."""
    return shared.placement.resident_bytes(shared.loaded)


def allowed_resident(handle: PipelineHandle) -> set[str]:
    """What the installed mode allows to stay resident between stages."""
    return handle.shared.placement.allowed_resident(handle.shared.loaded)


def ledger(handle: PipelineHandle) -> list[tuple[str, str, str]]:
    """The newest (event, component, stage) records: acquire, release, drop."""
    return list(handle.shared.placement.ledger)


def memory_report(handle: PipelineHandle) -> MemoryReport:
    """Where each component's tensors live now, and their bytes per location."""
    mode = installed_mode(handle) or handle.offload.mode
    report = build_report(handle.shared.loaded, handle.device, mode, handle.shared.placement.ffn_chunks,
                          handle.shared.placement.generation, states=handle.shared.states)
    report.measured = list(handle.shared.placement.measured.values())
    from ..distributed.stage import active_layout

    layout = active_layout(handle)
    report.parallel = layout.describe() if layout is not None else None
    return report


# -- from outside a stage ----------------------------------------------------------------------------

def evict(shared: SharedComponents) -> list[str]:
    """Move what the offload state holds on the accelerator back home (a host asked for memory).

    Components the running stage uses stay; the next stage brings back what it needs.
    """
    with shared.lock:
        placement = shared.placement
        names = sorted(placement.resident - placement.in_stage)
        if not names or placement.mode is None:
            return []
        mode = placement.mode
        for name in names:
            module = shared.loaded.get(name)
            if mode.keeps_resident:
                if isinstance(module, torch.nn.Module):
                    module.to("cpu")
            else:
                mode.settle(name, module)
            placement.resident.discard(name)
        log.info("offload: moved %s off %s on request", ", ".join(names), mode.device)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return names


def release(handle: PipelineHandle, components: tuple[str, ...] | list[str] | None = None) -> list[str]:
    """Drop components (all by default): hooks first, then the modules; the handle reloads them on demand.

    Returns the names released. Hook-held references (weights maps, offload groups, prefetch lists)
    would otherwise keep a released model alive.
    """
    shared = handle.shared
    with shared.lock:
        names = [n for n in (components or list(shared.loaded)) if n in shared.loaded]
        if shared.info is None and names:  # nothing to reload from
            raise RuntimeError("this handle was built from in-memory components and cannot reload them; "
                               "keep them or open the handle from a checkpoint folder")
        for name in names:
            module = shared.loaded.pop(name)
            shared.placement.drop(name, module)
            shared.states.pop(name, None)  # its disk homes, notes and LoRA copies go with it
            shared.placement.ledger.append(("drop", name, "release"))
            del module
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return names


def fall_back(handle: PipelineHandle) -> bool:
    """After an out-of-memory error under `auto`: install the next smaller mode, once. True if it did.

    Never on a view of several processes: only `none` runs there, and the rank that ran out would retry
    the stage alone while the others wait in its collectives (it raises, and the others hear of it)."""
    from ..distributed.stage import active_layout

    if active_layout(handle) is not None:
        return False
    shared = handle.shared
    with shared.lock:
        placement = shared.placement
        if placement.mode is None or placement.requested is None or placement.requested.mode != "auto":
            return False
        current = placement.mode.name
        if placement.fell_back or current == MODE_ORDER[-1]:
            return False
        following = MODE_ORDER[MODE_ORDER.index(current) + 1]
        concrete = OffloadSettings(following, _group_defaults(placement.device) if following == "group" else (),
                                   placement.mode.settings.offload_to)
        log.warning("auto offload: out of memory under '%s'; falling back to '%s' and retrying once",
                    current, following)
        placement.install(shared.loaded, placement.requested, concrete, placement.device, auto=placement.auto,
                          fell_back=True)
        if placement.device.type == "cuda":
            torch.cuda.empty_cache()
        return True


def oom_fallback(fn):
    """Under `auto` offload, an out-of-memory error moves to the next smaller mode and retries once."""
    @functools.wraps(fn)
    def wrapper(handle, *args, **kwargs):
        generator = kwargs.get("generator")
        rng_state = generator.get_state() if generator is not None else None
        try:
            return fn(handle, *args, **kwargs)
        except torch.OutOfMemoryError:
            if not fall_back(handle):
                raise
        if generator is not None:
            generator.set_state(rng_state)  # the retry draws the same numbers
        return fn(handle, *args, **kwargs)

    return wrapper


def require_refiner(handle: PipelineHandle, refine: object) -> None:
    """A planned refine needs the MoE checkpoint's `refiner/`: refused now, not after the base pass."""
    info = handle.shared.info
    if refine and info is not None and info.variant == "moe" and not info.has_refiner:
        raise ValueError(f"{info.folder} has no refiner/ folder, and this run refines: download it "
                         "(hf download <repo> --local-dir <the same folder> --include \"refiner/*\"), or remove "
                         "the Refine node and turn plan_refine off. The DMD student's root has no refiner: to refine "
                         "after it, load the base MoE root with transformer_path set to the student root")


def check_handle(handle: PipelineHandle, geometry: estimate.Geometry, *, mode: str | None = None, offload_to: str | None = None,
                 vram_free: int | None = None, host_free: int | None = None) -> fit.Fit | None:
    """The fit of a planned run under `handle`'s offload settings (or `mode`/`offload_to`), logged:
    a WARNING with what to change when it does not fit. None where nothing is checked: `auto`
    (it decides with the same numbers when it installs) and a CPU execution device."""
    require_refiner(handle, geometry.refine)
    if geometry.ffn_chunk is None:  # the run chunks as the handle says ("auto": when the budget needs it)
        from dataclasses import replace

        geometry = replace(geometry, ffn_chunk=handle.shared.ffn_chunk)
    settings = handle.offload
    mode = mode or settings.mode
    offload_to = offload_to or settings.offload_to
    device = handle.device
    if mode == "auto" or (device.type == "cpu" and vram_free is None):
        return None
    sizes = plan.model_sizes(handle.shared, strict=True)
    if vram_free is None:
        vram_free = _free_budget(handle.shared, device, estimate.estimate_peak(mode, sizes, geometry) + estimate.RESERVE_BYTES)
    if host_free is None:
        host_free = estimate.available_host_bytes()
    pinned: bool | None = device.type == "cuda" and not (mode == settings.mode and not settings.option("use_stream", True))
    if pinned and mode == settings.mode and settings.option("low_cpu_mem_usage", False):
        pinned = None  # diffusers pins each group only as it travels
    with calibration.on_device(calibration.device_name(device)):
        verdict = fit.check(sizes, geometry, mode, offload_to, vram_free=vram_free, host_free=host_free,
                            pinned=pinned)
    if verdict.ok:
        log.info("offload '%s': %s", mode, verdict.line())
    else:
        log.warning("offload '%s' is not expected to fit: %s", mode, verdict.line())
    return verdict
