"""Stopping every rank of a parallel run when one of them fails, and saying which one and why.

Every rank of a layout runs the same sampling loop, and each step's DiT forward meets the other
ranks in collectives (the ulysses all-to-alls, the CFG all-gather). A rank that raised and left
would leave the others waiting in their next collective until the backend's timeout (30 minutes by
default). Two cases:

- **Between two steps** (the step callback -- an interrupt --, the sampler's step): every rank is
  outside the forward, so after every step all of them take part in one small status exchange
  (`StepStatus`): a fixed-size all-gather of a flag and the first bytes of its error. The failing
  rank sends its error and re-raises it; every other rank gets `PeerFailed` at once. The group
  stays usable (every rank stopped at the same point): a jobs run goes on with its next job.
- **Inside a forward** (an out-of-memory error on one GPU between two all-to-alls, a rank that
  failed to load its DiT while the others already wait in the first forward): the others are inside
  collectives the failing rank will never join, so nothing can be exchanged through the group. The
  failing rank publishes its error in the group's store (torch.distributed's own TCPStore, which
  every rank reached at `init_process_group`; first failure wins, `publish_failure`) and then
  *leaves the group*: its process ends (a pool worker, a headless rank) or, for LingBot Parallel's
  rank 0, which must live on inside ComfyUI, it ends the workers. Gloo notices a peer's closed
  connections at once, so every collective waiting on the failing rank fails within milliseconds;
  a rank whose collective failed reads the store and raises `GroupBroken` naming the first failing
  rank, its device and its error, and leaves too, which frees whoever waited on it. Every rank of
  the group stops, and the group is not used again (its collectives are out of step).

NCCL (not run here, there is no GPU on the machine this was written on): a peer's process ending
does not reliably end a collective waiting on it on the GPU, and gloo's `abort` does not end a
pending collective (measured with torch 2.14), so on CUDA devices each rank watches the store
while it samples (`FailureWatch`, a thread polling a few times a second) and aborts the
communicators of its layout's own groups (`layout_groups`: the video's group and its meshes' groups,
never another video's; `ProcessGroup.abort`, ncclCommAbort, or its NCCL backend's `abort` on a torch
whose ProcessGroup has none) when another rank published a failure;
its pending collectives then raise and it reports `GroupBroken` like a gloo rank. The failing rank
aborts them right after publishing. `StepStatus` takes this rank's number, the store and the groups
when it is made: once aborted, torch may no longer answer for them. LingBot Parallel's rank 0 runs
inside ComfyUI, so its pool sets `TORCH_NCCL_ASYNC_ERROR_HANDLING=2` (abort the communicators on a
timeout, never end the process) unless the user set it, before its workers start (they inherit
it). The CUDA branch is tested on the CPU with gloo and a "cuda" device label. Not
covered: a rank killed without a chance to publish (SIGKILL, the kernel's OOM killer): its peers
then report their own connection error (gloo) or wait for NCCL's timeout; torchrun and LingBot
Parallel name the process that died.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MESSAGE_BYTES", "Failure", "FailureWatch", "GroupBroken", "PeerFailed", "StepStatus", "failure_in",
           "failure_key", "publish_failure", "published_failure"]

#: how much of a failing rank's error text reaches the others (utf-8, truncated)
MESSAGE_BYTES = 240
#: how often a CUDA rank's `FailureWatch` looks at the store while it samples (seconds)
WATCH_INTERVAL_S = 0.25


class PeerFailed(RuntimeError):
    """Another rank of the layout failed between two denoise steps; this rank stopped with it."""

    def __init__(self, step: int, failures: dict[int, str]):
        self.step, self.failures = step, dict(failures)
        named = "; ".join(f"rank {r} failed ({text})" for r, text in sorted(failures.items()))
        super().__init__(f"parallel denoise stopped after step {step}: {named}; this rank stopped too "
                         "(that rank's own log has the full error)")


# -- failures inside a forward: published in the store, the failing rank leaves -----------------------------

@dataclass(frozen=True)
class Failure:
    """The first failure of a group as the failing rank published it (`rank`: its global rank)."""

    rank: int
    device: str
    error: str  # "Type: message", at most MESSAGE_BYTES bytes of it
    where: str  # "in the DiT forward of step 2", "in node 5 (LingBotDenoise)", ...
    interrupted: bool = False

    def describe(self) -> str:
        if self.interrupted:
            return f"rank {self.rank} ({self.device}) was interrupted {self.where}"
        return f"rank {self.rank} ({self.device}) failed {self.where} ({self.error})"

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, data: bytes | str) -> Failure:
        fields = json.loads(data)
        return cls(int(fields["rank"]), str(fields["device"]), str(fields["error"]), str(fields["where"]),
                   bool(fields.get("interrupted", False)))


class GroupBroken(RuntimeError):
    """A rank of the group failed where the others wait for it in a collective (inside a forward, or
    outside the sampling loop): every rank of the group raises this, naming the first failure, and
    the group must not run another collective. `stops_group`: a jobs run stops here rather than
    going on with its next job on a group whose collectives are out of step.

    `failure` is None when the store could not be read (its host ended: rank 0 of a group started
    without torchrun's agent, which holds the store under torchrun); `lost` then says what this
    rank saw, and the failing rank's own log has the cause."""

    stops_group = True

    def __init__(self, failure: Failure | None, this_rank: int, lost: str = ""):
        self.failure = failure
        if failure is None:
            super().__init__(f"parallel run stopped: rank {this_rank} lost its group ({lost}) and the group's store "
                             "is gone too (the process that held it ended), so the rank that failed first is named in "
                             "the other ranks' logs. The group cannot go on: its collectives are out of step")
            return
        others = ("every rank of the group stops with it" if failure.rank == this_rank
                  else f"rank {this_rank} stopped with it (rank {failure.rank}'s own log has the full error)")
        super().__init__(f"parallel run stopped: {failure.describe()}; {others}. The group cannot go on: its "
                         "collectives are out of step")


def failure_key(layout: Any = None) -> str:
    """The store key of a video group's first failure (a split world has one per group)."""
    return f"lingbot/failure/{getattr(layout, 'leader_rank', 0)}"


def _store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _error_text(err: BaseException) -> str:
    text = f"{type(err).__name__}: {' '.join(str(err).split())}".encode("utf-8", "replace")[:MESSAGE_BYTES]
    return text.decode("utf-8", "ignore")


def _is_interrupt(err: BaseException) -> bool:
    from ..exit_codes import INTERRUPTED, exit_code

    return exit_code(err) == INTERRUPTED


def publish_failure(err: BaseException, *, where: str, device: torch.device | str = "cpu", key: str | None = None,
                    store: Any = None, rank: int | None = None) -> Failure | None:
    """Record `err` as the group's first failure unless another rank's came first; returns the first.
    `rank`: this process's global rank (default: asked of torch.distributed now).

    A `GroupBroken` (this rank stopped because of another's failure) is not recorded again. None when
    the store cannot be reached (its host ended): which rank failed first is unknown here then."""
    if isinstance(err, GroupBroken):
        return err.failure
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    mine = Failure(rank, str(device), _error_text(err), where, _is_interrupt(err))
    try:
        store = store if store is not None else _store()
        return Failure.decode(store.compare_set(key or failure_key(), "", mine.encode()))
    except Exception:
        return None


def published_failure(key: str | None = None, store: Any = None) -> Failure | None:
    """The group's first published failure, or None (none yet, or the store is gone)."""
    try:
        store = store if store is not None else _store()
        key = key or failure_key()
        return Failure.decode(store.get(key)) if store.check([key]) else None
    except Exception:
        return None


def failure_in(err: BaseException | None) -> Failure | None:
    """The `Failure` of a `GroupBroken` in `err`'s chain of causes, or None."""
    seen = 0
    while err is not None and seen < 16:
        if isinstance(err, GroupBroken):
            return err.failure
        err, seen = err.__cause__, seen + 1
    return None


def layout_groups(layout: Any) -> list[Any]:
    """The process groups of `layout`'s own video: its video group (the default group when the whole world
    is one video) and the groups of its meshes (cfg, ulysses, FSDP's). Never another video's groups."""
    from torch.distributed import distributed_c10d

    groups: list[Any] = []
    for mesh in (getattr(layout, "mesh", None), getattr(layout, "_world", None)):
        if mesh is not None:
            try:
                groups += list(mesh.get_all_groups())
            except Exception:  # a mesh whose groups are gone
                pass
    video = getattr(layout, "group", None)
    if video is None:
        try:
            video = distributed_c10d._get_default_group()
        except Exception:  # no default group (any more)
            video = None
    if video is not None:
        groups.append(video)
    unique: dict[int, Any] = {}
    for group in groups:
        unique.setdefault(id(group), group)
    return list(unique.values())


def _abort_group(group: Any) -> None:
    """End `group`'s pending collectives (NCCL: ncclCommAbort on its communicators). The group stays
    registered, so this process still knows its rank and leaves the group as usual afterwards."""
    try:
        group.abort()
        return
    except AttributeError:  # an older torch: ProcessGroup has no abort, its NCCL backend has
        pass
    except Exception:  # already aborted (by the watch), or a backend without abort
        return
    try:
        group._get_backend(torch.device("cuda")).abort()
    except Exception:
        pass


def abort_groups(groups: list[Any]) -> None:
    """Abort each of `groups` (`layout_groups`), the last made first, as torch aborts a whole world."""
    for group in reversed(groups):
        _abort_group(group)


class FailureWatch:
    """A thread that looks at the store every `interval` seconds and calls `action(failure)` once,
    when a rank other than this one published a failure under `key`. A context manager."""

    def __init__(self, key: str, action: Callable[[Failure], None], *, store: Any = None,
                 interval: float = WATCH_INTERVAL_S, rank: int | None = None):
        self.key, self.action, self.interval = key, action, interval
        self.store = store if store is not None else _store()
        self.rank = rank if rank is not None else dist.get_rank()
        self.fired: Failure | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lingbot-failure-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if not self.store.check([self.key]):
                    continue
                failure = Failure.decode(self.store.get(self.key))
            except Exception:  # the store is gone (its host ended): the collectives fail on their own
                return
            if failure.rank != self.rank:
                self.fired = failure
                self.action(failure)
            return

    def __enter__(self) -> FailureWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class StepStatus:
    """The failure handling of one sampling loop over `layout`'s video group (ranks are named by
    their place in that group, as `layout.rank`, in `PeerFailed`; by their global rank in `GroupBroken`).

    `passed(step)` after a step this rank finished: raises `PeerFailed` if another rank did not.
    `failed(step, err)` when this rank raised after its forward: tells the others (the caller
    re-raises `err`; a failure of the exchange itself is swallowed so `err` stays the error).
    Every rank must call exactly one of the two after every step.
    `broken(step, err)` when this rank's forward raised: the error to raise instead (see the module).
    `watching()` around the loop: on CUDA devices, the `FailureWatch` that aborts this rank's
    communicators when another rank published a failure.
    """

    def __init__(self, layout: Any, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.group = layout.group  # the video's own group (None: the whole world is one video)
        self.world = layout.world_size
        self.key = failure_key(layout)
        # what a failure needs, taken now: after an abort torch may no longer answer (an aborted default
        # group is no group, and asking it for the rank raises)
        self.rank = dist.get_rank()
        try:
            self.store: Any = _store()
        except Exception:  # no store to publish in: the failing rank's own log names it
            self.store = None
        self.groups = layout_groups(layout) if self.device.type == "cuda" else []

    def _exchange(self, err: BaseException | None) -> list[torch.Tensor]:
        row = torch.zeros(1 + MESSAGE_BYTES, dtype=torch.uint8)
        if err is not None:
            text = f"{type(err).__name__}: {err}".encode("utf-8", "replace")[:MESSAGE_BYTES]
            row[0] = 1
            row[1:1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        row = row.to(self.device)
        rows = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row, group=self.group)
        return [r.cpu() for r in rows]

    def passed(self, step: int) -> None:
        try:
            rows = self._exchange(None)
        except Exception as err:  # a rank left the group (it failed outside the loop, or inside a forward)
            raise self.broken(step, err, where=f"after step {step}") from err
        failures = {r: bytes(row[1:].tolist()).rstrip(b"\0").decode("utf-8", "replace")
                    for r, row in enumerate(rows) if row[0]}
        if failures:
            raise PeerFailed(step, failures)

    def failed(self, step: int, err: BaseException) -> None:
        try:
            self._exchange(err)
        except Exception:  # the group itself broke (a peer is gone): the caller's error is the one to raise
            pass

    def broken(self, step: int, err: BaseException, *, where: str | None = None) -> BaseException:
        """This rank's forward of `step` raised `err` (its own failure, or a collective that failed because
        another rank left): publish it unless another rank's came first, and return what to raise --
        `GroupBroken` naming the first failure, or `err` itself when this rank was interrupted first.
        The caller then leaves the group (its process ends, or LingBot Parallel ends its workers)."""
        if isinstance(err, GroupBroken):
            return err
        first = None
        if self.store is not None:
            first = publish_failure(err, where=where or f"in the DiT forward of step {step}", device=self.device,
                                    key=self.key, store=self.store, rank=self.rank)
        abort_groups(self.groups)  # CUDA only (gloo: a rank that leaves ends the collectives waiting on it)
        if first is not None and first.rank == self.rank and first.interrupted:
            return err
        return GroupBroken(first, self.rank, lost=_error_text(err))

    @contextmanager
    def watching(self) -> Iterator[None]:
        if self.device.type != "cuda":
            yield  # gloo: a rank that leaves ends the collectives waiting on it (no thread needed)
            return
        if self.store is None:  # nothing to watch: the collectives end at the backend's timeout
            yield
            return
        with FailureWatch(self.key, lambda failure: abort_groups(self.groups), store=self.store, rank=self.rank):
            yield
