"""Finding and removing the offload hooks accelerate and diffusers attach to modules."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

GROUP_HOOK_NAMES = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")


def _restore_forward(module: torch.nn.Module) -> None:
    """Hook removal leaves `forward` as an instance attribute; drop it so the class method is used again."""
    bound = module.__dict__.get("forward")
    if bound is not None and getattr(bound, "__func__", None) is type(module).forward:
        del module.__dict__["forward"]


def strip_hooks(module: torch.nn.Module) -> None:
    """Remove every accelerate and diffusers hook under `module` and restore the original methods.

    Tolerates half-installed hooks (an install that failed part way). Weights are not checked
    here: `Homes.restore()` puts the captured tensors back afterwards.
    """
    from accelerate.hooks import remove_hook_from_module

    for sub in module.modules():
        if "_hf_hook" in sub.__dict__ or "_old_forward" in sub.__dict__:
            try:
                remove_hook_from_module(sub, recurse=False)
            except (AttributeError, KeyError):  # a hook whose install did not finish
                sub.__dict__.pop("_hf_hook", None)
                old = sub.__dict__.pop("_old_forward", None)
                if old is not None:
                    sub.forward = old
        registry = sub.__dict__.get("_diffusers_hook")
        if registry is not None:
            for name in list(reversed(registry._hook_order)):
                registry.remove_hook(name, recurse=False)
            del sub.__dict__["_diffusers_hook"]
        _restore_forward(sub)


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


def accelerate_hooks(module: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, Any]]:
    """(module, hook) for every accelerate hook under `module`, SequentialHook chains unpacked."""
    for sub in module.modules():
        hook = sub.__dict__.get("_hf_hook")
        if hook is not None:
            for h in getattr(hook, "hooks", (hook,)):
                yield sub, h


def group_hooks(module: torch.nn.Module) -> Iterator[Any]:
    """Every diffusers group-offloading hook under `module`."""
    for sub in module.modules():
        registry = sub.__dict__.get("_diffusers_hook")
        hook = registry.get_hook("group_offloading") if registry is not None else None
        if hook is not None:
            yield hook


def component_device(module: Any) -> torch.device | None:
    """Where a component computes, read from its offload hook when it has one, else from its weights."""
    if not isinstance(module, torch.nn.Module):
        return None
    disk = module.__dict__.get("_lingbot_disk")  # streamed from its file (weights/disk.py)
    if disk is not None:
        return disk.device
    for _sub, h in accelerate_hooks(module):
        if getattr(h, "execution_device", None) is not None:
            return torch.device(h.execution_device)
    for hook in group_hooks(module):
        return torch.device(hook.group.onload_device)
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return None
