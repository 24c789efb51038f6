"""The C allocator set up for a CPU run's large tensors (glibc on Linux).

glibc serves every allocation above its mmap threshold (128 KiB, rising to at most 32 MiB as such
blocks are freed) with a fresh `mmap`, and gives it back with `munmap` when freed. A DiT forward on a
CPU allocates and frees activations of tens to hundreds of MiB in every block, so each one faults in
fresh zeroed pages: `bench/allocator.py` measured a dense real-width block 1.10x slower at 5k tokens
and 1.44x at 20k (issue 36) than with the threshold at 1 GiB, where those blocks are reused from the
heap. The cost: memory freed inside the heap stays with the process (its RSS does not fall back
between steps; `bench/allocator.py` prints the peak RSS of both).

The command-line entry points (`python -m lingbot_core`, `lingbot-run`) call `tune_for_cpu` before
anything heavy is allocated, for runs on a CPU only (a GPU run's host memory is mostly long-lived
weights, and nothing was measured there). Inside ComfyUI the process is ComfyUI's: start it with
`MALLOC_MMAP_THRESHOLD_=1073741824` (and `MALLOC_TRIM_THRESHOLD_` the same) in the environment
instead (docs/speed.md). A threshold already set in the environment is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
LARGE_THRESHOLD = 1 << 30  # 1 GiB: every activation of a forward at the recipes' sizes stays in the heap
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_done: list[str] = []


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def tune_for_cpu(device: str | None, *, libc: ctypes.CDLL | None = None) -> str:
    """Raise glibc's mmap and trim thresholds to `LARGE_THRESHOLD` for a run on `device` when it is the
    CPU; returns what was done, for the log ("set", or why not). Idempotent; `libc`: for tests."""
    if device is None or not str(device).startswith("cpu"):
        return "not a CPU run"
    if any(os.environ.get(name) for name in ENVIRONMENT):
        return "left as the environment sets it"
    if _done:
        return _done[0]
    libc = libc if libc is not None else _libc()
    if libc is None:
        return "not glibc"
    ok = libc.mallopt(M_MMAP_THRESHOLD, LARGE_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, LARGE_THRESHOLD) == 1
    _done.append("set" if ok else "mallopt refused")
    return _done[0]
