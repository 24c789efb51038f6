"""The error types of loading, in a leaf module every layer may import.

`CheckpointError`: a checkpoint (a folder, or a single weights file) that cannot be loaded; the
message names the file and the fix. `WeightsError`: weights that cannot be used as asked (a format,
a tensor, a quantization mode); a `CheckpointError`, so callers catching that see both.
They are re-exported where they used to live (`checkpoint`, `weights.checks`, `weights.sources`).
`quoted` is how a refused input value is shown in a message.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the fix."""


class WeightsError(CheckpointError):
    """Weights that cannot be used as asked; the message names the file or tensor and the fix."""


def quoted(value: object) -> str:
    """A refused input value as a message shows it: the first 40 characters of a plain value's repr, else
    the type's name (never a huge or odd object's repr)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return repr(value)[:40]
    return type(value).__name__
