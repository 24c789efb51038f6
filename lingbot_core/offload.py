"""Placement of components while stages run: the one door every stage enters.

`stage(handle, *components)` is both the hook-reset helper and the execution-device helper. On
entry it installs the view's offload settings on the shared components if they differ from what is
installed (transactionally), (re)loads what was released, brings every component to the clean state
of the mode, acquires what the stage names and yields the handle's execution device. On exit —
success, exception or interrupt — it returns to the clean state. The device always comes from the
handle; `component_device()` only cross-checks what the hooks say.

Modes and their clean state (what may stay on the accelerator between stages):

| mode         | mechanism                                                   | resident between stages |
|--------------|-------------------------------------------------------------|-------------------------|
| `none`       | components moved to the device                              | everything loaded       |
| `model`      | accelerate `cpu_offload_with_hook` per component; a stage   | nothing                 |
|              | acquires its components and evicts every other one          |                         |
| `sequential` | accelerate `cpu_offload` per leaf (weights on `meta` between | nothing                |
|              | calls); Qwen's vision tower and each MoE FFN preload as a   |                         |
|              | unit; the VAE moves as a whole                              |                         |
| `group`      | diffusers block-level group offloading (prefetch stream and | nothing                 |
|              | pinned memory on CUDA) for the DiTs and the Qwen layer      |                         |
|              | stacks; the VAE moves as a whole                            |                         |

Entry points that bypass a hooked `forward` are handled here, explicitly: the inner Qwen model call
(`text_encoder.model`, whose embedding lookup also bypasses the language model's forward), the VAE's
`encode`/`decode` (the VAE is moved as a whole), and the MoE expert tensors read inside the sparse
block (preloaded with their block).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .interrupt import checkpoints

if TYPE_CHECKING:
    from .handle import OffloadSettings, PipelineHandle

log = logging.getLogger(__name__)

MODES = ("none", "model", "sequential", "group", "auto")
MODULE_COMPONENTS = ("text_encoder", "transformer", "refiner", "vae")
OFFLOAD_TO = ("ram", "disk")  # the CPU home of offloaded DiT weights (disk: the checkpoint file; weights/disk.py)
OPTIONS = {
    "none": set(),
    "model": {"offload_to"},
    "sequential": {"offload_to"},
    "group": {"use_stream", "low_cpu_mem_usage", "num_blocks_per_group", "record_stream", "offload_to"},
    # auto: the request it plans for, and (tests, simulations) the memory budget to plan within
    "auto": {"height", "width", "num_frames", "cfg", "refine", "vae_tiling", "budget_bytes"},
}
CPU = torch.device("cpu")

_GROUP_HOOK_NAMES = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")


# -- guards ----------------------------------------------------------------------------------------

def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    return (a.index or 0) == (b.index or 0)


def _is_sharded(module: torch.nn.Module) -> bool:
    if any(type(m).__name__ in ("FullyShardedDataParallel", "FSDPModule") or type(m).__name__.startswith("FSDP")
           for m in module.modules()):
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        return False
    return any(isinstance(p, DTensor) for p in module.parameters())


def check_guards(handle: PipelineHandle, settings: OffloadSettings, device: torch.device) -> None:
    """Refuse settings that cannot work, before anything is touched."""
    mode = settings.mode
    if mode not in MODES:
        raise ValueError(f"unknown offload mode {mode!r}; choose one of {', '.join(MODES)}")
    unknown = set(dict(settings.options)) - OPTIONS[mode]
    if unknown:
        allowed = ", ".join(sorted(OPTIONS[mode])) or "none"
        raise ValueError(f"offload mode {mode!r} does not take {', '.join(sorted(unknown))} (options: {allowed})")
    if mode == "auto":
        opts = dict(settings.options)
        budget = opts.get("budget_bytes")
        if budget is not None and (not isinstance(budget, int) or budget <= 0):
            raise ValueError(f"budget_bytes must be a positive integer, got {budget!r}")
        if any(k in opts for k in ("height", "width", "num_frames")):
            from .latents import validate_geometry

            validate_geometry(int(opts.get("height", 480)), int(opts.get("width", 832)),
                              int(opts.get("num_frames", 121)))
    if mode == "none":
        return
    offload_to = settings.option("offload_to", "ram")
    if offload_to not in OFFLOAD_TO:
        raise ValueError(f"offload_to must be one of {', '.join(OFFLOAD_TO)}, got {offload_to!r}")
    if offload_to == "disk":
        from .weights.disk import check_mappable

        for name in ("transformer", "refiner"):
            module = handle.shared.loaded.get(name)
            if isinstance(module, torch.nn.Module):
                check_mappable(getattr(module, "weight_spans", None) or {})
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        raise ValueError(f"offload mode {mode!r} cannot run under a multi-process group (FSDP, CFG- or "
                         "context-parallel): each rank holds a shard; use offload 'none' there")
    for name, module in handle.shared.loaded.items():
        if isinstance(module, torch.nn.Module) and _is_sharded(module):
            raise ValueError(f"offload mode {mode!r} cannot manage the sharded component {name!r}; "
                             "use offload 'none' with sharded models")
    if mode == "group":
        use_stream = settings.option("use_stream", device.type == "cuda")
        if use_stream and device.type == "cpu":
            raise ValueError("group offload with use_stream needs an accelerator with streams; on CPU pass "
                             "use_stream=False")
        blocks = settings.option("num_blocks_per_group", 1)
        if not isinstance(blocks, int) or blocks < 1:
            raise ValueError(f"num_blocks_per_group must be an integer >= 1, got {blocks!r}")
        try:
            import diffusers
            from diffusers.hooks import apply_group_offloading  # noqa: F401
        except ImportError as err:  # pragma: no cover - diffusers without hooks
            raise ValueError(f"group offload needs diffusers' group offloading ({err})") from err
        version = tuple(int(x) for x in diffusers.__version__.split(".")[:2] if x.isdigit())
        if device.type == "cpu" and version < (0, 42):
            raise ValueError(f"group offload on CPU needs diffusers >= 0.42 (found {diffusers.__version__})")


# -- installing and removing hooks -----------------------------------------------------------------

@dataclass
class Installed:
    """What is installed on the shared components now.

    `requested` is the view's settings (possibly `auto`); `settings` the concrete mode installed.
    """

    settings: Any
    device: torch.device
    modules: dict[str, Any] = field(default_factory=dict)  # component -> per-component state (hooks)
    requested: Any = None
    auto: Any = None  # memory.AutoChoice when `requested` is auto
    fell_back: bool = False


def _resolve(shared, requested: OffloadSettings, device: torch.device, after: str | None = None):
    """Concrete settings for a request; `auto` picks a mode from the memory estimate."""
    from .handle import OffloadSettings

    if requested.mode != "auto":
        return requested, None
    from . import memory

    options = dict(requested.options)
    budget = options.get("budget_bytes")
    if budget is None and device.type == "cpu":
        choice = memory.AutoChoice("none", {}, 0, "the execution device is the CPU, so offloading saves nothing")
    else:
        sizes = memory.ModelSizes.from_shared(shared)
        geometry = memory.geometry_from(options, shared.info.variant if shared.info else "dense")
        budget = int(budget) if budget is not None else memory.free_accelerator_bytes(device)
        choice = memory.choose_mode(sizes, geometry, budget, after=after)
    log.info(memory.describe(choice) if choice.estimates else f"auto offload: {choice.reason}")
    concrete = {"group": (("use_stream", device.type == "cuda"),)}.get(choice.mode, ())
    return OffloadSettings(choice.mode, concrete), choice



def _restore_forward(module: torch.nn.Module) -> None:
    """Hook removal leaves `forward` as an instance attribute; drop it so the class method is used again."""
    bound = module.__dict__.get("forward")
    if bound is not None and getattr(bound, "__func__", None) is type(module).forward:
        del module.__dict__["forward"]


def strip_hooks(module: torch.nn.Module) -> None:
    """Remove every accelerate and diffusers hook under `module` and restore the original methods."""
    from accelerate.hooks import remove_hook_from_module

    remove_hook_from_module(module, recurse=True)
    for sub in module.modules():
        registry = sub.__dict__.get("_diffusers_hook")
        if registry is not None:
            for name in list(reversed(registry._hook_order)):
                registry.remove_hook(name, recurse=False)
            del sub.__dict__["_diffusers_hook"]
        _restore_forward(sub)
    if any(p.device.type == "meta" for p in module.parameters()):
        raise RuntimeError(f"{type(module).__name__} lost weights while its offload hooks were removed")


def hook_inventory(module: torch.nn.Module) -> dict[str, int]:
    """Counts of offload hooks under a module (tests check that configuring twice does not stack)."""
    counts = {"accelerate": 0, "diffusers": 0, "sequential_hooks": 0, "forward_overrides": 0}
    for sub in module.modules():
        hook = sub.__dict__.get("_hf_hook")
        if hook is not None:
            counts["accelerate"] += 1
            counts["sequential_hooks"] += type(hook).__name__ == "SequentialHook"
        registry = sub.__dict__.get("_diffusers_hook")
        if registry is not None:
            counts["diffusers"] += len(registry._hook_order)
        counts["forward_overrides"] += "forward" in sub.__dict__
    return counts


def _sequential_preload(name: str, module: torch.nn.Module) -> list[str]:
    if name == "text_encoder":
        # Qwen3-VL's vision model reads pos_embed.weight outside the child's forward (transformers 5.8).
        return [type(m).__name__ for m in module.modules() if type(m).__name__.endswith("VisionModel")][:1]
    if name in ("transformer", "refiner"):
        from .models.moe import SparseMoE

        return [SparseMoE.__name__]  # its expert tensors have no forward of their own
    return []


def _group_targets(name: str, module: torch.nn.Module) -> list[torch.nn.Module]:
    if name in ("transformer", "refiner"):
        return [module]
    if name == "text_encoder":
        inner = module.model
        return [inner.language_model, inner.visual]
    return []


def _install_one(state: Installed, name: str, module: Any) -> None:
    if not isinstance(module, torch.nn.Module):
        return
    mode, device = state.settings.mode, state.device
    if mode == "none":
        state.modules[name] = None
        return
    module.to(CPU)
    if name in ("transformer", "refiner") and state.settings.option("offload_to", "ram") == "disk":
        from .weights.disk import UNIT_OF_MODE, DiskStreaming

        state.modules[name] = DiskStreaming(module, device, UNIT_OF_MODE[mode])
        return
    if mode == "model":
        from accelerate import cpu_offload_with_hook

        _, hook = cpu_offload_with_hook(module, execution_device=device)
        state.modules[name] = hook
    elif mode == "sequential" and name != "vae":
        from accelerate import cpu_offload

        cpu_offload(module, execution_device=device, offload_buffers=False,
                    preload_module_classes=_sequential_preload(name, module) or None)
        state.modules[name] = "sequential"
    elif mode == "group" and name != "vae":
        from diffusers.hooks import apply_group_offloading

        s = state.settings
        use_stream = bool(s.option("use_stream", device.type == "cuda"))
        extra = []
        for target in _group_targets(name, module):
            apply_group_offloading(
                target, onload_device=device, offload_device=CPU, offload_type="block_level",
                num_blocks_per_group=int(s.option("num_blocks_per_group", 1)), use_stream=use_stream,
                record_stream=bool(s.option("record_stream", False)),
                low_cpu_mem_usage=bool(s.option("low_cpu_mem_usage", False)),
            )
        if name == "text_encoder":
            extra.append(_onload_embeddings_on_entry(module))
        state.modules[name] = extra
    else:
        state.modules[name] = "whole"  # the VAE under sequential/group: moved as a whole by stage()


def _onload_embeddings_on_entry(text_encoder: torch.nn.Module):
    """Qwen3VLModel looks up token embeddings itself, before calling its language model; under block
    offloading those embeddings belong to the language model's top-level group, so onload that group
    when the inner model is entered."""
    from diffusers.hooks import HookRegistry

    language_model = text_encoder.model.language_model
    hook = HookRegistry.check_if_exists_or_initialize(language_model).get_hook("group_offloading")
    group = getattr(hook, "group", None)

    def onload(_module, _args):
        if group is not None:
            group.onload_()

    return text_encoder.model.register_forward_pre_hook(onload)


def _uninstall_one(state: Installed, name: str, module: Any, restore: bool = True) -> None:
    entry = state.modules.pop(name, None)
    if not isinstance(module, torch.nn.Module):
        return
    if _is_disk(entry):
        entry.remove(restore)  # restore: every tensor read back into host memory
        if not restore:
            return  # released: nothing to bring back
    if isinstance(entry, list):
        for handle in entry:
            handle.remove()
    strip_hooks(module)
    module.to(CPU)


def _install(shared, settings: OffloadSettings, device: torch.device) -> None:
    """Make `settings` the installed state; on failure, put the previous installation back.

    Components loaded since the last install (lazy loads, reloads after a release) get their hooks
    here too, so one set of hooks always covers every loaded component.
    """
    previous = shared.installed
    if previous is not None and previous.requested == settings and _same_device(previous.device, device):
        state = previous
        pending = [n for n in MODULE_COMPONENTS if n in shared.loaded and n not in state.modules]
    else:
        if previous is not None:
            for name in list(previous.modules):
                _uninstall_one(previous, name, shared.loaded.get(name))
        concrete, choice = _resolve(shared, settings, device)
        state = Installed(concrete, device, requested=settings, auto=choice)
        shared.installed = state
        shared.resident.clear()
        pending = [n for n in MODULE_COMPONENTS if n in shared.loaded]
        log.info("offload: %s on %s", concrete.mode, device)
    try:
        for name in pending:
            _install_one(state, name, shared.loaded[name])
    except BaseException:
        for name in list(state.modules):
            _uninstall_one(state, name, shared.loaded.get(name))
        shared.installed = None
        if previous is not None and previous is not state:
            _install(shared, previous.requested, previous.device)
        raise


def fall_back(handle: PipelineHandle) -> bool:
    """After an out-of-memory error under `auto`: install the next smaller mode, once. True if it did."""
    shared = handle.shared
    with shared.lock:
        state = shared.installed
        if state is None or state.requested is None or state.requested.mode != "auto" or state.fell_back:
            return False
        if state.settings.mode == "sequential":
            return False
        from . import memory

        following = memory.MODE_ORDER[memory.MODE_ORDER.index(state.settings.mode) + 1]
        from .handle import OffloadSettings

        concrete = OffloadSettings(following, (("use_stream", state.device.type == "cuda"),)
                                   if following == "group" else ())
        log.warning("auto offload: out of memory under '%s'; falling back to '%s' and retrying once",
                    state.settings.mode, following)
        for name in list(state.modules):
            _uninstall_one(state, name, shared.loaded.get(name))
        new = Installed(concrete, state.device, requested=state.requested, auto=state.auto, fell_back=True)
        shared.installed = new
        shared.resident.clear()
        for name in MODULE_COMPONENTS:
            if name in shared.loaded:
                _install_one(new, name, shared.loaded[name])
        if state.device.type == "cuda":
            torch.cuda.empty_cache()
        return True


def effective_mode(handle: PipelineHandle) -> str:
    """The concrete mode this view runs under (auto resolved), installing it if needed."""
    with handle.shared.lock:
        _install(handle.shared, handle.offload, handle.device)
        return handle.shared.installed.settings.mode


def configure_offload(handle: PipelineHandle, mode: str, device: str | torch.device | None = None,
                      **options: Any) -> PipelineHandle:
    """A view of `handle` with these offload settings, installed now on the shared components.

    Idempotent (the same settings twice install one set of hooks), switchable in any order, and
    transactional: if installing fails half way, the previous installation is restored.
    """
    view = handle.with_device(device) if device is not None else handle
    view = view.with_offload(mode, **options)  # validates (check_guards) before anything is touched
    with view.shared.lock:
        _install(view.shared, view.offload, view.device)
    return view


# -- the stage door --------------------------------------------------------------------------------

def _is_disk(entry: Any) -> bool:
    return type(entry).__name__ == "DiskStreaming"


def component_device(module: Any) -> torch.device | None:
    """Where a component computes, read from its offload hook when it has one, else from its weights."""
    if not isinstance(module, torch.nn.Module):
        return None
    disk = module.__dict__.get("_lingbot_disk")
    if disk is not None:
        return disk.device
    hook = module.__dict__.get("_hf_hook")
    hooks = getattr(hook, "hooks", (hook,)) if hook is not None else ()
    for h in hooks:
        if getattr(h, "execution_device", None) is not None:
            return torch.device(h.execution_device)
    for sub in module.modules():
        registry = sub.__dict__.get("_diffusers_hook")
        group_hook = registry.get_hook("group_offloading") if registry is not None else None
        if group_hook is not None:
            return torch.device(group_hook.group.onload_device)
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return None


def execution_device(handle: PipelineHandle, name: str | None = None) -> torch.device:
    """The device a stage builds its inputs on: the handle's. With `name`, check the component agrees."""
    if name is not None:
        found = component_device(handle.shared.loaded.get(name))
        if found is not None and not _same_device(found, handle.device):
            raise RuntimeError(f"{name} is set up to run on {found} but the handle's execution device is "
                               f"{handle.device}; reconfigure offload")
    return handle.device


