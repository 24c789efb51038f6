"""What a view asks of placement: the offload mode, its options, and the checks that refuse bad asks.

A leaf: it imports nothing of ours, so the handle, the modes and the door can all depend on it.
Adding a mode means a row in `OPTIONS` here and one file in `modes/`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

MODES = ("none", "model", "sequential", "group", "auto")
OFFLOAD_TO = ("ram", "disk")
MODULE_COMPONENTS = ("text_encoder", "transformer", "refiner", "vae")
"""Components that are nn.Modules placement manages (the processor and scheduler are not placed)."""

OPTIONS: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "model": frozenset(),
    "sequential": frozenset(),
    "group": frozenset({"use_stream", "low_cpu_mem_usage", "num_blocks_per_group", "record_stream"}),
    # auto: the request it plans for, and (tests, simulations) the accelerator and host memory to plan within
    "auto": frozenset({"height", "width", "num_frames", "cfg", "refine", "release_base", "vae_tiling",
                       "budget_bytes", "host_budget_bytes"}),
}
CPU = torch.device("cpu")


@dataclass(frozen=True)
class OffloadSettings:
    """How a view wants components placed while its stages run.

    `offload_to` names the CPU-side home of offloaded weights: `ram` (a copy in host memory) or
    `disk` (the memory-mapped checkpoint itself; the weights loader provides such tensors). Modes
    never copy a home they were given: they move the stored tensors (whatever their dtype or
    subclass) to the device and rebind them to their home afterwards.
    """

    mode: str = "none"
    options: tuple[tuple[str, Any], ...] = ()
    offload_to: str = "ram"

    @classmethod
    def make(cls, mode: str, offload_to: str = "ram", **options: Any) -> OffloadSettings:
        return cls(mode, tuple(sorted(options.items())), offload_to)

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)


def same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` and `cuda:0` are the same device; every CPU is the CPU."""
    if a.type != b.type:
        return False
    return a.type == "cpu" or (a.index or 0) == (b.index or 0)


def _is_sharded(module: torch.nn.Module) -> bool:
    if any(type(m).__name__.startswith("FSDP") or type(m).__name__ == "FullyShardedDataParallel"
           for m in module.modules()):
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        return False
    return any(isinstance(p, DTensor) for p in module.parameters())


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_guards(settings: OffloadSettings, device: torch.device, loaded: Mapping[str, Any]) -> None:
    """Refuse settings that cannot work, before anything is touched."""
    mode = settings.mode
    if mode not in MODES:
        raise ValueError(f"unknown offload mode {mode!r}; choose one of {', '.join(MODES)}")
    if settings.offload_to not in OFFLOAD_TO:
        raise ValueError(f"offload_to must be one of {', '.join(OFFLOAD_TO)}, got {settings.offload_to!r}")
    unknown = set(dict(settings.options)) - OPTIONS[mode]
    if unknown:
        allowed = ", ".join(sorted(OPTIONS[mode])) or "none"
        raise ValueError(f"offload mode {mode!r} does not take {', '.join(sorted(unknown))} (options: {allowed})")
    if mode == "auto":
        for name in ("budget_bytes", "host_budget_bytes"):
            if settings.option(name) is not None:
                _positive_int(name, settings.option(name))
        return
    if mode == "none":
        return
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"offload mode {mode!r} cannot run under a multi-process group (FSDP, CFG- or "
                         "context-parallel): each rank holds a shard; use offload 'none' there")
    for name, module in loaded.items():
        if isinstance(module, torch.nn.Module) and _is_sharded(module):
            raise ValueError(f"offload mode {mode!r} cannot manage the sharded component {name!r}; "
                             "use offload 'none' with sharded models")
    if mode == "group":
        use_stream = settings.option("use_stream", device.type == "cuda")
        if use_stream and device.type == "cpu":
            raise ValueError("group offload with use_stream needs an accelerator with streams; on CPU pass "
                             "use_stream=False")
        if settings.option("record_stream", False) and not use_stream:
            raise ValueError("record_stream only applies with use_stream=True")
        blocks = settings.option("num_blocks_per_group", 1)
        _positive_int("num_blocks_per_group", blocks)
        if use_stream and blocks != 1:
            # diffusers' stream prefetch works one block at a time and silently resets the group size.
            raise ValueError(f"num_blocks_per_group={blocks} cannot be combined with use_stream: stream "
                             "prefetching moves one block at a time; drop num_blocks_per_group or pass "
                             "use_stream=False")
        try:
            import diffusers
            from diffusers.hooks import apply_group_offloading  # noqa: F401
        except ImportError as err:  # pragma: no cover - diffusers without hooks
            raise ValueError(f"group offload needs diffusers' group offloading ({err})") from err
        version = tuple(int(x) for x in diffusers.__version__.split(".")[:2] if x.isdigit())
        if device.type == "cpu" and version < (0, 42):
            raise ValueError(f"group offload on CPU needs diffusers >= 0.42 (found {diffusers.__version__})")
