"""The spawned side of tests/test_jobs.py, in a module of its own so each spawned process imports
only this, lingbot_core.parallel.jobs and torch.distributed (not the node pack)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from lingbot_core.parallel.jobs import Job, Manifest, read_jobs, run_jobs, world_place
from lingbot_core.parallel.launch import init_loopback_group


def run_share(rank: int, world: int, port: int, folder: str) -> None:
    """One gloo rank: its share of `folder`/jobs.jsonl (seed 13 fails) into the shared m.jsonl."""
    init_loopback_group(rank, world, port)
    try:
        place = world_place()

        def run_one(job: Job) -> list[str]:
            if job.values.get("seed") == 13:
                raise RuntimeError("unlucky seed")
            path = Path(folder, f"{job.id}.txt")
            path.write_text(str(place.rank))
            return [str(path)]

        run_jobs(read_jobs(Path(folder, "jobs.jsonl")), run_one, Manifest(Path(folder, "m.jsonl")), place=place)
    finally:
        dist.destroy_process_group()


def run_parallel_cli(rank: int, world: int, port: int, folder: str, model: str) -> None:
    """`lingbot-run t2i --parallel cfg=1,ulysses=2 --jobs` on this rank, as torchrun would start it (its
    environment variables; the CLI finds the group initialised and leaves it at the end). What the
    rank printed and its exit code go to `folder`/rank<N>.json."""
    import contextlib
    import io
    import json
    import os

    import torch

    from lingbot_nodes.cli import main

    torch.set_num_threads(1)
    init_loopback_group(rank, world, port)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            code = main(["t2i", "--model", model, "--parallel", "cfg=1,ulysses=2", "-q",
                         "--jobs", str(Path(folder, "jobs.jsonl")), "--output", str(Path(folder, "out"))])
        Path(folder, f"rank{rank}.json").write_text(json.dumps({"code": code, "printed": printed.getvalue().split()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