def _to_device(module: Any, device: torch.device) -> None:
    if isinstance(module, torch.nn.Module):
        module.to(device)


def _settle(shared) -> None:
    """Bring every component to the clean state of the installed mode."""
    state = shared.installed
    if state.settings.mode == "none":
        return  # what a stage brought onto the device stays there
    _send_home(shared, list(shared.resident))
    if state.device.type == "cuda":
        torch.cuda.empty_cache()


def _send_home(shared, names: list[str]) -> None:
    state = shared.installed
    for name in names:
        entry = state.modules.get(name) if state is not None else None
        if _is_disk(entry):
            entry.settle()  # a forward that failed half way leaves no unit loaded
        elif hasattr(entry, "offload"):  # model mode: accelerate's hook moves it home
            entry.offload()
        elif entry in ("whole", None):
            _to_device(shared.loaded.get(name), CPU)
        # sequential and group hooks put weights back after every forward on their own
        shared.resident.discard(name)


SETTLE_LISTENERS: list = []
"""Callables `(shared, device)` run after every stage; a host tracks what stays resident with them."""


def evict(shared) -> list[str]:
    """Move what the offload state holds on the accelerator back home (a host asked for memory).

    Components the running stage uses stay; the next stage brings back what it needs.
    """
    with shared.lock:
        names = sorted(shared.resident - shared.in_stage)
        _send_home(shared, names)
        if names:
            log.info("offload: moved %s off %s on request", ", ".join(names), shared.installed.device)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return names


