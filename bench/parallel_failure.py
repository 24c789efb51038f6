"""One rank raising inside a DiT forward: how long until every rank of the group stopped, and what each said.

Why: issue 24 asks that a failing rank gives a clear error instead of leaving the others waiting in
a collective until the process group's timeout (minutes). `lingbot_core.distributed.abort` makes the
failing rank publish its error in the group's store and leave; the others' collectives then fail
(gloo) or are aborted by their watch thread (NCCL), and each raises `GroupBroken` naming the first
failure. This script runs `parallel_denoise` over a random-weight DiT on N spawned processes, with
the store held by this process as torchrun's agent holds it, and one rank raising inside its forward
(a patch of the DiT block's forward in that process only: nothing a workflow can set). It prints,
per rank, its exit code, how long after the failure it stopped and what it raised; exit code 1 when
a rank did not stop within --limit seconds or does not name the failing rank.

On CPU (gloo) this is what tests/test_parallel.py checks on four processes. With `--device cuda`
(NCCL, one GPU per rank) it is the check the CPU cannot make: the watch thread's
`_abort_process_group` ending a pending NCCL collective, and torch's NCCL watchdog
(TORCH_NCCL_ASYNC_ERROR_HANDLING, default 3 = end the process after an abort or timeout; an exit
code of -6 then means the watchdog ended the rank before it reported). Not run on GPUs yet.

    python bench/parallel_failure.py                                   # 4 CPU processes, cfg=2 x ulysses=2
    python bench/parallel_failure.py --device cuda --processes 8 --cfg 2
    python bench/parallel_failure.py --device cuda --nccl-error-handling 2   # abort, never end the process
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

import torch

from bench._common import environment, fmt, random_dit, table, write_json

DIT = dict(hidden_size=64, num_attention_heads=4, depth=2, intermediate_size=96, text_dim=32, freq_dim=32,
           axes_dims=(4, 6, 6), axes_lens=(64, 32, 32))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--processes", type=int, default=4, help="world size (cfg x ulysses)")
    p.add_argument("--cfg", type=int, default=2, choices=(1, 2))
    p.add_argument("--failing-rank", type=int, default=1)
    p.add_argument("--block-call", type=int, default=2, help="the failing rank's block forward that raises (1 = the "
                   "first block of the first forward)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: NCCL, one GPU per rank")
    p.add_argument("--group-timeout", type=float, default=600.0, help="the process group's timeout (s): far above "
                   "what the ranks take to stop, so a stop is never the timeout's")
    p.add_argument("--limit", type=float, default=60.0, help="seconds every rank must stop within")
    p.add_argument("--nccl-error-handling", default=None, help="TORCH_NCCL_ASYNC_ERROR_HANDLING for the ranks "
                   "(unset: torch's default)")
    p.add_argument("--start-method", default=None, choices=("fork", "spawn"), help="default: fork on CPU, spawn "
                   "with CUDA")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.processes % args.cfg or not 0 <= args.failing_rank < args.processes:
        p.error("--processes must be a multiple of --cfg and --failing-rank one of the ranks")
    return args


def _inject(rank: int, call: int, marks: dict[str, float]) -> None:
    """This process only: the DiT block's forward raises at its `call`-th run on `rank`."""
    import torch.distributed as dist

    from lingbot_core.models.transformer import JointBlock

    original, calls = JointBlock.forward, [0]

    def forward(self, *a, **kw):
        if dist.get_rank() == rank:
            calls[0] += 1
            if calls[0] == call:
                marks["raised"] = time.monotonic()
                raise RuntimeError(f"bench: injected failure inside the forward on rank {rank}")
        return original(self, *a, **kw)

    JointBlock.forward = forward


