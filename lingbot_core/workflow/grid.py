"""An INT widget's minimum that also carries a value grid (sizes in steps of 16, frame counts 4n+1).

Why a minimum: ComfyUI (0.3.x) has one check per input that names only that input, the range
check ``value < spec["min"]`` / ``value > spec["max"]``; a node's own ``validate_inputs`` message is
attached to *every* input the validator takes, so one validator over width, height and frames turns
one bad width into three messages. A :class:`GridMin` is the plain int everywhere else (JSON, the
editor, which already rounds its widget to ``min + k * step``), but an off-grid value compares as
below it, so the host's own range check refuses the value at validation time, with one message on
that input. The headless engine asks :meth:`GridMin.problem` for the same rule in its own words.
Nodes still check sizes when they run, for values that arrive through links.
"""

from __future__ import annotations

from typing import Any


class GridMin(int):
    """The minimum ``low`` of an INT input whose values are ``low, low + step, low + 2*step, ...``.

    ``value < GridMin(16, 16)`` is true for 100 (Python asks the subclass's ``__gt__`` first), and
    formatting it for a message (``"{}".format(...)``, as ComfyUI builds "Value 100 smaller than
    min of ...") appends the grid, so that message stays true.
    """

    step: int

    def __new__(cls, low: int, step: int) -> GridMin:
        if isinstance(low, bool) or isinstance(step, bool) or int(step) < 1:
            raise ValueError(f"a grid needs an integer minimum and a step of 1 or more, got {low!r}, {step!r}")
        self = super().__new__(cls, int(low))
        self.step = int(step)
        return self

    def __reduce__(self) -> tuple[Any, tuple[int, int]]:
        return (GridMin, (int(self), self.step))  # copies and pickles keep the grid

    def on_grid(self, value: int) -> bool:
        return (value - int(self)) % self.step == 0

    def grid_text(self) -> str:
        """The rule in words: "a multiple of 16", or "one of 1, 5, 9, ... (1 plus a multiple of 4)"."""
        low, step = int(self), self.step
        if low % step == 0:
            return f"a multiple of {step}"
        return f"one of {low}, {low + step}, {low + 2 * step}, ... ({low} plus a multiple of {step})"

    def problem(self, value: int) -> str | None:
        """None when ``value`` is at least the minimum and on the grid; else what is wrong and the
        nearest valid values."""
        low = int(self)
        if value < low:
            return f"value {value} is smaller than the minimum {low}"
        if self.on_grid(value):
            return None
        below = value - (value - low) % self.step
        return f"value {value} is not {self.grid_text()}; try {below} or {below + self.step}"

    def __gt__(self, other: object) -> bool:
        # Called for `other < self` too: an integer off the grid counts as below the minimum.
        if isinstance(other, int) and not isinstance(other, bool):
            return int(other) < int(self) or not self.on_grid(int(other))
        return int.__gt__(self, other)

    def __format__(self, spec: str) -> str:
        if spec:
            return int.__format__(int(self), spec)
        return f"{int(self)}, or not {self.grid_text()}"