ACQUIRE_LISTENERS: list = []
"""Callables `(component, module, device, nbytes)` run before a whole component is moved onto the
device; a host such as ComfyUI uses this to free its own models first."""


def module_bytes(module: Any) -> int:
    if not isinstance(module, torch.nn.Module):
        return 0
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type != "meta" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _acquire(shared, name: str, device: torch.device) -> None:
    state = shared.installed
    entry = state.modules.get(name)
    if _is_disk(entry):
        pass  # streamed from the file by its own hooks
    elif state.settings.mode in ("none", "model") or entry == "whole":
        module = shared.loaded[name]
        if name not in shared.resident and device.type != "cpu":
            for listener in list(ACQUIRE_LISTENERS):
                listener(name, module, device, module_bytes(module))
        _to_device(module, device)
    shared.resident.add(name)


@contextmanager
def stage(handle: PipelineHandle, *components: str, label: str | None = None) -> Iterator[torch.device]:
    """Acquire `components` for one stage and yield the execution device; restore the clean state after."""
    shared = handle.shared
    label = label or "+".join(components)
    with shared.lock:
        for name in components:
            handle.component(name)  # (re)load what was released
        _install(shared, handle.offload, handle.device)
        try:
            _settle(shared)
            shared.in_stage = set(components)
            for name in components:
                if name in MODULE_COMPONENTS:
                    _acquire(shared, name, handle.device)
                    shared.ledger.append(("acquire", name, label))
            device = execution_device(handle, components[0] if components else None)
            for name in components[1:]:
                execution_device(handle, name)
            with checkpoints({name: shared.loaded.get(name) for name in components}):
                yield device
        finally:
            for name in components:
                if name in MODULE_COMPONENTS:
                    shared.ledger.append(("release", name, label))
            shared.in_stage = set()
            _settle(shared)
            for listener in list(SETTLE_LISTENERS):
                listener(shared, handle.device)
            if log.isEnabledFor(logging.INFO):
                from .memory import memory_report

                log.info("after %s: %s", label, memory_report(handle).one_line())


