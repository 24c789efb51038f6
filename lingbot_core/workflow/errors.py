"""Exceptions of the workflow engine.

Every error names the node (id and class type) it is about, because the person reading it has a
graph open and needs to find the node, not a stack frame.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


class WorkflowError(Exception):
    """Base class: anything wrong with a workflow file, a prompt or a run."""


@dataclass(frozen=True)
class ValidationIssue:
    """One problem found before anything runs; several are reported together."""

    node_id: str | None
    class_type: str | None
    input_name: str | None
    message: str

    def __str__(self) -> str:
        where = []
        if self.node_id is not None:
            where.append(f"node {self.node_id}")
        if self.class_type:
            where.append(f"({self.class_type})")
        if self.input_name:
            where.append(f"input '{self.input_name}'")
        prefix = " ".join(where)
        return f"{prefix}: {self.message}" if prefix else self.message


class WorkflowValidationError(WorkflowError):
    """The workflow cannot run; ``issues`` lists every problem found, not just the first."""

    def __init__(self, issues: Iterable[ValidationIssue], *, source: str | None = None) -> None:
        self.issues: list[ValidationIssue] = list(issues)
        self.source = source
        head = f"{source}: " if source else ""
        n = len(self.issues)
        lines = [f"{head}workflow is invalid ({n} problem{'s' if n != 1 else ''}):"]
        lines += [f"  - {issue}" for issue in self.issues]
        super().__init__("\n".join(lines))


class Interrupted(Exception):  # noqa: N818 - the name users raise; mirrors ComfyUI's interrupt exception
    """Raised by a node (or by :func:`check_interrupt`) to stop the run cleanly."""


class NodeExecutionError(WorkflowError):
    """A node raised while running; the original exception is chained as ``__cause__``."""

    def __init__(self, node_id: str, class_type: str, message: str, *, executed: list[str] | None = None) -> None:
        self.node_id = node_id
        self.class_type = class_type
        self.executed = list(executed or [])
        super().__init__(f"node {node_id} ({class_type}) failed: {message}")


class RunInterrupted(WorkflowError):
    """The run stopped at an interrupt; nodes that finished stay cached, so a rerun resumes."""

    def __init__(self, node_id: str | None, class_type: str | None, *, executed: list[str] | None = None) -> None:
        self.node_id = node_id
        self.class_type = class_type
        self.executed = list(executed or [])
        where = f" at node {node_id} ({class_type})" if node_id is not None else ""
        super().__init__(f"run interrupted{where}")


def is_interrupt(exc: BaseException) -> bool:
    """True for our :class:`Interrupted` and for ComfyUI's ``InterruptProcessingException``.

    ComfyUI's class is matched by name so that nodes raising it work headless without importing
    ComfyUI here.
    """
    if isinstance(exc, Interrupted):
        return True
    return any(klass.__name__ == "InterruptProcessingException" for klass in type(exc).__mro__)
