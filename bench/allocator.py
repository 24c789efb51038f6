"""glibc's default mmap threshold against `lingbot_core.allocator.tune_for_cpu`: one real-width DiT
block's forward on the CPU, in child processes alternating default / tuned (A B A B ...).

The allocator's settings hold for a whole process, so each side runs in its own child: the same
random-weight bf16 block (hidden 2048, 16 heads, FFN 6144; `--kind moe`: the MoE block) and inputs,
one warm-up forward, then `--repeats` timed forwards (best reported), and the child's peak RSS. The
ratio is default time / tuned time per token count (above 1: tuning is faster).

    python bench/allocator.py --tokens 5120 --pairs 2 --repeats 2 --threads 2
    python bench/allocator.py --quick                                  # tiny sizes (the smoke test)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

SIDES = ("default", "tuned")


def child(side: str, kind: str, tokens: int, repeats: int, threads: int, quick: bool) -> dict[str, Any]:
    if side == "tuned":
        from lingbot_core.allocator import tune_for_cpu

        said = tune_for_cpu("cpu")
        assert said == "set", said
    import torch

    from bench.speed_dit import build_model, dit_config, dit_inputs

    torch.set_num_threads(threads)
    model = build_model(kind, 1, quick)
    inputs = dit_inputs(dit_config(kind, 1, quick), tokens, 64)
    best = float("inf")
    with torch.inference_mode():
        model(*inputs)
        for _ in range(repeats):
            start = time.perf_counter()
            model(*inputs)
            best = min(best, time.perf_counter() - start)
    return {"side": side, "seconds": best, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for tokens in args.tokens:
        times: dict[str, list[float]] = {s: [] for s in SIDES}
        rss: dict[str, float] = {s: 0.0 for s in SIDES}
        for _ in range(args.pairs):
            for side in SIDES:
                cmd = [sys.executable, __file__, "--child", side, args.kind, str(tokens), str(args.repeats),
                       str(args.threads)] + (["--quick"] if args.quick else [])
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                got = json.loads(out.strip().splitlines()[-1])
                times[side].append(got["seconds"])
                rss[side] = max(rss[side], got["peak_rss_mb"])
        default, tuned = min(times["default"]), min(times["tuned"])
        rows.append({"tokens": tokens, "default_s": default, "tuned_s": tuned, "default_x_tuned": default / tuned,
                     "pairs": [list(p) for p in zip(times["default"], times["tuned"])],
                     "default_rss_mb": rss["default"], "tuned_rss_mb": rss["tuned"]})
        print(f"{tokens} tokens: default {default:.3f} s, tuned {tuned:.3f} s, default / tuned {default / tuned:.3f} "
              f"(pairs {rows[-1]['pairs']}); peak RSS {rss['default']:.0f} / {rss['tuned']:.0f} MB", flush=True)
    return {"kind": args.kind, "threads": args.threads, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=("dense", "moe"), default="dense")
    p.add_argument("--tokens", type=int, nargs="+", default=[5120], help="video tokens (one row each)")
    p.add_argument("--pairs", type=int, default=2, help="default/tuned child pairs per row")
    p.add_argument("--repeats", type=int, default=2, help="timed forwards per child (best kept)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.child:
        side, kind, tokens, repeats, threads = args.child
        print(json.dumps(child(side, kind, int(tokens), int(repeats), int(threads), args.quick)))
        return 0
    import torch

    from bench._common import environment, print_machine, write_json

    torch.set_num_threads(args.threads)
    print_machine()
    result = run(args)
    write_json(args.json, {"environment": environment(), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
