"""The one registry of behaviour attached to modules: install, remove and list hooks in one place.

Everything the pack attaches to a model's modules is a *named hook*: disk streaming
(`weights.disk`), the interrupt checkpoints (`interrupt`), group offload's embedding onload
(`placement.modes.group`), and whatever comes next (a step cache, a compiled region). Our hooks have
diffusers' `ModelHook` interface and sit in the module's diffusers `HookRegistry` -- the same registry
diffusers' group offloading (`group` mode) fills -- so one walk lists them all and one call takes
them all off. The one foreign mechanism is accelerate's `_hf_hook` (`sequential` mode is accelerate's
`cpu_offload`): it is listed and removed here too, under the name `accelerate`, so callers never
care which library put a hook on a module.

Adding a hook:

    @hooks.named("lingbot.step_cache", "skips a block whose input barely changed")
    class StepCache(hooks.Hook):
        def pre_forward(self, module, *args, **kwargs):   # diffusers' ModelHook interface
            ...
            return args, kwargs
        def post_forward(self, module, output):
            return output

    hooks.attach(block, StepCache(...))        # once per module; a second attach of the name raises
    hooks.detach(block, StepCache.name)        # or hooks.strip(model): everything off, forward restored

`named` puts the name in `KNOWN` (what `listing` can describe and what tests enumerate). A hook
that must run outside another one (a compiled region around a block that group offload moves)
is attached after it: the registry wraps `forward`, so the hook attached last runs its
`pre_forward` first. Diffusers' group offload hooks keep their own names (`group_offloading`,
`layer_execution_tracker`, `lazy_prefetch_group_offloading`) and are listed like ours.

Why not raw `register_forward_pre_hook`: a torch hook handle lives wherever its installer kept
it, so listing what is on a model, or removing everything after an install failed half way, needs
every installer's own bookkeeping. Here the module itself carries the registry.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any, TypeVar

import torch

ACCELERATE = "accelerate"
"""The name accelerate's `_hf_hook` (sequential offload) is listed under."""

KNOWN: dict[str, str] = {ACCELERATE: "accelerate's offload hook (sequential mode: weights on meta between calls)",
                         "group_offloading": "diffusers' group offloading (group mode: block streaming)",
                         "layer_execution_tracker": "diffusers' group offloading: records the layer order once",
                         "lazy_prefetch_group_offloading": "diffusers' group offloading: sets up prefetching"}
"""Every hook name the pack attaches or expects, with what it does."""

LASTING: set[str] = set()
"""Hooks that belong to the model rather than to a placement (a compiled region): an offload mode
taking its hooks off (`strip(module, keep=LASTING)`) leaves them on."""

MARKS = frozenset({"_diffusers_hook", "_hf_hook", "_old_forward", "forward"})
"""The instance attributes a hooked module carries (diffusers' registry, accelerate's hook, the wrapped
`forward`): the only ones the pack may add to a module, and `strip` takes them all off."""


class Hook:
    """A named behaviour on one module, with diffusers' `ModelHook` interface (`name` is set by `named`).

    Not a `ModelHook` subclass only so that importing this module does not import diffusers (the nodes
    import `interrupt` when ComfyUI starts); the registry calls exactly these methods.
    """

    name: str = ""
    _is_stateful = False

    def __init__(self) -> None:
        self.fn_ref: Any = None  # set by diffusers' registry

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def deinitalize_hook(self, module: torch.nn.Module) -> torch.nn.Module:  # diffusers' spelling
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return output

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        return module


H = TypeVar("H", bound=type)


def named(name: str, what: str, *, lasting: bool = False):
    """Class decorator: give a `Hook` subclass its registry name and describe it in `KNOWN`.
    `lasting`: the hook belongs to the model, not to a placement (see `LASTING`)."""
    def register(cls: H) -> H:
        if KNOWN.get(name, what) != what:
            raise ValueError(f"hook name {name!r} is registered already ({KNOWN[name]})")
        KNOWN[name] = what
        if lasting:
            LASTING.add(name)
        cls.name = name
        return cls
    return register


def _registry(module: torch.nn.Module) -> Any:
    return module.__dict__.get("_diffusers_hook")


def attach(module: torch.nn.Module, hook: Hook, name: str | None = None) -> Hook:
    """Put `hook` on `module` under its name (or `name`); returns it."""
    from diffusers.hooks import HookRegistry

    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name or hook.name)
    return hook


