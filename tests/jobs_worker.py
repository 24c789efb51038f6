"""The spawned side of tests/test_jobs.py, in a module of its own so each spawned process imports
only this, lingbot_nodes.jobs and torch.distributed (not the node classes)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from lingbot_core.distributed.launch import init_loopback_group
from lingbot_nodes.jobs import Job, Manifest, read_jobs, run_jobs, world_place


def run_share(rank: int, world: int, port: int, folder: str) -> None:
    """One gloo rank: its share of `folder`/jobs.jsonl (seed 13 fails) into its own file of manifest m.jsonl."""
    init_loopback_group(rank, world, port)
    try:
        place = world_place()

        def run_one(job: Job) -> list[str]:
            if job.values.get("seed") == 13:
                raise RuntimeError("unlucky seed")
            path = Path(folder, f"{job.id}.txt")
            path.write_text(str(place.rank))
            return [str(path)]

        run_jobs(read_jobs(Path(folder, "jobs.jsonl")), run_one, Manifest(Path(folder, "m.jsonl"), place.writer),
                 place=place)
    finally:
        dist.destroy_process_group()


def finish_share(rank: int, world: int, port: int, folder: str) -> None:
    """`finish_together` on a gloo world: the last rank stops early (`stopped`), the others finish with
    one failed job each; what each returned goes to `folder`/finish<N>.txt. (Rank 0 holds the store
    here, as torchrun's agent does there, so it must not be the one that leaves.)"""
    from lingbot_nodes.jobs import finish_together

    init_loopback_group(rank, world, port)
    try:
        total = finish_together(0, stopped=True) if rank == world - 1 else finish_together(1, poll_s=0.05)
        Path(folder, f"finish{rank}.txt").write_text(str(total))
    finally:
        dist.destroy_process_group()


def run_parallel_cli(rank: int, world: int, ports: list[int], folder: str, runs: list[list[str]],
                     nodes: int = 1) -> None:
    """`lingbot-run ... --jobs` once per entry of `runs` (its arguments) on this rank, as torchrun would
    start it: its environment variables, the CLI joining the group from them (env://, a port per
    run: each run leaves the group at its end). `nodes` > 1 spreads the ranks over that many pretend
    nodes round-robin (GROUP_RANK = rank % nodes, LOCAL_RANK = rank // nodes), so the video groups,
    kept inside nodes, are not runs of consecutive ranks. What each run printed and its exit code
    go to `folder`/rank<N>.json, with when it started and returned (time.time())."""
    import contextlib
    import io
    import json
    import os
    import time

    import torch

    from lingbot_nodes.cli import main

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank // nodes),
                      LOCAL_WORLD_SIZE=str(world // nodes), GROUP_RANK=str(rank % nodes), MASTER_ADDR="127.0.0.1",
                      GLOO_SOCKET_IFNAME="lo")
    results = []
    try:
        for port, args in zip(ports, runs, strict=True):
            os.environ["MASTER_PORT"] = str(port)
            printed = io.StringIO()
            started = time.time()
            with contextlib.redirect_stdout(printed):
                code = main(args)
            results.append({"code": code, "printed": printed.getvalue().split(), "started": started,
                            "returned": time.time()})
        Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def sigterm_in_jobs(under_torchrun: bool) -> None:
    """Send this process SIGTERM inside the CLI's jobs guard: exit 7 when it arrived as an interrupt."""
    import os
    import signal
    import time

    from lingbot_nodes.cli import _sigterm_interrupts

    try:
        with _sigterm_interrupts(under_torchrun):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here (or the default action has ended the process)
    except KeyboardInterrupt:
        os._exit(7)
    os._exit(0)


def claim_share(folder: str, name: str) -> None:
    """One of two processes running the whole of `folder`/jobs.jsonl into one manifest at once: each
    job it runs takes 0.05 s and is written to `folder`/ran-<name>.txt."""
    import time

    def run_one(job: Job) -> list[str]:
        with open(Path(folder, f"ran-{name}.txt"), "a") as f:
            f.write(job.id + "\n")
        time.sleep(0.05)
        return []

    run_jobs(read_jobs(Path(folder, "jobs.jsonl")), run_one, Manifest(Path(folder, "m.jsonl")))