def _worker(rank: int, args: argparse.Namespace, store_port: int, out: str) -> None:
    import torch.distributed as dist

    from lingbot_core.distributed import ParallelLayout
    from lingbot_core.prompt import PromptEmbeds
    from lingbot_core.stages import Conditioning
    from lingbot_core.worker_pool.run import parallel_denoise, wrap_dit

    torch.set_num_threads(1)
    if args.nccl_error_handling is not None:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = args.nccl_error_handling
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", store_port, args.processes, False, timedelta(seconds=60))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=args.processes, timeout=timedelta(seconds=args.group_timeout))
    marks: dict[str, float] = {}
    result: dict[str, Any] = {"rank": rank}
    try:
        layout = ParallelLayout.create(args.cfg, args.processes // args.cfg, device_type=device.type)
        g = torch.Generator().manual_seed(4)
        embeds = PromptEmbeds(torch.randn(1, 7, 32, generator=g), torch.ones(1, 7, dtype=torch.int64),
                              torch.zeros(1, 1, dtype=torch.int64))
        handle = wrap_dit(random_dit(DIT, 0.05), device=device)  # the stages move the DiT to the rank's device
        latents = torch.randn(1, 16, 2, 4, 6, generator=g)
        _inject(args.failing_rank, args.block_call, marks)
        dist.barrier()
        try:
            parallel_denoise(handle, layout, latents, Conditioning(embeds, embeds), steps=args.steps, guidance_scale=3.0)
            result.update(error=None)
        except Exception as err:
            result.update(error=type(err).__name__, message=" ".join(str(err).split()))
        result.update(stopped=time.monotonic(), raised=marks.get("raised"))
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        # then leave: the process ends, which is what frees the ranks waiting on this one under gloo


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from lingbot_core.distributed.launch import loopback_store

    method = args.start_method or ("spawn" if args.device == "cuda" or torch.cuda.is_initialized() else "fork")
    ctx = mp.get_context(method)
    store = loopback_store(0, args.processes, server=True)  # torchrun's agent's part
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_worker, args=(r, args, store.port, out), daemon=True)
                 for r in range(args.processes)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + args.group_timeout + 120
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        found = {r: json.loads(Path(out, f"rank{r}.json").read_text())
                 for r in range(args.processes) if Path(out, f"rank{r}.json").is_file()}
    raised = found.get(args.failing_rank, {}).get("raised")
    rows = []
    for rank, proc in enumerate(procs):
        got = found.get(rank, {})
        after = got["stopped"] - raised if raised is not None and "stopped" in got else None
        rows.append({"rank": rank, "exit_code": proc.exitcode, "stopped_after_s": after, "error": got.get("error"),
                     "message": got.get("message")})
    return {"processes": args.processes, "cfg": args.cfg, "failing_rank": args.failing_rank, "device": args.device,
            "group_timeout_s": args.group_timeout, "start_method": method, "environment": environment(), "rows": rows}


def verdicts(result: dict[str, Any], limit: float) -> list[str]:
    """What went wrong: a rank that did not stop within `limit` s or does not name the failing rank."""
    named = f"rank {result['failing_rank']} ("
    bad = []
    for row in result["rows"]:
        if row["stopped_after_s"] is None or row["stopped_after_s"] > limit:
            bad.append(f"rank {row['rank']} did not report a stop within {limit:.0f} s (exit code {row['exit_code']})")
        elif row["error"] != "GroupBroken" or named not in (row["message"] or ""):
            bad.append(f"rank {row['rank']} raised {row['error']}, not GroupBroken naming rank {result['failing_rank']}")
    return bad


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(f"{args.processes} processes ({args.device}), cfg={args.cfg}; rank {args.failing_rank} raises inside a "
          f"forward; group timeout {args.group_timeout:.0f} s")
    print(table(["rank", "exit code", "stopped after (s)", "raised"],
                [[str(r["rank"]), str(r["exit_code"]), fmt(r["stopped_after_s"]), (r["message"] or "-")[:110]]
                 for r in result["rows"]]))
    bad = verdicts(result, args.limit)
    for line in bad:
        print("FAILED:", line)
    write_json(args.json, {**result, "verdicts": bad})
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
