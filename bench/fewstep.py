"""Few-step recipes against the 40-step CFG baseline: DiT calls and wall time, on CPU.

Why: few-step sampling is the biggest speed lever there is, and its gain should be a measured
figure, not arithmetic. Three recipes run side by side in one process, round-robin per repeat,
on the same handle and seed:

- `40-step CFG`:     flow_unipc, 40 steps, cfg 3.0 (a positive and a negative forward per step);
- `8-step DMD`:      dmd_student, 8 steps, cfg 1.0 (no negative encoded, one forward per step);
- `4-step CFG-free`: euler, 4 steps, cfg 1.0 (the LightLingBot 4-step LoRA's trained recipe; with
                      flow_unipc instead the DiT cost is identical).

Reported per recipe: DiT forwards, text-encoder passes, and median wall time of the denoise
stage and of the whole `generate` (text + denoise + decode), each as a ratio to the baseline.
The checkpoint is `bench/generate.py`'s `mid` config (its random DiT, hidden 256, depth 4; tiny
Qwen3-VL and VAE) at 128x128, 17 frames. The weights are random, so this measures cost only.

    python bench/fewstep.py                 # mid, 2 repeats
    python bench/fewstep.py --repeats 3 --json out.json
    python bench/fewstep.py --quick         # tiny checkpoint, 32x32x5, 1 repeat (smoke test)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench._common import environment, fmt, run_main, table
from bench.generate import PROMPT, build_mid_checkpoint

RECIPES = {  # name -> (sampler, steps, cfg)
    "40-step CFG": ("flow_unipc", 40, 3.0),
    "8-step DMD": ("dmd_student", 8, 1.0),
    "4-step CFG-free": ("euler", 4, 1.0),
}
BASELINE = "40-step CFG"


class CallCounter:
    """Counts forwards of a module (a hook; nothing else changes)."""

    def __init__(self, module: torch.nn.Module):
        self.n = 0
        self._hook = module.register_forward_pre_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.n += 1

    def close(self) -> None:
        self._hook.remove()


def bench(folder: Path, geometry: tuple[int, int, int], repeats: int, seed: int) -> dict[str, Any]:
    from lingbot_core import stages
    from lingbot_core.handle import PipelineHandle

    height, width, frames = geometry
    handle = PipelineHandle.open(folder, device="cpu")
    geo = dict(height=height, width=width, num_frames=frames, seed=seed)

    def one(recipe: str) -> dict[str, float]:
        sampler, steps, cfg = RECIPES[recipe]
        dit = CallCounter(handle.component("transformer"))
        text = CallCounter(handle.component("text_encoder").model)
        try:
            t0 = time.perf_counter()
            cond = stages.encode_prompt(handle, PROMPT, "" if cfg > 1 else None)
            t1 = time.perf_counter()
            latents = stages.denoise(handle, cond, steps=steps, guidance_scale=cfg, sampler=sampler, **geo)
            t2 = time.perf_counter()
            stages.decode(handle, latents)
            t3 = time.perf_counter()
        finally:
            dit.close()
            text.close()
        return {"dit_calls": dit.n, "text_passes": text.n, "denoise_s": t2 - t1, "generate_s": t3 - t0}

    for recipe in RECIPES:  # warm-up: loads components, lazy tables
        one(recipe)
    samples: dict[str, list[dict[str, float]]] = {r: [] for r in RECIPES}
    for _ in range(repeats):
        for recipe in RECIPES:
            samples[recipe].append(one(recipe))
    med = {r: {k: statistics.median(s[k] for s in v) for k in v[0]} for r, v in samples.items()}
    base = med[BASELINE]
    rows = []
    for recipe, m in med.items():
        sampler, steps, cfg = RECIPES[recipe]
        rows.append({"recipe": recipe, "sampler": sampler, "steps": steps, "cfg": cfg, **m,
                     "dit_calls_ratio": m["dit_calls"] / base["dit_calls"],
                     "denoise_speedup": base["denoise_s"] / m["denoise_s"],
                     "generate_speedup": base["generate_s"] / m["generate_s"],
                     "samples": samples[recipe]})
    dit = handle.shared.loaded["transformer"]
    return {"geometry": {"height": height, "width": width, "num_frames": frames},
            "dit": {"hidden_size": dit.config.hidden_size, "depth": dit.config.depth,
                    "params": sum(p.numel() for p in dit.parameters())},
            "rows": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2, help="timed runs per recipe (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--quick", action="store_true", help="tiny checkpoint, 32x32x5, 1 repeat (smoke test)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lingbot_core.tiny import build_tiny_checkpoint

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="lingbot-bench-") as tmp:
        tiny = build_tiny_checkpoint(Path(tmp) / "tiny-dense", "dense", seed=0)
        if args.quick:
            folder, geometry, repeats = tiny, (32, 32, 5), 1
        else:
            folder = build_mid_checkpoint(tiny, Path(tmp) / "mid-dense", hidden=256, depth=4, heads=4, seed=0)
            geometry, repeats = (128, 128, 17), args.repeats
        result = bench(folder, geometry, repeats, args.seed)
    return {"benchmark": "fewstep", "config": "quick" if args.quick else "mid", "repeats": repeats, **result,
            "environment": environment()}


def report(result: dict[str, Any]) -> str:
    g, d = result["geometry"], result["dit"]
    head = (f"{result['config']}: T2V {g['width']}x{g['height']}x{g['num_frames']}, DiT hidden {d['hidden_size']} "
            f"depth {d['depth']} ({d['params'] / 1e6:.2f} M params), CPU fp32, {result['environment']['threads']} "
            f"threads, median of {result['repeats']}")
    rows = [[r["recipe"], r["sampler"], r["steps"], r["cfg"], r["dit_calls"], r["text_passes"], fmt(r["denoise_s"]),
             fmt(r["generate_s"]), fmt(r["dit_calls_ratio"]), fmt(r["denoise_speedup"]), fmt(r["generate_speedup"])]
            for r in result["rows"]]
    return head + "\n" + table(["recipe", "sampler", "steps", "cfg", "DiT calls", "text passes", "denoise s",
                                "generate s", "calls/base", "denoise x", "generate x"], rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_main(parse_args, run, report, argv)


if __name__ == "__main__":
    main()
