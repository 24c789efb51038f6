"""Placement of components while stages run: the one door every stage enters.

`stage(handle, *components)` is both the hook-reset helper and the execution-device helper: on
entry it (re)loads what was released, brings the placement to the clean state of the view's mode,
acquires the components the stage names and yields the handle's execution device; on exit
(success, exception or interrupt) it restores the clean state. Nothing here infers the device from
where a parameter happens to sit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .handle import OffloadSettings, PipelineHandle

MODES = ("none",)


def validate_settings(handle: PipelineHandle, settings: OffloadSettings) -> None:
    if settings.mode not in MODES:
        raise ValueError(f"unknown offload mode {settings.mode!r}; choose one of {', '.join(MODES)}")


def _place(handle: PipelineHandle, module: object) -> None:
    if isinstance(module, torch.nn.Module):
        module.to(handle.device)


@contextmanager
def stage(handle: PipelineHandle, *components: str) -> Iterator[torch.device]:
    """Acquire `components` for one stage and yield the execution device."""
    with handle.shared.lock:
        for name in components:
            _place(handle, handle.component(name))
        yield handle.device
