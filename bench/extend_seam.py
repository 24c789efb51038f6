"""Extending a video: how big the step at each seam is against the steps inside the segments, for
each k (latent frames a segment is conditioned on) and each overlap mode (drop, blend), on CPU.

What it can say: on the tiny random-weight checkpoint (the only one a CPU run has), whether a seam
is a step like the others (`seam / inner` near 1) or a jump, and how that moves with k and with
blending. What it cannot say: anything about quality on real weights. The tiny DiT has random
weights, so its "motion" is not motion; these rows check the plumbing (the condition is pinned
and handed over, the blend spreads the step) and give a baseline to rerun on real weights. The
input is a smooth drift (a sine pattern moving one pixel per frame), so its own steps are small
and even.

Per row: `seam` is the mean absolute pixel change from the last frame before a seam to the first
new frame after it (mean over the seams), `inner` the median change between consecutive new
frames inside the segments, `seam / inner` their ratio, and `input` the input's own step.

    python bench/extend_seam.py --threads 1            # 64x64, 17 frames per segment, k 1..4
    python bench/extend_seam.py --quick --threads 1    # 32x32, 9 frames, k 1..2 (smoke test)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench._common import environment, fmt, run_main, table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--segments", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="32x32, 9 frames per segment, k 1..2 (smoke test)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p.parse_args(argv)


def drift(frames: int, size: int) -> torch.Tensor:
    """A sine pattern moving one pixel right per frame, [F,H,W,3] in 0..1 (8-bit levels)."""
    x = torch.arange(size, dtype=torch.float32)
    rows = []
    for t in range(frames):
        wave = 0.5 + 0.4 * torch.sin(2 * math.pi * (x - t) / 16)
        rows.append(torch.stack([wave, wave.flip(0), torch.full_like(wave, 0.5)], -1).expand(size, size, 3))
    return torch.stack(rows).mul(255).round().div(255)


def steps_of(frames: torch.Tensor) -> torch.Tensor:
    """Mean absolute change between consecutive frames, one value per step."""
    return (frames[1:] - frames[:-1]).abs().mean(dim=(1, 2, 3))


def seam_row(joined: torch.Tensor, clip: torch.Tensor, new: int, segments: int) -> dict[str, float]:
    """The step at each seam (into frame `len(clip) + i * new`) against the median step inside the
    segments, and the input clip's own mean step."""
    changes = steps_of(joined)
    seams = [len(clip) + i * new - 1 for i in range(segments)]  # step index s: frame s -> s + 1
    inner = [s for s in range(len(clip), len(changes)) if s not in seams]
    seam = float(changes[seams].mean())
    inside = float(changes[inner].median()) if inner else float("nan")
    return {"seam": seam, "inner": inside, "ratio": seam / inside if inside > 0 else float("inf"),
            "input": float(steps_of(clip).mean())}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lingbot_core import extend, stages
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.tiny import build_tiny_checkpoint

    torch.set_num_threads(args.threads)
    size, frames = (32, 9) if args.quick else (64, 17)
    ks = range(1, (frames - 1) // 4 + 1)  # every k a segment of `frames` frames allows
    rows = []
    with tempfile.TemporaryDirectory(prefix="lingbot-bench-") as tmp:
        handle = PipelineHandle.open(build_tiny_checkpoint(Path(tmp) / "tiny-dense", "dense", seed=0), device="cpu")
        cond = stages.encode_prompt(handle, "a pattern drifting to the right", None)
        clip = drift(frames, size)
        for k in ks:
            for mode in extend.OVERLAP_MODES:
                joined = extend.extend_video(handle, clip, cond, segments=args.segments, k=k, num_frames=frames,
                                             steps=args.steps, shift=3.0, guidance_scale=1.0, seed=1,
                                             overlap_mode=mode)
                new = frames - extend.overlap_frames(k)
                rows.append({"k": k, "mode": mode, "frames": int(joined.shape[0]),
                             **seam_row(joined, clip, new, args.segments)})
    return {"benchmark": "extend_seam", "geometry": {"size": size, "frames": frames, "steps": args.steps,
                                                     "segments": args.segments},
            "rows": rows, "environment": environment()}


def report(result: dict[str, Any]) -> str:
    g = result["geometry"]
    head = (f"tiny dense (random weights: plumbing, not quality), {g['size']}x{g['size']}, {g['frames']} frames per "
            f"segment, {g['segments']} segments, {g['steps']} steps, CPU fp32; mean |pixel change| per frame step")
    rows = [[r["k"], r["mode"], r["frames"], fmt(r["input"]), fmt(r["inner"]), fmt(r["seam"]), fmt(r["ratio"])]
            for r in result["rows"]]
    return head + "\n" + table(["k", "overlap", "frames out", "input", "inner", "seam", "seam / inner"], rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_main(parse_args, run, report, argv)


if __name__ == "__main__":
    main()
