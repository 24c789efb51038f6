"""One guided denoise step (cond + uncond DiT forwards) on 1 and 2 processes: CPU time ratios.

Why: issue 24's sequence parallel (Ulysses) and CFG parallel are meant to cut the time of one
video on several GPUs. This script runs the same random-weight DiT and inputs as
- one process (the baseline, in this process),
- ulysses=2: two spawned gloo processes sharing each forward's sequence,
- cfg=2: two spawned gloo processes, one computing cond and one uncond,
- ulysses=2 with FSDP (each block's weights sharded over the two processes, gathered per block),
- with `--processes 4`: ulysses=4, cfg=2 x ulysses=2, and cfg=2 x ulysses=2 with FSDP on four processes,
checks each parallel result against the baseline and prints per-step time ratios.

On a CPU both processes compete for the same cores and gloo copies through the loopback, so the
ratios are informative only (they show the overhead, not a GPU speed-up). On a machine with GPUs,
`--device cuda` runs the same on NCCL (one GPU per rank); that table is "not run" so far.

    python bench/parallel.py                 # dense, hidden 256, 4 heads, 1600 video + 64 text tokens
    python bench/parallel.py --moe           # MoE FFN (8 experts top-2)
    python bench/parallel.py --quick         # tiny sizes (the smoke test)
    python bench/parallel.py --estimates     # per-GPU memory estimates of the layouts (arithmetic, no processes)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

import torch

from bench._common import environment, fmt, max_abs_diff, print_machine, random_dit, table, write_json

#: the layouts timed against the one-process baseline: (label, cfg, ulysses, fsdp); `--processes` caps the world
LAYOUTS = (("ulysses=2", 1, 2, False), ("cfg=2", 2, 1, False), ("ulysses=2 + FSDP", 1, 2, True),
           ("ulysses=4", 1, 4, False), ("cfg=2 x ulysses=2", 2, 2, False), ("cfg=2 x ulysses=2 + FSDP", 2, 2, True))
TOLERANCE = 1e-5  # float32, relative to the baseline's largest magnitude


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--latent", default="1,16,4,20,40", help="B,C,T,H,W of the DiT-space latent")
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--moe", action="store_true", help="MoE FFN (8 experts, top-2, one shared expert)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per layout (after one warm-up)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--processes", type=int, default=2, choices=(2, 4), help="largest world timed (4 adds ulysses=4 "
                   "and cfg=2 x ulysses=2)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: NCCL, one GPU per rank")
    p.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--estimates", action="store_true", help="print the per-GPU memory estimates of the MoE at "
                   "832x480, 121 frames under each layout (the README's figures) and exit")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.heads, args.depth, args.latent, args.text_tokens, args.repeats = 64, 4, 1, "1,16,1,4,6", 7, 1
    return args


def dit_config(args: argparse.Namespace) -> dict[str, Any]:
    head_dim = args.hidden // args.heads
    t_axis = head_dim - 2 * (3 * head_dim // 8)
    cfg: dict[str, Any] = dict(hidden_size=args.hidden, num_attention_heads=args.heads, depth=args.depth,
                               intermediate_size=3 * args.hidden, text_dim=32, freq_dim=32,
                               axes_dims=(t_axis, 3 * head_dim // 8, 3 * head_dim // 8), axes_lens=(64, 64, 64))
    if args.moe:
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=args.hidden // 2, n_shared_experts=1)
    return cfg


def _setup(args: argparse.Namespace, device: torch.device):
    from types import SimpleNamespace

    model = random_dit(dit_config(args), 0.05)
    model.to(device)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(*map(int, args.latent.split(",")), generator=g).to(device)
    prompts = [SimpleNamespace(embeds=torch.randn(1, n, 32, generator=g).to(device),
                               mask=torch.ones(1, n, dtype=torch.int64, device=device))
               for n in (args.text_tokens, max(1, args.text_tokens // 2))]
    return model, latents, prompts


def _time_steps(predict, latents: torch.Tensor, repeats: int, device: torch.device, barrier=None):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if barrier is not None:
            barrier()

    out = predict(latents, torch.tensor(650.0))  # warm-up (and the result that is checked)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        predict(latents, torch.tensor(650.0))
        sync()
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, cfg: int, ulysses: int, fsdp: bool,
            out: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from lingbot_core.distributed import ParallelGuidance, ParallelLayout, enable_sequence_parallel
    from lingbot_core.distributed.launch import init_loopback_group
    from lingbot_core.sampling.guidance import Guidance

    torch.set_num_threads(args.threads)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_loopback_group(rank, world, port, backend="nccl" if device.type == "cuda" else "gloo")
    try:
        layout = ParallelLayout.create(cfg, ulysses, device_type=device.type, fsdp=fsdp)
        model, latents, (pos, neg) = _setup(args, device)
        if fsdp:
            from lingbot_core.distributed.fsdp import shard_dit

            shard_dit(model, layout)
        enable_sequence_parallel(model, layout)
        common = dict(dtype=torch.float32, device=device)
        if cfg == 2:
            guidance: Guidance = ParallelGuidance(model, pos, neg, 4.0, layout=layout, **common)
        else:
            guidance = Guidance(model, pos, neg, 4.0, **common)
        result, seconds = _time_steps(guidance.predict, latents, args.repeats, device, barrier=dist.barrier)
        if rank == 0:
            save_file({"v": result.cpu().contiguous(), "seconds": torch.tensor([seconds], dtype=torch.float64)},
                      str(Path(out, "rank0.safetensors")))
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from lingbot_core.distributed.launch import free_loopback_port
    from lingbot_core.sampling.guidance import Guidance

    torch.set_num_threads(args.threads)
    print_machine()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    model, latents, (pos, neg) = _setup(args, device)
    guidance = Guidance(model, pos, neg, 4.0, dtype=torch.float32, device=device)
    baseline, base_seconds = _time_steps(guidance.predict, latents, args.repeats, device)
    del model, guidance
    rows = [{"layout": "1 process", "processes": 1, "seconds_per_step": base_seconds, "ratio": 1.0, "rel_diff": 0.0}]
    scale = float(baseline.abs().max())
    for label, cfg, ulysses, fsdp in LAYOUTS:
        if cfg * ulysses > args.processes:
            continue
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_worker, args=(cfg * ulysses, free_loopback_port(), args, cfg, ulysses, fsdp, out),
                     nprocs=cfg * ulysses, join=True)
            got = load_file(str(Path(out, "rank0.safetensors")))
        seconds = float(got["seconds"][0])
        rows.append({"layout": label, "processes": cfg * ulysses, "seconds_per_step": seconds,
                     "ratio": seconds / base_seconds, "rel_diff": max_abs_diff(got["v"], baseline.cpu()) / scale})
    return {"config": dit_config(args), "latent": args.latent, "text_tokens": args.text_tokens,
            "device": args.device, "environment": environment(), "rows": rows}


#: the layouts of the estimate table: (cfg, ulysses, fsdp)
ESTIMATE_LAYOUTS = ((1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False), (2, 4, False), (2, 4, True),
                    (1, 8, True))


def estimates() -> list[dict[str, Any]]:
    """Per-GPU peak estimates (`ParallelShare.peak`, the figure `auto` prints) of the real MoE config at
    832x480, 121 frames, untiled decode: rank 0 (encodes and decodes too) and the other ranks."""
    from bench.memory_table import build
    from lingbot_core.placement import estimate
    from lingbot_core.placement.estimate import ParallelShare

    sizes = estimate.ModelSizes.from_modules(build("moe"))
    geometry = estimate.Geometry(height=480, width=832, num_frames=121)
    rows = []
    for cfg, ulysses, fsdp in ESTIMATE_LAYOUTS:
        share = ParallelShare(cfg, ulysses, fsdp)
        rows.append({"layout": f"cfg={cfg},ulysses={ulysses}" + (" --fsdp" if fsdp else ""), "processes": cfg * ulysses,
                     "rank0_gib": share.peak(sizes, geometry) / 2**30,
                     "others_gib": share.peak(sizes, geometry, leader=False) / 2**30 if cfg * ulysses > 1 else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.estimates:
        rows = estimates()
        print("MoE 30B-A3B, 832x480, 121 frames: per-GPU peak estimate (offload none; GiB)")
        print(table(["layout", "processes", "rank 0", "other ranks"],
                    [[r["layout"], str(r["processes"]), f"{r['rank0_gib']:.1f}",
                      "-" if r["others_gib"] is None else f"{r['others_gib']:.1f}"] for r in rows]))
        write_json(args.json, {"estimates": rows})
        return 0
    result = run(args)
    print(f"guided step (cond + uncond forwards), {args.device}, latent {args.latent}, "
          f"{args.text_tokens} text tokens, {'MoE' if args.moe else 'dense'}, {args.threads} thread(s) per process")
    print(table(["layout", "processes", "s/step", "time vs 1 process", "max rel diff"],
                [[r["layout"], str(r["processes"]), fmt(r["seconds_per_step"]), fmt(r["ratio"]), fmt(r["rel_diff"])]
                 for r in result["rows"]]))
    bad = [r["layout"] for r in result["rows"] if not r["rel_diff"] <= TOLERANCE]
    if bad:
        print(f"MISMATCH against one process (> {TOLERANCE}): {', '.join(bad)}")
    write_json(args.json, result)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
