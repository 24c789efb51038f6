"""Every rank of a parallel run runs the same job: checked before the run, on every rank.

The ranks of one video are started apart (torchrun starts each with its own arguments; a pool's
workers get rank 0's inputs in a message), and nothing else makes them agree: two ranks with
different seeds write a wrong video, different step counts mix two schedules, different sizes
crash inside a collective. So at the start of each sampling loop every rank reduces what it was
asked to run (seed, steps, size, sampler, prompt, starting latents...) to one 64-bit digest per
field and the ranks compare them (one all-gather of a row of integers): a field that differs is
refused on every rank, with one line naming it, before any collective that depends on it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RefusedInput

__all__ = ["check_same_job", "field_digest"]


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Generator):
        value = value.get_state()
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__} {len(value)};".encode())
        for item in value:
            _feed(h, item)
    else:
        h.update(f"{type(value).__name__} {value!r};".encode("utf-8", "replace"))


def field_digest(value: Any) -> int:
    """A 64-bit digest of one field's value (tensors and generators by their bytes, dtype and shape;
    lists item by item; anything else by its type and repr), the same in every process."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, value)
    return int.from_bytes(h.digest(), "little", signed=True)


def check_same_job(fields: Mapping[str, Any], *, group: Any = None, device: torch.device | str = "cpu",
                   world_size: int | None = None, what: str = "parallel run") -> None:
    """Compare `fields` (name -> value) across the ranks of `group` (None: the world); every rank must
    call it with the same names. A field whose value differs on some rank is refused on every rank
    (`RefusedInput`, one line naming the fields and the ranks, by their place in the group)."""
    names = list(fields)
    row = torch.tensor([field_digest(names)] + [field_digest(fields[n]) for n in names], dtype=torch.int64)
    row = row.to(device)
    world = world_size if world_size is not None else dist.get_world_size(group)
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row, group=group)
    rows = [r.cpu() for r in rows]
    if any(int(r[0]) != int(rows[0][0]) for r in rows):
        raise RefusedInput(f"{what} refused: the ranks run different versions of this pack (their job descriptions "
                           "do not have the same fields); install the same version on every node")
    differ = [name for i, name in enumerate(names, start=1) if any(int(r[i]) != int(rows[0][i]) for r in rows)]
    if not differ:
        return
    odd = [r for r, got in enumerate(rows) if not torch.equal(got, rows[0])]
    ranks = ", ".join(str(r) for r in odd)
    raise RefusedInput(f"{what} refused: the ranks were not given the same job: {', '.join(differ)} "
                       f"differ{'s' if len(differ) == 1 else ''} between rank 0 and rank{'s' if len(odd) > 1 else ''} "
                       f"{ranks}; start every rank with the same workflow, overrides and inputs")
