"""One video on several processes, in-process torch.distributed pieces: CFG parallel x Ulysses
sequence parallel, FSDP, failure reporting, launch helpers, the data-parallel groups a jobs batch
(`lingbot_nodes.jobs`) runs on.

`ParallelLayout` says which rank does what and holds the process groups; `enable_sequence_parallel`
makes a DiT share its sequence over the layout's ulysses group; `ParallelGuidance` runs the two CFG
branches on the two cfg rows. `launch` has the loopback helpers tests and benches spawn with.
The runners over the stages (`parallel_denoise`, LingBot Parallel's worker pool) sit above them, in
`worker_pool`.

The names are imported on first use, so `.launch` and `.abort` stay light for
spawned processes and the CLI (the sequence-parallel hooks import diffusers).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"ParallelGuidance": "cfg", "CFG_DEGREES": "layout", "ParallelLayout": "layout", "parse_degrees": "layout",
          "disable_sequence_parallel": "ulysses", "enable_sequence_parallel": "ulysses"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
