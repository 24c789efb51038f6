"""One exit-code policy for both console commands (`lingbot-run` and `python -m lingbot_core`).

    0    the run finished
    1    a failure while running (out of memory, a bug, an unexpected library error)
    2    bad input: arguments, a workflow file, an override, a missing/empty/truncated checkpoint,
         an unusable output folder -- anything the user fixes by changing what they passed
    130  interrupted (Ctrl-C), as a shell reports SIGINT

Our own code refuses bad input (sizes, prompts, checkpoints; see `stages` and `checkpoint`) with
`errors.RefusedInput` or a plain `ValueError` of its own (`errors.is_refused_input`: a `ValueError`
a library raised while running is a failure, exit 1), and the workflow engine raises `WorkflowError`
for a bad graph, so the code follows the exception. A node that fails while running is unwrapped to
the exception it raised.
"""

from __future__ import annotations

from .errors import is_refused_input

OK = 0
FAILED = 1
BAD_INPUT = 2
INTERRUPTED = 130

# OSError subclasses that mean "the path you gave is wrong", not "the disk failed".
_BAD_PATHS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError)


def root_cause(exc: BaseException) -> BaseException:
    """The exception a failing node raised (the engine chains it as ``__cause__``)."""
    from .workflow.errors import NodeExecutionError

    while isinstance(exc, NodeExecutionError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def exit_code(exc: BaseException) -> int:
    from .workflow.errors import NodeExecutionError, RunInterrupted, WorkflowError, is_interrupt

    if isinstance(exc, (KeyboardInterrupt, RunInterrupted)) or is_interrupt(exc):
        return INTERRUPTED
    cause = root_cause(exc)
    if isinstance(cause, KeyboardInterrupt) or is_interrupt(cause):
        return INTERRUPTED
    if isinstance(cause, _BAD_PATHS) or is_refused_input(cause):
        return BAD_INPUT
    if isinstance(cause, WorkflowError) and not isinstance(cause, NodeExecutionError):
        return BAD_INPUT
    return FAILED


def one_line(text: object) -> str:
    """Collapse whitespace so a multi-line message stays one line on the terminal."""
    return " ".join(str(text).split())
