"""Stopping every rank of a parallel denoise when one of them fails between two steps.

Every rank of a layout runs the same sampling loop, and each step's DiT forward meets the other
ranks in collectives (the ulysses all-to-alls, the CFG all-gather). A rank that raised and left the
loop -- its step callback (an interrupt), the sampler's step -- would leave the others waiting in
their next step's collective until the backend's timeout (30 minutes by default). So after every
step, outside the forward, every rank takes part in one small status exchange (`StepStatus`): a
fixed-size all-gather of a flag and the first bytes of its error. The failing rank sends its error
and re-raises it; every other rank gets `PeerFailed` naming the failing rank(s) at once.

What this does not cover: a failure *inside* a forward (between that forward's own collectives).
The failing rank cannot join the status exchange then without mismatching the collectives the
others are in, so those ranks wait for the backend's timeout (or for the failing process to exit,
which gloo reports as a connection error). torch.distributed has no portable way to cancel a
pending collective (NCCL's `abort` ends the whole communicator), which is why this is not done with
the store or async handles.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MESSAGE_BYTES", "PeerFailed", "StepStatus"]

#: how much of a failing rank's error text reaches the others (utf-8, truncated)
MESSAGE_BYTES = 240


class PeerFailed(RuntimeError):
    """Another rank of the layout failed between two denoise steps; this rank stopped with it."""

    def __init__(self, step: int, failures: dict[int, str]):
        self.step, self.failures = step, dict(failures)
        named = "; ".join(f"rank {r} failed ({text})" for r, text in sorted(failures.items()))
        super().__init__(f"parallel denoise stopped after step {step}: {named}; this rank stopped too "
                         "(that rank's own log has the full error)")


class StepStatus:
    """The per-step status exchange of one sampling loop over `layout`'s video group (ranks are
    named by their place in that group, as `layout.rank`).

    `passed(step)` after a step this rank finished: raises `PeerFailed` if another rank did not.
    `failed(step, err)` when this rank raised after its forward: tells the others (the caller
    re-raises `err`; a failure of the exchange itself is swallowed so `err` stays the error).
    Every rank must call exactly one of the two after every step.
    """

    def __init__(self, layout: Any, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.group = layout.group  # the video's own group (None: the whole world is one video)
        self.world = layout.world_size

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
        rows = self._exchange(None)
        failures = {r: bytes(row[1:].tolist()).rstrip(b"\0").decode("utf-8", "replace")
                    for r, row in enumerate(rows) if row[0]}
        if failures:
            raise PeerFailed(step, failures)

    def failed(self, step: int, err: BaseException) -> None:
        try:
            self._exchange(err)
        except Exception:  # the group itself broke (a peer is gone): the caller's error is the one to raise
            pass

