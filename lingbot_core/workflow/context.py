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

NodeWatcher = Callable[["NodeContext"], None]
"""Called with the node's context each time the engine enters node code (see :func:`watch_nodes`)."""


@dataclass(frozen=True)
class NodeContext:
    node_id: str
    class_type: str
    progress: ProgressCallback | None = None
    interrupt_check: InterruptCheck | None = None


_CURRENT: ContextVar[NodeContext | None] = ContextVar("lingbot_workflow_node", default=None)
_WATCHER: ContextVar[NodeWatcher | None] = ContextVar("lingbot_workflow_watcher", default=None)


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
def watch_nodes(watcher: NodeWatcher | None) -> Iterator[None]:
    """Tell `watcher` whenever a node's code starts, for the runs inside this block.

    A front end (the console command) uses it to label progress with the node that is working,
    for nodes that never report steps too (text encode, VAE decode). A node with lazy inputs is
    entered more than once (``check_lazy_status``, then its function); watchers see each entry.
    """
    token = _WATCHER.set(watcher)
    try:
        yield
    finally:
        _WATCHER.reset(token)


@contextmanager
def node_context(ctx: NodeContext) -> Iterator[None]:
    watcher = _WATCHER.get()
    if watcher is not None:
        watcher(ctx)
    token = _CURRENT.set(ctx)
    try:
        yield
    finally:
        _CURRENT.reset(token)
