"""The offload modes: one file each in this folder, and the registry everything else reads.

A mode is a `Mode` subclass that sets `name`, in its own module here. Importing this package
imports every module in the folder and registers each such class; nothing else lists modes. From
the registry come (kept in step by `register` and `unregister`, in place, so every importer sees a
mode registered later):

- `MODE_CLASSES`: name -> class (the door builds the installed mode from it);
- `MODE_ORDER`: the concrete modes, fastest first (`Mode.speed`): what `auto` tries in turn and what
  the out-of-memory fallback walks;
- `MODES`: what a view may ask for: `MODE_ORDER` plus `auto`;
- `OPTIONS`: mode -> the options it takes (`Mode.options`; `auto`'s are `AUTO_OPTIONS`);
- `disk_unit(mode)`: what disk offload reads at once under the mode (`Mode.disk_unit`);
- the Offload node's choices and tooltip (`Mode.summary`).

So a new mode is one file: a `Mode` subclass with `name`, `speed`, `options`, `disk_unit`,
`summary`, its hooks (through `lingbot_core.hooks`) and its `estimate`. `register` adds a class at
run time (tests), `unregister` takes it out.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

import torch

from ..settings import AUTO, AUTO_OPTIONS, OFFLOAD_TO, OffloadSettings
from .base import Mode

MODE_CLASSES: dict[str, type[Mode]] = {}
MODE_ORDER: list[str] = []
MODES: list[str] = [AUTO]
OPTIONS: dict[str, frozenset[str]] = {AUTO: AUTO_OPTIONS}


def _derive() -> None:
    """Refresh the lists derived from `MODE_CLASSES` in place (importers hold these very objects)."""
    MODE_ORDER[:] = sorted(MODE_CLASSES, key=lambda n: MODE_CLASSES[n].speed)
    MODES[:] = [*MODE_ORDER, AUTO]
    OPTIONS.clear()
    OPTIONS.update({n: MODE_CLASSES[n].options for n in MODE_ORDER}, **{AUTO: AUTO_OPTIONS})


def register(cls: type[Mode]) -> type[Mode]:
    """Add a mode class to the registry (a class decorator as well)."""
    if not cls.name or cls.name == AUTO:
        raise ValueError(f"{cls.__name__}: a mode needs a name other than {AUTO!r}")
    if MODE_CLASSES.get(cls.name, cls) is not cls:
        raise ValueError(f"offload mode {cls.name!r} is registered already ({MODE_CLASSES[cls.name].__name__})")
    MODE_CLASSES[cls.name] = cls
    _derive()
    return cls


def unregister(name: str) -> None:
    MODE_CLASSES.pop(name, None)
    _derive()


def disk_unit(mode: str) -> str | None:
    """What disk streaming reads at once under `mode`: "model", "block", "layer", or None (no streaming)."""
    return MODE_CLASSES[mode].disk_unit


def check_guards(settings: OffloadSettings, device: torch.device, loaded: Mapping[str, Any],
                 layout: Any = None) -> None:
    """Refuse settings that cannot work, before anything is touched: the generic checks, then the mode's own.
    `layout`: the view's parallel layout (`distributed.stage.active_layout`), None for one process."""
    mode = settings.mode
    if mode not in MODES:
        raise ValueError(f"unknown offload mode {mode!r}; choose one of {', '.join(MODES)}")
    if settings.offload_to not in OFFLOAD_TO:
        raise ValueError(f"offload_to must be one of {', '.join(OFFLOAD_TO)}, got {settings.offload_to!r}")
    unknown = set(dict(settings.options)) - OPTIONS[mode]
    if unknown:
        allowed = ", ".join(sorted(OPTIONS[mode])) or "none"
        raise ValueError(f"offload mode {mode!r} does not take {', '.join(sorted(unknown))} (options: {allowed})")
    if mode == AUTO:
        for name in ("budget_bytes", "host_budget_bytes"):
            if settings.option(name) is not None:
                _positive_int(name, settings.option(name))
        return
    MODE_CLASSES[mode].check(settings, device, loaded, layout)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, Mode) and value.name and value.__module__ == module.__name__:
                register(value)


_discover()

__all__ = ["AUTO", "MODES", "MODE_CLASSES", "MODE_ORDER", "OPTIONS", "Mode", "check_guards", "disk_unit", "register",
           "unregister"]
