"""Extending a video: peak CPU memory of 1 and 3 segments against one text-to-video clip, on CPU.

Why: extension claims the memory of one segment however many segments run. Side by side in one
process, on the same tiny checkpoint and geometry, the torch CPU bytes each call adds at its peak
(`_common.cpu_peak_bytes`, net of the weights and inputs):

- `t2v clip` (baseline): `stages.denoise` + `stages.decode` of one clip of `frames` frames;
- `extend 1` / `extend 3`: `extend.extend_video` adding 1 and 3 segments of `frames` frames to a
  clip of `frames` frames (k=1).

The joined video is returned whole, so its frames grow with the segments; the table shows the
peak, the joined output's bytes and the peak less the output (the working memory), which should
not grow from 1 to 3 segments.

    python bench/extend_memory.py            # 64x64, 17 frames per segment
    python bench/extend_memory.py --quick    # 32x32, 9 frames (smoke test)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench._common import cpu_peak_bytes, environment, fmt_bytes, run_main, table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="32x32, 9 frames per segment (smoke test)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lingbot_core import extend, stages
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.tiny import build_tiny_checkpoint

    torch.set_num_threads(args.threads)
    size, frames = (32, 9) if args.quick else (64, 17)
    run_kw = dict(steps=args.steps, shift=3.0, guidance_scale=1.0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lingbot-bench-") as tmp:
        handle = PipelineHandle.open(build_tiny_checkpoint(Path(tmp) / "tiny-dense", "dense", seed=0), device="cpu")
        cond = stages.encode_prompt(handle, "a boat", None)
        clip = torch.rand(frames, size, size, 3, generator=torch.Generator().manual_seed(0))

        def t2v():
            latents = stages.denoise(handle, cond, height=size, width=size, num_frames=frames, seed=1, **run_kw)
            return stages.decode(handle, latents)

        stages.decode(handle, stages.denoise(handle, cond, height=size, width=size, num_frames=frames, seed=1,
                                             **run_kw))  # every component loaded before anything is counted
        peak, out = cpu_peak_bytes(t2v)
        rows.append({"run": "t2v clip (baseline)", "peak": peak, "output": out.nbytes, "frames": out.shape[0]})
        for segments in (1, 3):
            peak, out = cpu_peak_bytes(lambda n=segments: extend.extend_video(
                handle, clip, cond, segments=n, k=1, num_frames=frames, seed=1, **run_kw))
            rows.append({"run": f"extend {segments}", "peak": peak, "output": out.nbytes, "frames": out.shape[0]})
    for row in rows:
        row["working"] = row["peak"] - row["output"]
    return {"benchmark": "extend_memory", "geometry": {"size": size, "frames": frames}, "rows": rows,
            "environment": environment()}


def report(result: dict[str, Any]) -> str:
    g = result["geometry"]
    head = f"tiny dense, {g['size']}x{g['size']}, {g['frames']} frames per segment, CPU fp32, torch CPU bytes"
    rows = [[r["run"], r["frames"], fmt_bytes(r["peak"]), fmt_bytes(r["output"]), fmt_bytes(r["working"])]
            for r in result["rows"]]
    return head + "\n" + table(["run", "frames out", "peak", "output", "peak - output"], rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_main(parse_args, run, report, argv)


if __name__ == "__main__":
    main()
