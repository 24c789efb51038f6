"""Cancellation points inside model work.

A node graph must be cancellable mid-stage: a denoise step, a text-encoder forward or a VAE decode
can each take many seconds. Callers install a checker (a function that raises to cancel) with
`interrupt_checker(fn)`; every stage then calls it on entry and before each transformer block,
encoder layer and VAE block, through forward pre-hooks that live only for the stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

Checker = Callable[[], None]
_CHECKER: ContextVar[Checker | None] = ContextVar("lingbot_interrupt_checker", default=None)


@contextmanager
def interrupt_checker(check: Checker | None) -> Iterator[None]:
    token = _CHECKER.set(check)
    try:
        yield
    finally:
        _CHECKER.reset(token)


def check_interrupt() -> None:
    check = _CHECKER.get()
    if check is not None:
        check()


def _work_units(name: str, module: torch.nn.Module) -> list[torch.nn.Module]:
    if name in ("transformer", "refiner"):
        return list(getattr(module, "blocks", []))
    if name == "text_encoder":
        inner = getattr(module, "model", None)
        units = list(getattr(getattr(inner, "language_model", None), "layers", []))
        return units + list(getattr(getattr(inner, "visual", None), "blocks", []))
    if name == "vae":
        units = []
        for part in ("encoder", "decoder"):
            sub = getattr(module, part, None)
            for blocks in ("down_blocks", "up_blocks"):
                units += list(getattr(sub, blocks, []))
            if getattr(sub, "mid_block", None) is not None:
                units.append(sub.mid_block)
        return units
    return []


@contextmanager
def checkpoints(components: dict[str, object]) -> Iterator[None]:
    """Install cancellation points on the components' blocks for the duration of a stage."""
    check = _CHECKER.get()
    if check is None:
        yield
        return
    check()
    handles = [unit.register_forward_pre_hook(lambda _m, _a: check())
               for name, module in components.items() if isinstance(module, torch.nn.Module)
               for unit in _work_units(name, module)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
