"""`compile="blocks"` in tests without inductor's build time: the blocks are compiled through dynamo's
eager backend, and each compiled block call is counted."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch


@contextmanager
def counted_eager_blocks() -> Iterator[list[int]]:
    """While open, `compile="blocks"` (the `("inductor", True)` entry) runs dynamo-traced blocks on the eager
    backend; yields a one-item list counting the compiled block calls. Skips where compiling cannot run."""
    from lingbot_core.models import compile as regional
    from lingbot_core.models.compile import compile_problem
    from lingbot_core.models.transformer import JointBlock

    if compile_problem("cpu") is not None:
        pytest.skip(compile_problem("cpu"))
    calls = [0]
    inner = torch.compile(JointBlock.compute, backend="eager", dynamic=True)

    def counted(*args):
        calls[0] += 1
        return inner(*args)

    torch._dynamo.reset()
    regional._COMPILED.clear()
    regional._COMPILED[("inductor", True)] = counted
    try:
        yield calls
    finally:
        regional._COMPILED.clear()
