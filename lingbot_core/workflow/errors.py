"""Exceptions of the workflow engine.

Every error names the node (id and class type) it is about, because the person reading it has a
graph open and needs to find the node, not a stack frame.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MESSAGE_LIMIT = 1000  # characters of one issue or failure message
VALUE_LIMIT = 120  # characters of a value echoed inside a message
ISSUE_LIMIT = 50  # issues listed in one WorkflowValidationError (all are kept in ``issues``)

_repr = reprlib.Repr()
_repr.maxstring = VALUE_LIMIT
_repr.maxother = VALUE_LIMIT
_repr.maxlong = 40
_repr.maxlevel = 3
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 6


def brief(value: Any, limit: int = VALUE_LIMIT) -> str:
    """A short, safe ``repr`` for messages: a 200 KB field or a 5,000-digit integer is elided.

    ``repr`` of an int past Python's digit limit raises, and a deeply nested value can exceed the
    recursion limit; neither may turn an error message into a second error.
    """
    try:
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
            return f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
        text = _repr.repr(value)
    except (ValueError, RecursionError, TypeError, OverflowError):
        text = f"<{type(value).__name__}>"
    except Exception:  # a user object whose __repr__ raises
        text = f"<{type(value).__name__}>"
    return clip(text, limit)


def clip(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


class WorkflowError(Exception):
    """Base class: anything wrong with a workflow file, a prompt or a run.

    ``internal`` is True only for the safety net that turns an unexpected failure while reading
    a malformed workflow into this type (the fuzz tests require that it never fires).
    """

    internal = False


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
        prefix = clip(" ".join(where), 300)
        message = clip(self.message)
        return f"{prefix}: {message}" if prefix else message


class WorkflowValidationError(WorkflowError):
    """The workflow cannot run; ``issues`` lists every problem found, not just the first."""

    def __init__(self, issues: Iterable[ValidationIssue], *, source: str | None = None) -> None:
        self.issues: list[ValidationIssue] = list(issues)
        self.source = source
        head = f"{clip(source, 500)}: " if source else ""
        n = len(self.issues)
        lines = [f"{head}workflow is invalid ({n} problem{'s' if n != 1 else ''}):"]
        lines += [f"  - {issue}" for issue in self.issues[:ISSUE_LIMIT]]
        if n > ISSUE_LIMIT:
            lines.append(f"  ... and {n - ISSUE_LIMIT} more")
        super().__init__("\n".join(lines))


class Interrupted(Exception):  # noqa: N818 - the name users raise; mirrors ComfyUI's interrupt exception
    """Raised by a node (or by :func:`check_interrupt`) to stop the run cleanly."""


class NodeExecutionError(WorkflowError):
    """A node raised while running; the original exception is chained as ``__cause__``."""

    def __init__(self, node_id: str, class_type: str, message: str, *, executed: list[str] | None = None) -> None:
        self.node_id = node_id
        self.class_type = class_type
        self.executed = list(executed or [])
        super().__init__(f"node {node_id} ({class_type}) failed: {clip(message)}")


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
