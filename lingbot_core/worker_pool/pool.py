"""Persistent worker processes for one parallel layout, with the calling process as rank 0.

ComfyUI runs every node in one process, but torch.distributed needs one process per rank. A
`WorkerPool` therefore starts one process per extra device (torch.multiprocessing, spawn) that joins
a process group with the caller: the rendezvous is torch's TCP store, its server held by rank 0 on a
socket bound to 127.0.0.1 (`distributed.launch.loopback_store`: nothing listens on another address),
gloo on CPUs, NCCL on CUDA devices. Each worker opens its own lazy handle from
`spec.describe_handle` (paths and settings, never pickled modules), so it loads its DiT on the first call
and keeps it across calls. A call (`WorkerPool.denoise`, `.refine`) sends the stage's inputs to every worker -- a
JSON header and tensors, both with `dist.broadcast`; nothing is pickled -- and then runs the stage
here too, on the pool's parallel view of the caller's handle: every rank runs the same stage with
the same inputs, and rank 0 keeps the result.

Interrupts: after every step every rank takes part in the sampling loop's status exchange
(`distributed.abort.StepStatus`); when rank 0's step callback raised (ComfyUI's interrupt, Ctrl-C), or
its step failed, the workers hear it there (`PeerFailed`) and drop the call within that step, in step
with rank 0, so the pool stays usable.

Failures: a worker that failed (inside a DiT forward too: an out-of-memory error on its GPU), a
worker that died, or a call that failed on rank 0 for any reason but an interrupt or a refused
input stops the whole pool with one clear `PoolError` naming the rank and device that failed and
its error; the caller's handle is untouched (its single-device stages work as before) and the next
call on the pool starts fresh workers. A failing worker publishes its error in the group's store and
ends its process, so the collectives rank 0 (and every other worker) waits in fail at once instead
of at the backend's timeout; rank 0 reads the error there (`distributed/abort.py` has the details, NCCL's
included). `release` stops the workers (they also stop when this process exits: they are daemons, an
atexit hook releases them, and a worker whose collectives fail because rank 0 is gone exits).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..components import TRANSFORMER
from ..distributed.abort import Failure, failure_in, failure_key, published_failure
from ..distributed.launch import init_loopback_group, reserve_loopback_port
from ..distributed.layout import ParallelLayout
from ..errors import RefusedInput, is_refused_input
from ..interrupt import interrupt_checker
from .messages import HANDLERS, broadcast_message, drop_dits, first_frame_drawn, gather_status
from .spec import (
    COLLECTIVE_TIMEOUT,
    PoolError,
    PoolSpec,
    check_pooled,
    open_described,
    pooled_loras,
    with_pooled_loras,
)
from .worker import FAILED, READY, STARTING, worker_main

log = logging.getLogger("lingbot_core.worker_pool")

__all__ = ["START_METHOD", "SamplingStages", "WorkerPool", "pool_for", "pool_of", "release_pool_of", "stages_for", "tag"]

#: how long rank 0 waits for the workers to come up (spawn, imports, handle check) before giving up
START_TIMEOUT_S = float(os.environ.get("LINGBOT_POOL_START_TIMEOUT", "600"))
#: how workers start: "spawn" (safe with CUDA initialised in this process, as in ComfyUI); the CPU tests
#: use "fork" (an interpreter start with our imports costs a minute on a loaded machine)
START_METHOD = "spawn"


# -- the pool (rank 0) ---------------------------------------------------------------------------------

_LIVE: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


class WorkerPool:
    """Workers for `spec`, started on the first call (or `start`), kept until `release`."""

    def __init__(self, spec: PoolSpec):
        self.spec = spec
        self.layout: ParallelLayout | None = None
        self._procs: list[Any] = []
        self._status: Any = None
        self.starts = 0  # how many times workers were started (tests, the node's status line)
        #: called with the pool after every start of its workers, including a restart by a later call after
        #: `release` (ComfyUI lists the pool again there, so its next "Unload models" stops the new workers)
        self.on_start: list[Callable[[WorkerPool], None]] = []
        self._own: Any = None  # FSDP: rank 0's own lazy handle of the checkpoint (`_rank0_view`)
        self._own_loras: dict[str, Any] = {}  # its LoRA files, as a worker keeps them

    # -- lifecycle ---------------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self.layout is not None

    @property
    def device(self) -> torch.device:
        return torch.device(self.spec.devices[0]) if self.spec.backend == "nccl" else torch.device("cpu")

    def start(self) -> None:
        """Spawn the workers and join their process group as rank 0 (a no-op when started)."""
        if self.started:
            return
        if dist.is_available() and dist.is_initialized():
            raise PoolError("this process already belongs to a torch.distributed group (another LingBot Parallel "
                            "pool, or a torchrun launch); release it first")
        import torch.multiprocessing as mp

        ctx = mp.get_context(START_METHOD)
        # the rendezvous port is held from now on (bound, listening once the workers are up): no other
        # process can take it in between
        reserved = reserve_loopback_port()
        world, port = self.spec.world_size, reserved.getsockname()[1]
        self._status = ctx.Array("i", [STARTING] * world)
        self._procs = []
        # the workers inherit the environment as it is now
        if self.spec.backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        else:  # on an NCCL error or timeout: abort the communicators and raise, never end ComfyUI's process
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        try:
            with _main_module_hidden(), _fork_safe():
                for rank in range(1, world):
                    proc = ctx.Process(target=worker_main, args=(rank, self.spec, port, self._status, START_METHOD == "fork"), daemon=True,
                                       name=f"lingbot-parallel-{rank}")
                    proc.start()
                    self._procs.append(proc)
            self._wait_ready()
            init_loopback_group(0, world, port, self.spec.backend, timeout=COLLECTIVE_TIMEOUT, reserved=reserved)
            self.layout = ParallelLayout.create(self.spec.cfg, self.spec.ulysses, fsdp=self.spec.fsdp,
                                                device_type="cuda" if self.spec.backend == "nccl" else "cpu")
        except BaseException:
            self._abandon()
            raise
        finally:
            reserved.close()  # nothing once the store took it
        self.starts += 1
        _LIVE.add(self)
        for hook in list(self.on_start):
            hook(self)
        log.info("LingBot Parallel: %d worker process(es) on %s (%s)", world - 1, ", ".join(self.spec.devices[1:]),
                 self.layout.describe())

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            states = list(self._status)
            if any(s == FAILED for s in states):
                rank = states.index(FAILED)
                raise PoolError(f"LingBot Parallel: the worker for {self.spec.devices[rank]} (rank {rank}) could not "
                                "start; its error is in the server log")
            self._check_processes("start")
            if all(s == READY for s in states[1:]):
                return
            if time.monotonic() > deadline:
                raise PoolError(f"LingBot Parallel: the workers did not start within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def _check_processes(self, when: str) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            if not proc.is_alive():
                raise PoolError(f"LingBot Parallel: the worker for {self.spec.devices[rank]} (rank {rank}) is gone "
                                f"(exit code {proc.exitcode}) at {when}; the workers were stopped. The pipe without "
                                "LingBot Parallel works on this device; running again starts new workers")

    def release(self) -> None:
        """Stop the workers and leave the process group; the next call starts new ones."""
        if self.started:
            try:
                self._check_processes("release")
                broadcast_message(self.device, "stop")
            except Exception:  # a worker already gone: the processes are ended below
                pass
        self._abandon()

    def _abandon(self, grace: float = 5.0) -> None:
        """End the workers (after `grace` seconds for them to stop by themselves) and leave the group."""
        for proc in self._procs:
            proc.join(timeout=grace if self.started else 0)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs = []
        if dist.is_available() and dist.is_initialized() and self.layout is not None:
            try:
                dist.destroy_process_group()
            except Exception:  # a group broken by a dead peer: its resources go with it
                pass
        self.layout = None
        self._own, self._own_loras = None, {}  # FSDP shards belong to the group just left
        _LIVE.discard(self)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def ping(self) -> list[dict[str, Any]]:
        """Every worker's status: its pid, how often it loaded each DiT and which are in memory (tests; the
        node's line)."""
        self._call_started("ping")
        broadcast_message(self.device, "ping")
        return gather_status(self.device, None)

    # -- calls -------------------------------------------------------------------------------------------
    def _call_started(self, what: str) -> None:
        self.start()
        try:
            self._check_processes(what)
        except PoolError:
            self._abandon()
            raise

    def denoise(self, pipe: Any, cond: Any, *, callback: Callable | None = None, **kwargs: Any) -> Any:
        """`stages.denoise(pipe, cond, ...)` on every rank; rank 0's latents (this process's) are returned."""
        return self._call("denoise", pipe, callback=callback, cond=cond, **kwargs)

    def refine(self, pipe: Any, frames: Any, cond: Any, *, callback: Callable | None = None, **kwargs: Any) -> Any:
        """`stages.refine(pipe, frames, cond, ...)`: the base frames' upscale and VAE encode (and any decode)
        run here, the refiner's sampling on every rank (each worker loads the refiner DiT on its first
        Refine and keeps it)."""
        from .. import stages

        check_pooled(pipe)  # what the call would refuse, refused before the base DiT is released
        if kwargs.get("sampler") is not None and not isinstance(kwargs["sampler"], str):
            raise RefusedInput("LingBot Parallel takes a sampler by name")
        release = [TRANSFORMER] if kwargs.get("release_base") else []  # the workers drop it too, as rank 0 does

        def on_pool(handle: Any, refiner_cond: Any, **denoise_kwargs: Any) -> Any:
            return self._call("denoise", handle, cond=refiner_cond, release_dits=release, **denoise_kwargs)

        return stages.refine(pipe, frames, cond, callback=callback, sample_with=on_pool, **kwargs)

    def _call(self, stage: str, handle: Any, callback: Callable | None = None, **kwargs: Any) -> Any:
        """Run `stage` (a message kind of `messages.HANDLERS`) with `kwargs` on every rank; rank 0's result
        (this process's) is returned.

        `handle` is this process's pipe; it runs on the pool's parallel view of it. `callback(step,
        total, latents)` runs here after each step; what it raises (an interrupt) stops every rank
        within that step and propagates; the pool stays up. Any other failure stops the pool
        (`PoolError` when a worker is gone).
        """
        pack, _unpack, execute = HANDLERS[stage]
        check_pooled(handle)
        release = list(kwargs.pop("release_dits", ()))  # `drop_dits` keeps the DiTs among them
        kwargs = first_frame_drawn(kwargs)
        fields, tensors = pack({**kwargs})  # bad input is refused before anything is sent
        fields = {**fields, "loras": pooled_loras(handle), "release": release}
        self._call_started(stage)
        view = self._rank0_view(handle, fields["loras"])  # its refusals too, before the workers hear of the call
        if self._own is not None:
            drop_dits(self._own, release)
        device = self.device
        flagged = []  # rank 0 stopped between two steps (the workers heard it in the status exchange)

        def on_step(step: int, total: int, latents: Any) -> None:
            try:
                if callback is not None:
                    callback(step, total, latents)
            except BaseException:
                flagged.append(step)
                raise

        try:
            broadcast_message(device, stage, fields, tensors)
            # no cancellation points inside the DiT here: an interrupt between two blocks would leave the
            # workers inside that forward's collectives, and only ending them frees them (a reload of every
            # worker's DiT on the next run). The step callback, between two forwards, follows it instead.
            with interrupt_checker(None):
                return execute(view, {k: v for k, v in kwargs.items() if k != "trace"}, on_step)
        except BaseException as err:
            failure = failure_in(err)  # the group broke: the first rank that failed, as it published it
            refused = is_refused_input(err)
            if failure is None and not _is_interrupt(err) and not refused:
                failure = published_failure(failure_key(self.layout))  # a worker that failed outside the loop
            dead = [] if failure is not None and failure.rank != 0 else self._dead_after(err)
            in_step = flagged and (_is_interrupt(err) or refused)
            if failure is None and not dead and (in_step or refused):
                raise  # every rank stopped the same way (an interrupt between two steps, or the same refused input)
            self._abandon(grace=0)  # the workers left, or wait in a collective that will not complete
            error = self._failure_error(stage, err, failure, dead)
            if error is err:
                raise
            raise error from err

    def _rank0_view(self, handle: Any, loras: list[list[Any]]) -> Any:
        """The parallel view rank 0 runs a call on: the caller's handle, or with FSDP a handle of the pool's
        own (opened like a worker's, lazily; its DiT is sharded on first use, the caller's stays whole)
        carrying the caller's LoRA stack as the workers get it."""
        if not self.spec.fsdp:
            return handle.with_parallel(self.layout)
        if self._own is None:
            self._own = open_described(self.spec.checkpoint, handle.device)
        return with_pooled_loras(self._own.with_parallel(self.layout), loras, self._own_loras)

    def _failure_error(self, stage: str, err: BaseException, failure: Failure | None,
                       dead: list[tuple[int, Any]]) -> BaseException:
        """What a failed call raises: the worker that failed (its device, rank and error), else a worker
        that died, else rank 0's own error (an interrupt as it is)."""
        after = ("; the workers were stopped. The pipe without LingBot Parallel works on this device; running "
                 "again starts new workers")
        if failure is not None and 0 < failure.rank < self.spec.world_size:
            device = self.spec.devices[failure.rank]
            what = "was interrupted" if failure.interrupted else f"failed {failure.where} ({failure.error})"
            return PoolError(f"LingBot Parallel: the worker for {device} (rank {failure.rank}) {what} during "
                             f"{stage}{after}")
        if dead:
            rank, proc = dead[0]
            return PoolError(f"LingBot Parallel: the worker for {self.spec.devices[rank]} (rank {rank}) died during "
                             f"{stage} (exit code {proc.exitcode}){after}")
        if isinstance(err, PoolError) or _is_interrupt(err):
            return err
        own = failure.error if failure is not None else f"{type(err).__name__}: {err}"
        where = f" {failure.where}" if failure is not None else ""
        return PoolError(f"LingBot Parallel: {stage} failed on rank 0 ({self.spec.devices[0]}){where} ({own}); the "
                         "workers were stopped and the next run starts new ones")

    def _dead_after(self, err: BaseException) -> list[tuple[int, Any]]:
        """(rank, process) of the workers found dead after `err` (a collective error can come a moment before
        the exit is seen), taken now: `_abandon` empties the list of workers. A worker that left by itself
        (exit code 0: it followed another rank's failure) is not one that died."""
        def dead() -> list[tuple[int, Any]]:
            return [(rank, p) for rank, p in enumerate(self._procs, start=1) if not p.is_alive() and p.exitcode != 0]

        found = dead()
        if not found and not _is_interrupt(err) and not is_refused_input(err):
            time.sleep(0.5)
            found = dead()
        return found


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """A spawned child imports the parent's `__main__` script again (as `__mp_main__`) unless it cannot
    find it; ComfyUI's main.py does work at import, and the workers need nothing from it, so its file
    and spec are hidden while the workers start."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    for key in saved:
        if key == "__spec__":
            main.__spec__ = None
        else:
            del main.__dict__[key]
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


@contextmanager
def _fork_safe() -> Iterator[None]:
    """With the fork start method (the CPU tests): a forked worker must never run the destructors of
    what this process still holds, such as the process groups of a pool that failed, kept alive by
    the traceback of the error the caller holds (a gloo group's destructor joins threads the child
    does not have: a crash or a hang). So garbage goes first and the garbage collector leaves
    everything older than the fork alone in the children (`gc.freeze`, Python's advice for fork)."""
    if START_METHOD != "fork":
        yield
        return
    import gc

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# -- which pipes run on a pool ------------------------------------------------------------------------------

_CURRENT: WorkerPool | None = None  # one process belongs to one process group: one pool at a time


def pool_for(spec: PoolSpec) -> WorkerPool:
    """The pool for `spec`: the current one when it has the same spec (kept warm), else a new one (the
    current pool is released first: this process can be rank 0 of one group only)."""
    global _CURRENT
    if _CURRENT is not None and _CURRENT.spec == spec:
        return _CURRENT
    if _CURRENT is not None:
        _CURRENT.release()
    _CURRENT = WorkerPool(spec)
    return _CURRENT


def tag(pipe: Any, pool: WorkerPool) -> Any:
    """A view of the pipe whose sampling stages run on `pool` (`stages_for`). The pool is a field of the
    view, so every view made from it (LingBot Offload with 'none'/'auto', anything built with
    `dataclasses.replace`) runs on the pool too; what the workers cannot follow is refused
    (`check_pooled`), never run on rank 0 alone."""
    from dataclasses import replace

    return replace(pipe, pool=pool)


def pool_of(pipe: Any) -> WorkerPool | None:
    """The pool a pipe from `tag` (or a view of it) runs on (None for every other pipe)."""
    pool = getattr(pipe, "pool", None)
    return pool if isinstance(pool, WorkerPool) else None


class SamplingStages(Protocol):
    """What runs a pipe's sampling stages (`stages_for`): `lingbot_core.stages` in this process, or a
    `WorkerPool` on every rank; both take the stages' own arguments."""

    def denoise(self, pipe: Any, cond: Any, **kwargs: Any) -> Any: ...

    def refine(self, pipe: Any, frames: Any, cond: Any, **kwargs: Any) -> Any: ...


def stages_for(pipe: Any) -> SamplingStages:
    """Where a node runs the pipe's Denoise and Refine: the pool the pipe carries (`tag`: LingBot
    Parallel) or, for every other pipe, the stages in this process."""
    pool = pool_of(pipe)
    if pool is not None:
        return pool
    from .. import stages

    return stages


def release_pool_of(pipe: Any) -> bool:
    """Stop the workers of the pipe's pool (True when it had one); the next call starts them again."""
    pool = pool_of(pipe)
    if pool is not None:
        pool.release()
    return pool is not None


def _is_interrupt(err: BaseException) -> bool:
    from ..exit_codes import INTERRUPTED, exit_code

    return exit_code(err) == INTERRUPTED


@atexit.register
def _release_all() -> None:
    for pool in list(_LIVE):
        try:
            pool.release()
        except Exception:
            pass
