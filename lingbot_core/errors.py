"""The error types of refused inputs and of loading, in a leaf module every layer may import.

`RefusedInput`: an input this pack refuses (a size, an option, a file): the user fixes it by changing
what they passed, and a command exits 2 for it. `is_refused_input` tells such an error from a
`ValueError` some library raised while running (torch.distributed's "default process group has not
been initialized", a tokenizer's, numpy's...): that one is a failure of the run, never a bad input.
`CheckpointError`: a checkpoint (a folder, or a single weights file) that cannot be loaded; the
message names the file and the fix. `WeightsError`: weights that cannot be used as asked (a format,
a tensor, a quantization mode); a `CheckpointError`, so callers catching that see both.
`quoted` is how a refused input value is shown in a message; `surrogate_problem` finds the lone
UTF-16 surrogates that no UTF-8 encoder (tokenizer, file system, metadata writer) accepts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_SURROGATE = re.compile("[\ud800-\udfff]")


class RefusedInput(ValueError):
    """An input this pack refuses before (or instead of) running; the message says what to change.
    A `ValueError`, so callers that catch those see it too."""


#: the folders of this pack's own code (its `raise ValueError(...)` statements are refused inputs)
_OWN_CODE = tuple({str(root / name) + os.sep for root in (Path(os.path.abspath(__file__)).parents[1],
                                                           Path(__file__).resolve().parents[1])
                   for name in ("lingbot_core", "nodes")})


def is_refused_input(exc: BaseException) -> bool:
    """True for a refused input: a `RefusedInput`, or a plain `ValueError` raised by this pack's own
    code (its older refusals are plain `ValueError`s). A `ValueError` whose innermost frame is in a
    library (torch, the standard library, ...) is a failure while running, not a refused input."""
    if isinstance(exc, RefusedInput):
        return True
    if not isinstance(exc, ValueError):
        return False
    tb = exc.__traceback__
    if tb is None:  # never raised (built to be returned): the code that made it decides; ours makes ours
        return True
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename
    return os.path.abspath(where).startswith(_OWN_CODE) or os.path.realpath(where).startswith(_OWN_CODE)


class CheckpointError(RefusedInput):
    """A checkpoint that cannot be loaded; the message names the file and the fix."""


class WeightsError(CheckpointError):
    """Weights that cannot be used as asked; the message names the file or tensor and the fix."""


def quoted(value: object) -> str:
    """A refused input value as a message shows it: the first 40 characters of a plain value's repr, else
    the type's name (never a huge or odd object's repr)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return repr(value)[:40]
    return type(value).__name__


def surrogate_problem(text: object, what: str) -> str | None:
    """One line when `text` (a prompt, caption, filename prefix) holds a lone UTF-16 surrogate (U+D800 to
    U+DFFF, e.g. from a JSON "\\ud83d" escape missing its pair): it passes as a Python string but fails
    late in the tokenizer or in a file name. None when `text` is clean (or not text)."""
    if not isinstance(text, str):
        return None
    found = _SURROGATE.search(text)
    if found is None:
        return None
    return (f"{what} holds a lone UTF-16 surrogate (U+{ord(found.group()):04X} at character {found.start()}), which "
            "is not text any encoder accepts; remove it (a broken emoji or an unpaired \\u escape, often from a "
            "copy-paste)")
