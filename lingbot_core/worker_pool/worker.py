"""A LingBot Parallel worker process: it opens its own lazy handle from the pool's spec, joins the
process group, then serves rank 0's calls (`messages.HANDLERS`) until it is told to stop or rank 0
is gone. A failure it cannot share with rank 0 is published in the group's store, and it leaves."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.abort import PeerFailed, failure_key, publish_failure
from ..distributed.launch import init_loopback_group
from ..distributed.layout import ParallelLayout
from ..errors import is_refused_input
from .messages import HANDLERS, broadcast_message, drop_dits, gather_status
from .spec import COLLECTIVE_TIMEOUT, PoolSpec, open_described, with_pooled_loras

__all__ = ["FAILED", "READY", "STARTING", "worker_main"]

#: a worker's start, as it reports it in the pool's shared status array
STARTING, READY, FAILED = 0, 1, 2


def worker_main(rank: int, spec: PoolSpec, port: int, status: Any, forked: bool) -> None:
    """A worker: open the handle (lazily), join the group, then serve calls until told to stop."""
    try:
        if forked:  # OpenMP's pool does not survive a fork once the parent used it
            torch.set_num_threads(1)
        device = torch.device(spec.devices[rank])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        handle = open_described(spec.checkpoint, device)
    except BaseException:
        status[rank] = FAILED
        raise
    status[rank] = READY
    init_loopback_group(rank, spec.world_size, port, spec.backend, timeout=COLLECTIVE_TIMEOUT)
    try:
        layout = ParallelLayout.create(spec.cfg, spec.ulysses, device_type=device.type, fsdp=spec.fsdp)
        _serve(handle, layout, device if spec.backend == "nccl" else torch.device("cpu"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _serve(handle: Any, layout: ParallelLayout, device: torch.device) -> None:
    view = handle.with_parallel(layout)
    spec_device = str(handle.device)
    lora_files: dict[str, Any] = {}  # path -> LoraFile, the files of rank 0's current LoRA stack

    while True:
        try:
            kind, fields, tensors = broadcast_message(device)
        except Exception:  # rank 0 is gone (its process ended): nothing left to serve
            return
        if kind == "stop":
            return
        if kind == "ping":
            gather_status(device, {"pid": os.getpid(), "loads": dict(handle.shared.load_count),
                                    "resident": list(handle.shared.loaded)})
            continue
        _pack, unpack, execute = HANDLERS[kind]
        where = f"preparing {kind}"  # the worker's own steps (its LoRA files): rank 0 does not repeat them
        try:
            drop_dits(handle, fields.pop("release", []))  # as rank 0 dropped them (Refine's release_base)
            call_view, call_kwargs = with_pooled_loras(view, fields.pop("loras", []), lora_files), unpack(fields, tensors)
            where = f"in {kind}"
            execute(call_view, call_kwargs, None)
        except PeerFailed:  # rank 0 (or another worker) stopped between two steps: every rank stopped there
            continue
        except Exception as err:
            print(f"lingbot parallel worker rank {layout.rank}: {kind} failed: {type(err).__name__}: {err}",
                  file=sys.stderr, flush=True)
            if is_refused_input(err) and where == f"in {kind}":
                continue  # a refused input: rank 0 refuses the same (same inputs, same checks) and keeps the pool
            # anything else leaves this call out of step with the others: publish it for rank 0 (a failure
            # inside the forward already is) and leave, which ends every collective waiting on this process
            publish_failure(err, where=where, device=spec_device, key=failure_key(layout))
            return
