"""Headless workflow engine with ComfyUI's semantics, generic over V1 node classes.

Load a UI or API workflow with :func:`load_workflow`, run it with :class:`Engine` (which keeps a
signature cache between runs), or do both, with ``NODE.INPUT=VALUE`` overrides, through
:func:`run_workflow_file`. Nothing here imports ComfyUI or knows our particular nodes.
"""

from .context import (
    InterruptCheck,
    NodeContext,
    ProgressCallback,
    check_interrupt,
    current_context,
    current_node_id,
    report_progress,
)
from .convert import ui_to_api
from .engine import Engine, RunResult
from .errors import (
    Interrupted,
    NodeExecutionError,
    RunInterrupted,
    ValidationIssue,
    WorkflowError,
    WorkflowValidationError,
)
from .graph import ApiPrompt, check_structure, detect_format, load_workflow
from .runner import apply_overrides, find_node, parse_override, run_workflow_file

__all__ = [
    "ApiPrompt",
    "Engine",
    "InterruptCheck",
    "Interrupted",
    "NodeContext",
    "NodeExecutionError",
    "ProgressCallback",
    "RunInterrupted",
    "RunResult",
    "ValidationIssue",
    "WorkflowError",
    "WorkflowValidationError",
    "apply_overrides",
    "check_interrupt",
    "check_structure",
    "current_context",
    "current_node_id",
    "detect_format",
    "find_node",
    "load_workflow",
    "parse_override",
    "report_progress",
    "run_workflow_file",
    "ui_to_api",
]
