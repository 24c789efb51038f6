"""What a running node can ask of the engine: its own id, a progress sink, an interrupt check.

The engine sets a context variable around every node call, so node code (or the small adapter
in ``nodes/`` that stands in for ComfyUI's ProgressBar) reports progress without the engine
being passed through every function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from .errors import Interrupted

ProgressCallback = Callable[[str, float, "float | None"], None]
"""Called as ``progress(node_id, value, total)``; ``total`` may be None when unknown."""

InterruptCheck = Callable[[], "bool | None"]
"""Returns True (or raises :class:`Interrupted`) when the run should stop."""


@dataclass(frozen=True)
class NodeContext:
    node_id: str
    class_type: str
    progress: ProgressCallback | None = None
    interrupt_check: InterruptCheck | None = None


_CURRENT: ContextVar[NodeContext | None] = ContextVar("lingbot_workflow_node", default=None)


def current_node_id() -> str | None:
    """The id of the node being executed by the engine, or None outside a run."""
    ctx = _CURRENT.get()
    return ctx.node_id if ctx is not None else None


def current_context() -> NodeContext | None:
    return _CURRENT.get()


def check_interrupt() -> None:
    """Raise :class:`Interrupted` if the run's interrupt check says stop; a no-op outside a run."""
    ctx = _CURRENT.get()
    if ctx is not None and ctx.interrupt_check is not None and ctx.interrupt_check():
        raise Interrupted(f"interrupted in node {ctx.node_id}")


def report_progress(value: float, total: float | None = None) -> None:
    """Send progress for the current node, then check for an interrupt.

    Like ComfyUI's progress hook, every update is an interrupt point, so a long loop that
    reports progress can be cancelled.
    """
    ctx = _CURRENT.get()
    if ctx is None:
        return
    if ctx.progress is not None:
        ctx.progress(ctx.node_id, value, total)
    check_interrupt()


@contextmanager
def node_context(ctx: NodeContext) -> Iterator[None]:
    token = _CURRENT.set(ctx)
    try:
        yield
    finally:
        _CURRENT.reset(token)