def resident_components(handle: PipelineHandle) -> set[str]:
    """Components the offload state considers on the accelerator right now."""
    return set(handle.shared.resident)


def allowed_resident(handle: PipelineHandle) -> set[str]:
    """What the installed mode allows to stay resident between stages."""
    if handle.shared.installed is None or handle.shared.installed.settings.mode == "none":
        return {n for n in MODULE_COMPONENTS if n in handle.shared.loaded}
    return set()


# -- release ---------------------------------------------------------------------------------------

def release(handle: PipelineHandle, components: tuple[str, ...] | list[str] | None = None) -> list[str]:
    """Drop components (all by default): hooks first, then the modules; the handle reloads them on demand.

    Returns the names released. Hook-held references (weights maps, offload groups, prefetch lists)
    would otherwise keep a released model alive.
    """
    shared = handle.shared
    with shared.lock:
        names = [n for n in (components or list(shared.loaded)) if n in shared.loaded]
        if shared.folder is None and names:
            raise RuntimeError("this handle was built from in-memory components and cannot reload them; "
                               "keep them or open the handle from a checkpoint folder")
        for name in names:
            module = shared.loaded.pop(name)
            if shared.installed is not None:
                _uninstall_one(shared.installed, name, module, restore=False)
            elif isinstance(module, torch.nn.Module):
                strip_hooks(module)
            shared.resident.discard(name)
            shared.ledger.append(("drop", name, "release"))
            del module
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return names

