"""Decoding a packed weight piece by piece into one output tensor.

A decoder (GGUF blocks, fp8 rows) works in float32 and makes several temporaries the size of what it
decodes. Over a whole [6144, 2048] linear, or a stacked [128, 768, 2048] expert tensor, those
temporaries are tens to hundreds of MB: on a CPU each pass then runs from main memory (and fresh
allocations that large fault their pages in every call), on a GPU they are a transient of 4 bytes per
value on top of the model. Decoding a fixed number of values at a time into the final tensor keeps the
float32 scratch in the CPU's cache and bounds the accelerator transient, with the same values.

Measured with `python bench/speed_dit.py --only decode` (docs/benchmarks.md): on a 2-core CPU a
[6144, 2048] Q8_0 weight decodes about 10x faster in pieces, Q4_0 and fp8 3-4x.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: values decoded per piece, by device type: 1M float32 values (4 MB of scratch) fit a CPU's last-level
#: cache; on an accelerator the piece bounds the float32 transient (64 MB) with few kernel launches
PIECE_VALUES: dict[str, int] = {"cpu": 1 << 20}
DEFAULT_PIECE_VALUES = 1 << 24


def piece_values(device: torch.device) -> int:
    """How many values one decoding piece holds on `device`."""
    return PIECE_VALUES.get(torch.device(device).type, DEFAULT_PIECE_VALUES)


def decode_rows(rows: torch.Tensor, per_row: int, decode: Callable[[torch.Tensor, slice], torch.Tensor],
                dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`decode(rows[a:b], slice(a, b))` over pieces of `rows` (each row decodes to `per_row` values),
    written into one [len(rows), per_row] tensor of `dtype`.

    One call when everything fits one piece, or while tracing for `torch.compile` (the compiler fuses
    the passes itself and a Python loop would unroll into the graph)."""
    n = rows.shape[0]
    step = max(1, piece_values(device) // max(1, per_row))
    if n <= step or torch.compiler.is_compiling():
        return decode(rows, slice(0, n)).reshape(n, per_row).to(dtype)
    out = torch.empty(n, per_row, dtype=dtype, device=device)
    for start in range(0, n, step):
        part = slice(start, min(n, start + step))
        out[part].copy_(decode(rows[part], part).reshape(-1, per_row))
    return out