def detach(module: torch.nn.Module, name: str) -> None:
    """Take the named hook off `module` (no-op when absent); an emptied registry goes with it."""
    registry = _registry(module)
    if registry is None:
        return
    registry.remove_hook(name, recurse=False)
    if not registry._hook_order:
        del module.__dict__["_diffusers_hook"]
        _restore_forward(module)


def find(module: torch.nn.Module, name: str) -> Any:
    """The hook of that name on `module` itself, or None."""
    registry = _registry(module)
    return registry.get_hook(name) if registry is not None else None


def attached(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """(name, hook) of the hooks on `module` itself (not its children), accelerate's chain unpacked."""
    out: list[tuple[str, Any]] = []
    hook = module.__dict__.get("_hf_hook")
    if hook is not None:
        out.extend((ACCELERATE, h) for h in getattr(hook, "hooks", (hook,)))
    registry = _registry(module)
    if registry is not None:
        out.extend((name, registry.hooks[name]) for name in registry._hook_order)
    return out


def onload_device(hook: Any) -> torch.device | None:
    """The device a weight-moving hook brings weights to (accelerate's and ours: `execution_device`;
    diffusers' group offload: its group's `onload_device`), None for a hook that moves nothing."""
    device = getattr(hook, "execution_device", None)
    if device is None:
        device = getattr(getattr(hook, "group", None), "onload_device", None)
    return torch.device(device) if device is not None else None


def hooks_named(module: torch.nn.Module, name: str) -> Iterator[tuple[torch.nn.Module, Any]]:
    """(submodule, hook) for every hook of that name under `module` (accelerate's chains unpacked)."""
    for sub in module.modules():
        for found, hook in attached(sub):
            if found == name:
                yield sub, hook


def listing(module: torch.nn.Module) -> list[tuple[str, str]]:
    """(submodule path, hook name) of every hook under `module`, in module order."""
    return [(path, name) for path, sub in module.named_modules() for name, _hook in attached(sub)]


def inventory(module: torch.nn.Module) -> dict[str, int]:
    """Counts under `module`: per hook name, plus `forward_overrides` (instance `forward`s left behind).

    `accelerate` counts modules with an accelerate hook, `sequential_hooks` those whose hook is a
    chain; `diffusers` counts every registry hook. Tests use it to see that configuring twice
    does not stack hooks and that removal leaves nothing.
    """
    counts = {ACCELERATE: 0, "diffusers": 0, "sequential_hooks": 0, "forward_overrides": 0}
    for sub in module.modules():
        hook = sub.__dict__.get("_hf_hook")
        if hook is not None:
            counts[ACCELERATE] += 1
            counts["sequential_hooks"] += type(hook).__name__ == "SequentialHook"
        registry = _registry(sub)
        if registry is not None:
            counts["diffusers"] += len(registry._hook_order)
            for name in registry._hook_order:
                counts[name] = counts.get(name, 0) + 1
        counts["forward_overrides"] += "forward" in sub.__dict__
    return counts


def strip(module: torch.nn.Module, keep: Collection[str] = ()) -> None:
    """Remove every hook under `module` (ours, diffusers', accelerate's) and restore the original methods;
    the hooks named in `keep` (an offload mode passes `LASTING`) are put back on the clean module.

    Tolerates half-installed hooks (an install that failed part way). Weights are not touched: the
    hooks' owners (offload modes, disk streaming) put their tensors back themselves.
    """
    from accelerate.hooks import remove_hook_from_module

    for sub in module.modules():
        registry = _registry(sub)
        kept: list[tuple[str, Any]] = []
        if registry is not None:
            kept = [(name, registry.hooks[name]) for name in registry._hook_order if name in keep]
            for name in list(reversed(registry._hook_order)):
                registry.remove_hook(name, recurse=False)
            del sub.__dict__["_diffusers_hook"]
        if "_hf_hook" in sub.__dict__ or "_old_forward" in sub.__dict__:
            try:
                remove_hook_from_module(sub, recurse=False)
            except (AttributeError, KeyError):  # a hook whose install did not finish
                sub.__dict__.pop("_hf_hook", None)
                old = sub.__dict__.pop("_old_forward", None)
                if old is not None:
                    sub.forward = old
        _restore_forward(sub)
        for name, hook in kept:  # innermost again, on the class's own forward
            attach(sub, hook, name)


def _restore_forward(module: torch.nn.Module) -> None:
    """Hook removal leaves `forward` as an instance attribute; drop it so the class method is used again."""
    bound = module.__dict__.get("forward")
    if bound is not None and getattr(bound, "__func__", None) is type(module).forward:
        del module.__dict__["forward"]
