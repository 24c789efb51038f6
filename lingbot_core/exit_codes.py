"""One exit-code policy for both console commands (`lingbot-run` and `python -m lingbot_core`).

    0    the run finished
    1    a failure while running (out of memory, a bug, an unexpected library error)
    2    bad input: arguments, a workflow file, an override, a missing/empty/truncated checkpoint,
         an unusable output folder -- anything the user fixes by changing what they passed
    130  interrupted (Ctrl-C), as a shell reports SIGINT
    143  stopped by SIGTERM (a container stop, a scheduler, `kill`): handled as Ctrl-C is, the code a
         shell reports for SIGTERM

Our own code refuses bad input (sizes, prompts, checkpoints; see `stages` and `checkpoints/`) with
`errors.RefusedInput` or a plain `ValueError` of its own (`errors.is_refused_input`: a `ValueError`
a library raised while running is a failure, exit 1), and the workflow engine raises `WorkflowError`
for a bad graph, so the code follows the exception. A node that fails while running is unwrapped to
the exception it raised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .errors import is_refused_input

OK = 0
FAILED = 1
BAD_INPUT = 2
INTERRUPTED = 130
TERMINATED = 143

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


class _Terms:
    """What `sigterm_interrupts` heard: the signal numbers received while it was installed."""

    received: list[int] = []
    depth = 0


@contextmanager
def sigterm_interrupts() -> Iterator[list[int]]:
    """SIGTERM interrupts like Ctrl-C (a KeyboardInterrupt where the run is): by default Python dies at
    once with no message, no clean-up of a partial file and exit code 143. Yields the list of signal
    numbers received (empty when none); the command then says "interrupted" and exits `TERMINATED`.
    Nested uses share the outer one's handler. Outside the main thread it does nothing."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    if _Terms.depth:
        _Terms.depth += 1
        try:
            yield _Terms.received
        finally:
            _Terms.depth -= 1
        return

    def interrupt(signum, frame):
        _Terms.received.append(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    _Terms.received = []
    _Terms.depth = 1
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield _Terms.received
    finally:
        signal.signal(signal.SIGTERM, previous)
        _Terms.depth = 0


def interrupted_code(received: list[int]) -> int:
    """The exit code of an interrupted run: `TERMINATED` after SIGTERM, else `INTERRUPTED` (Ctrl-C)."""
    return TERMINATED if received else INTERRUPTED
