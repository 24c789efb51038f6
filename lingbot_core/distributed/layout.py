"""Which rank does what when one video runs on several processes.

The world is a (cfg, ulysses) grid: `cfg` is 1 or 2 (with 2, the first row of ranks computes the
conditional prediction and the second the unconditional one), `ulysses` is how many ranks share one
DiT forward by splitting its joint sequence (it must divide the head count, because attention runs
head-sharded between two all-to-alls). Rank r sits at row r // ulysses, column r % ulysses.

The groups come from torch's own `DeviceMesh` over the already-initialised default process group
(NCCL on GPUs, gloo on CPU); nothing here opens a socket of its own.

With `ParallelLayout.create(..., split=True)` the world may be several such grids (a jobs file
spread over data-parallel groups) of G = cfg x ulysses ranks each. `video_groups` cuts the world
into them node by node, so a video's collectives (Ulysses' all-to-alls in every attention layer)
stay inside one machine where they can: each node's processes, in local-rank order, make
(processes on the node) // G groups, and only the ranks left over on the nodes (when G does not
divide a node's process count, or exceeds it) make groups that span nodes. Under torchrun with the
same --nproc-per-node everywhere and G dividing it, these are the groups of G consecutive ranks. The
mesh gets a leading "jobs" dimension, and `rank` / `group` / `leader_rank` / `video` are this rank's
place in its own group, so every collective of one video stays inside that group.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RefusedInput

__all__ = ["CFG_DEGREES", "ParallelLayout", "node_place", "parse_degrees", "video_groups"]

#: the cfg degrees a layout accepts: no CFG split, or cond / uncond on two rank rows
CFG_DEGREES = (1, 2)


def parse_degrees(text: str, world_size: int, *, split: bool = False) -> tuple[int, int]:
    """`"cfg=2,ulysses=4"` -> (2, 4). A missing degree is filled from the world size
    (cfg defaults to 1, ulysses to world // cfg); the product must equal the world size, or with
    `split` (one video per group of cfg x ulysses ranks) divide it."""
    given: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in ("cfg", "ulysses") or not value.strip().isdigit():
            raise RefusedInput(f"parallel degrees: {part!r} is not cfg=N or ulysses=N")
        given[name] = int(value)
    cfg = given.get("cfg", 1)
    if cfg not in CFG_DEGREES:
        raise RefusedInput(f"parallel degrees: cfg={cfg}; it must be one of {CFG_DEGREES}")
    ulysses = given.get("ulysses", world_size // cfg if world_size % cfg == 0 else 0)
    if split and ulysses >= 1 and world_size % (cfg * ulysses) == 0:
        return cfg, ulysses
    if ulysses < 1 or cfg * ulysses != world_size:
        how = "divide" if split else "equal"
        raise RefusedInput(f"parallel degrees: cfg={cfg} x ulysses={ulysses} must {how} the world size {world_size}")
    return cfg, ulysses


def node_place() -> tuple[str, int]:
    """(node, local rank) of this process: torchrun's GROUP_RANK (its agent's rank; one agent per
    machine) and LOCAL_RANK, else the host name and RANK (one machine)."""
    node = os.environ.get("GROUP_RANK")
    node = f"agent{node}" if node is not None and node.strip() else f"host:{socket.gethostname()}"
    local = os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))
    return node, int(local) if local.strip().isdigit() else 0


def video_groups(places: Sequence[tuple[str, int]], size: int) -> list[list[int]]:
    """The world's ranks cut into groups of `size`, each on one node where the node allows.

    `places[r]` is global rank r's (node, local rank). A node's ranks (by local rank) fill whole
    groups first; the ranks left over on every node (in node order: the node of the lowest rank
    first) are pooled into the groups that must span nodes. Each group lists its ranks in rising
    order (the order torch gives the ranks of a subgroup), and the groups come in the order of their
    lowest rank. ValueError when `size` does not divide the world."""
    if size < 1 or len(places) % size:
        raise RefusedInput(f"{size} ranks per video do not divide the world of {len(places)} processes")
    nodes: dict[str, list[tuple[int, int]]] = {}
    for rank, (node, local) in enumerate(places):
        nodes.setdefault(node, []).append((local, rank))
    groups: list[list[int]] = []
    leftover: list[int] = []
    for members in nodes.values():  # dicts keep insertion order: the node of the lowest rank first
        ranks = [rank for _local, rank in sorted(members)]
        whole = len(ranks) - len(ranks) % size
        groups += [ranks[i:i + size] for i in range(0, whole, size)]
        leftover += ranks[whole:]
    groups += [leftover[i:i + size] for i in range(0, len(leftover), size)]
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


@dataclass
class ParallelLayout:
    """The degrees, this rank's place in the grid and the two process groups.

    `rank` is this rank's place in its video group; `group` is that group's process group (None: the
    whole world is one video) and `leader_rank` the global rank of its rank 0 (what `broadcast`'s
    `src` names); `video` is the group's index among the world's `videos` groups.

    Build it with `ParallelLayout.create(cfg, ulysses)` on every rank after
    `torch.distributed.init_process_group`; `ParallelLayout.single()` is the one-process layout
    (no groups, nothing distributed is touched).
    """

    cfg: int = 1
    ulysses: int = 1
    rank: int = 0
    mesh: Any = field(default=None, repr=False)
    fsdp: bool = False  # shard the DiTs' blocks over every rank of the video group (distributed/fsdp.py)
    group: Any = field(default=None, repr=False, compare=False)
    leader_rank: int = 0
    video: int = 0  # which video group this rank is in (split layouts), of `videos`
    videos: int = 1
    nodes: int = 1  # how many nodes this rank's video group spans (node_place)
    _world: Any = field(default=None, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return self.cfg * self.ulysses

    @property
    def cfg_rank(self) -> int:
        """0 on the ranks that compute the conditional prediction, 1 on the unconditional ones."""
        return self.rank // self.ulysses

    @property
    def ulysses_rank(self) -> int:
        """This rank's position in its sequence-sharing group (which sequence chunk it holds)."""
        return self.rank % self.ulysses

    @property
    def ulysses_group(self) -> Any:
        """The process group that shares one DiT forward (None when ulysses is 1)."""
        return self.mesh.get_group("ulysses") if self.mesh is not None and self.ulysses > 1 else None

    @property
    def cfg_group(self) -> Any:
        """The process group of the ranks holding the same sequence chunk of cond and uncond (None when cfg is 1)."""
        return self.mesh.get_group("cfg") if self.mesh is not None and self.cfg > 1 else None

    @classmethod
    def single(cls) -> ParallelLayout:
        return cls()

    @classmethod
    def create(cls, cfg: int, ulysses: int, *, device_type: str = "cpu", fsdp: bool = False,
               split: bool = False) -> ParallelLayout:
        """The layout of this rank in the initialised default group; every rank must call it.
        `fsdp`: the DiTs' blocks are sharded over every rank of the video when a denoise first runs them.
        `split`: the world may be a multiple of cfg x ulysses; it is cut into groups of that many
        ranks (`video_groups`: each inside one node where it can), each running its own videos (every
        group is made here, by every rank: they learn each other's node with one all-gather)."""
        if cfg not in CFG_DEGREES or ulysses < 1:
            raise RefusedInput(f"parallel layout: cfg must be one of {CFG_DEGREES} and ulysses >= 1 (got {cfg}, {ulysses})")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("parallel layout: torch.distributed is not initialised (init_process_group first)")
        world = dist.get_world_size()
        size = cfg * ulysses
        if world % size if split else size != world:
            how = "divide" if split else "equal"
            raise RefusedInput(f"parallel layout: cfg={cfg} x ulysses={ulysses} must {how} the world size {world}")
        from torch.distributed.device_mesh import init_device_mesh

        rank = dist.get_rank()
        if world == size:  # one video on the whole world: the default group is its group
            mesh = init_device_mesh(device_type, (cfg, ulysses), mesh_dim_names=("cfg", "ulysses"))
            return cls(cfg=cfg, ulysses=ulysses, rank=rank, mesh=mesh, fsdp=bool(fsdp))
        from torch.distributed.device_mesh import DeviceMesh

        places: list[Any] = [None] * world
        dist.all_gather_object(places, node_place())
        groups = video_groups([tuple(p) for p in places], size)
        (video,) = [i for i, g in enumerate(groups) if rank in g]
        members = groups[video]
        ranks = torch.tensor(groups, dtype=torch.int64)
        # the groups are collectives of the whole world: made now, while every rank is here (the groups
        # then run different jobs and never meet again)
        mesh = DeviceMesh(device_type, ranks.view(len(groups), cfg, ulysses), mesh_dim_names=("jobs", "cfg", "ulysses"))
        videos = DeviceMesh(device_type, ranks, mesh_dim_names=("jobs", "video"))
        layout = cls(cfg=cfg, ulysses=ulysses, rank=members.index(rank), mesh=mesh, fsdp=bool(fsdp),
                     group=videos.get_group("video"), leader_rank=members[0], video=video, videos=len(groups),
                     nodes=len({places[r][0] for r in members}))
        layout._world = videos["video"]
        return layout

    def world_mesh(self) -> Any:
        """A one-dimensional mesh of every rank of this video (what FSDP shards over), made on first use;
        every rank must call it the first time (a split layout made it in `create`)."""
        if self._world is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._world = init_device_mesh(self.mesh.device_type, (self.world_size,), mesh_dim_names=("world",))
        return self._world

    def check_heads(self, heads: int) -> None:
        """Refuse a ulysses degree that does not divide the DiT's attention heads."""
        if heads % self.ulysses:
            raise RefusedInput(f"parallel layout: ulysses={self.ulysses} must divide the DiT's {heads} attention heads "
                             f"(pick a divisor of {heads})")

    def describe(self) -> str:
        sharded = ", FSDP" if self.fsdp else ""
        return (f"cfg={self.cfg} x ulysses={self.ulysses}{sharded} (rank {self.rank}: cfg row {self.cfg_rank}, "
                f"chunk {self.ulysses_rank})")


def pooled_offload_refusal(mode: str) -> str:
    """The message that refuses an offload mode on a LingBot Parallel pipe."""
    return (f"offload mode {mode!r} does not run on LingBot Parallel's workers (each device holds its own DiT): "
            "use offload 'none' or 'auto' (which picks 'none' there) after LingBot Parallel, or connect the pipe "
            "without LingBot Parallel to offload on one device")
