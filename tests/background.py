"""Child processes a test module starts up front, so that they overlap with its other tests.

The suite runs in one process on one thread (`conftest.py`): while a test waits for a child Python (which
spends seconds importing torch) the second core idles. A module that checks commands in processes of their
own starts those children together in a module fixture; its other tests run meanwhile, and each test that
checks a child waits there for that child's result and asserts on it as before. Only the children of tests
that were collected into this run are started (a `-k` run starts none it does not need), and a child that
no test waited for is killed when the module ends.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import pytest


def selected(request: pytest.FixtureRequest, *test_names: str) -> bool:
    """Whether any of the module's tests named `test_names` (parametrized or not) is in this run."""
    return any(getattr(item, "originalname", item.name) in test_names and item.module is request.module
               for item in request.session.items)


class Child:
    """A command started now, its output collected in files (a pipe nobody reads would stall it)."""

    def __init__(self, args: list[str], **popen: Any) -> None:
        self._out = tempfile.TemporaryFile(mode="w+")
        self._err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(args, stdout=self._out, stderr=self._err, text=True, **popen)
        self._done: subprocess.CompletedProcess | None = None

    def result(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """Wait for the child; what `subprocess.run(..., capture_output=True, text=True)` returns."""
        if self._done is None:
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                raise
            self._out.seek(0)
            self._err.seek(0)
            self._done = subprocess.CompletedProcess(self.proc.args, code, self._out.read(), self._err.read())
            self._close()
        return self._done

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        self._out.close()
        self._err.close()


class Task:
    """`fn()` run on a thread now (a conversation with a child: read its output, signal it); `result()`
    waits and returns its value or raises its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as err:  # handed to the test that waits
            self._error = err

    def result(self, timeout: float = 300) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the background task did not finish in {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value
