"""T2V through `stages.generate` on CPU: per-stage times and every offload mode against `none`.

Why: offload modes must cost little and change nothing. On a CPU nothing moves (the offload
device is the execution device), so what this measures is the bookkeeping each mode adds (hooks,
per-leaf `meta` swaps, group hooks) and that the frames stay bit-identical; real transfer costs
need `bench/offload_gpu.py` on an accelerator.

Two checkpoints, both random-weight, in the real on-disk layout:
- `tiny`: `lingbot_core.tiny.build_tiny_checkpoint` (DiT hidden 32, depth 2), 64x64, 9 frames, 4 steps;
- `mid`:  the tiny checkpoint with a bigger DiT written over it (hidden 256, depth 4 by default; the
  tiny VAE and Qwen3-VL stay, so the DiT's text_dim stays 32), 128x128, 17 frames, 8 steps.

Every mode runs on a view of the same handle (`offload.configure_offload`), round-robin per repeat,
so machine drift hits all modes alike; installing a mode is not timed (it is reported apart).
One torch thread by default: on a busy 2-core machine two threads made the same run 2-4x slower
and its timings swing by 3x between repeats.

    python bench/generate.py                  # tiny and mid, 3 repeats
    python bench/generate.py --configs mid --repeats 5
    python bench/generate.py --quick          # tiny at 32x32x5, 1 step, 1 repeat (smoke test)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: the checkpoints are built here

import torch

from bench._common import environment, fmt, max_abs_diff, run_main, table
from lingbot_core.placement.modes import MODE_ORDER

MODES = tuple(MODE_ORDER)  # every registered offload mode, fastest first
MODE_OPTIONS: dict[str, dict[str, Any]] = {"group": {"use_stream": False}}  # no streams on CPU
PROMPT = ('{"caption": {"comprehensive_description": {"scene_content_description": "A small red boat drifts on a '
          'calm lake at dawn, mist over the water, pine forest on the far shore.", "camera_movement_description": '
          '"slow pan left"}, "camera_info": {"shot": "wide shot", "lens": "35mm"}}, "duration": 5}')
GEOMETRY = {  # config -> (height, width, frames, steps)
    "tiny": (64, 64, 9, 4),
    "mid": (128, 128, 17, 8),
    "quick": (32, 32, 5, 1),
}


def build_mid_checkpoint(tiny: Path, folder: Path, *, hidden: int, depth: int, heads: int, seed: int) -> Path:
    """The tiny checkpoint with a bigger random DiT in `transformer/` (tiny.py is left alone).

    The text encoder and VAE are the tiny ones, so `text_dim` stays the tiny Qwen's hidden size.
    The tiny marker is dropped: the folder is a valid checkpoint, not a tiny build.
    """
    from lingbot_core import tiny as tiny_mod
    from lingbot_core.models.transformer import LingBotVideoTransformer3DModel

    head_dim = hidden // heads
    if head_dim * heads != hidden or head_dim % 8:
        raise ValueError(f"hidden {hidden} / heads {heads} must give a head_dim that is a multiple of 8")
    t = head_dim // 4 // 2 * 2
    axes = (t, (head_dim - t) // 2 // 2 * 2, head_dim - t - (head_dim - t) // 2 // 2 * 2)
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(tiny, folder, ignore=shutil.ignore_patterns(tiny_mod.TINY_MARKER, "transformer"))
    config = {**tiny_mod._DIT_CONFIG, "hidden_size": hidden, "num_attention_heads": heads, "depth": depth,
              "intermediate_size": 4 * hidden, "freq_dim": 256, "axes_dims": axes}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LingBotVideoTransformer3DModel(**config).eval()
    tiny_mod._randomize(model, seed, "transformer")
    model.save_pretrained(folder / "transformer", safe_serialization=True)
    return folder


def _configure(handle, mode: str):
    from lingbot_core.placement.door import configure_offload

    return configure_offload(handle, mode, **MODE_OPTIONS.get(mode, {}))


def bench_config(name: str, folder: Path, modes: list[str], repeats: int, geometry: tuple[int, int, int, int],
                 seed: int) -> dict[str, Any]:
    """Time generate and the separate stages under every mode on one checkpoint."""
    from lingbot_core import stages
    from lingbot_core.handle import PipelineHandle

    height, width, frames, steps = geometry
    gen_kwargs = dict(mode="t2v", height=height, width=width, num_frames=frames, steps=steps, guidance_scale=3.0,
                      seed=seed)
    handle = PipelineHandle.open(folder, device="cpu")

    def run_generate(view) -> torch.Tensor:
        return stages.generate(view, PROMPT, **gen_kwargs).frames

    def run_stages(view) -> tuple[dict[str, float], torch.Tensor]:
        t0 = time.perf_counter()
        cond = stages.encode_prompt(view, PROMPT, "", mode="t2v")
        t1 = time.perf_counter()
        latents = stages.denoise(view, cond, height=height, width=width, num_frames=frames, steps=steps,
                                 guidance_scale=3.0, seed=seed)
        t2 = time.perf_counter()
        out = stages.decode(view, latents)
        t3 = time.perf_counter()
        return {"text": t1 - t0, "denoise": t2 - t1, "decode": t3 - t2}, out

    samples: dict[str, dict[str, list[float]]] = {
        m: {"install": [], "generate": [], "text": [], "denoise": [], "decode": []} for m in modes}
    frames_out: dict[str, torch.Tensor] = {}
    chain_out: dict[str, torch.Tensor] = {}
    for mode in modes:  # warm-up: loads components once, first hook install, lazy tables
        run_generate(_configure(handle, mode))
    for _ in range(repeats):
        for mode in modes:
            t0 = time.perf_counter()
            view = _configure(handle, mode)
            samples[mode]["install"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            frames_out[mode] = run_generate(view)
            samples[mode]["generate"].append(time.perf_counter() - t0)
            parts, chain_out[mode] = run_stages(view)
            for key, value in parts.items():
                samples[mode][key].append(value)

    med = {m: {k: statistics.median(v) for k, v in s.items()} for m, s in samples.items()}
    ref = "none" if "none" in modes else None
    rows = []
    for mode in modes:
        rows.append({
            "mode": mode,
            **{f"{k}_s": v for k, v in med[mode].items()},
            "generate_ratio_vs_none": med[mode]["generate"] / med[ref]["generate"] if ref else None,
            "stages_ratio_vs_none": (sum(med[mode][k] for k in ("text", "denoise", "decode"))
                                     / sum(med[ref][k] for k in ("text", "denoise", "decode"))) if ref else None,
            "max_abs_diff_vs_none": max_abs_diff(frames_out[mode], frames_out[ref]) if ref else None,
            "max_abs_diff_stages_vs_generate": max_abs_diff(chain_out[mode], frames_out[mode]),
            "samples_s": samples[mode],
        })
    dit = handle.shared.loaded.get("transformer")
    return {
        "config": name,
        "geometry": {"height": height, "width": width, "num_frames": frames, "steps": steps, "guidance_scale": 3.0},
        "dit": {"hidden_size": dit.config.hidden_size, "depth": dit.config.depth,
                "params": sum(p.numel() for p in dit.parameters())} if dit is not None else None,
        "frames_shape": list(frames_out[modes[0]].shape),
        "rows": rows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", default="tiny,mid", help="comma list of tiny, mid")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode (median reported)")
    p.add_argument("--mid-hidden", type=int, default=256)
    p.add_argument("--mid-depth", type=int, default=4)
    p.add_argument("--mid-heads", type=int, default=4)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: what is measured is per-mode overhead, and on a shared 2-core "
                        "machine two OpenMP threads stall for tenths of a second, which swamps it)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--workdir", help="where checkpoints are built (default: a temporary folder, removed after)")
    p.add_argument("--quick", action="store_true", help="tiny checkpoint at 32x32x5, 1 step, 1 repeat (smoke test)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for c in args.configs:
        if c not in ("tiny", "mid"):
            p.error(f"unknown config {c!r}")
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}")
    if args.quick:
        args.configs, args.repeats = ["tiny"], 1
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    from diffusers.utils import logging as d_logging
    from transformers.utils import logging as t_logging

    from lingbot_core.tiny import build_tiny_checkpoint

    t_logging.disable_progress_bar()
    d_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="lingbot-bench-") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        tiny = build_tiny_checkpoint(work / "tiny-dense", "dense", seed=0)
        for name in args.configs:
            if name == "tiny":
                folder, geometry = tiny, GEOMETRY["quick" if args.quick else "tiny"]
            else:
                folder = build_mid_checkpoint(tiny, work / "mid-dense", hidden=args.mid_hidden, depth=args.mid_depth,
                                              heads=args.mid_heads, seed=0)
                geometry = GEOMETRY["mid"]
            results.append(bench_config(name, folder, args.modes, args.repeats, geometry, args.seed))
    return {"benchmark": "generate", "repeats": args.repeats, "modes": args.modes,
            "mode_options": MODE_OPTIONS, "configs": results, "environment": environment()}


def report(result: dict[str, Any]) -> str:
    lines = []
    for cfg in result["configs"]:
        g, d = cfg["geometry"], cfg["dit"] or {}
        lines.append(f"{cfg['config']}: T2V {g['width']}x{g['height']}x{g['num_frames']}, {g['steps']} steps, CFG "
                     f"{g['guidance_scale']}, DiT hidden {d.get('hidden_size')} depth {d.get('depth')} "
                     f"({d.get('params', 0) / 1e6:.2f} M params), CPU fp32, {result['environment']['threads']} "
                     f"threads, median of {result['repeats']}")
        rows = [[r["mode"], fmt(r["install_s"]), fmt(r["text_s"]), fmt(r["denoise_s"]), fmt(r["decode_s"]),
                 fmt(r["generate_s"]), fmt(r["generate_ratio_vs_none"]), fmt(r["stages_ratio_vs_none"]),
                 fmt(r["max_abs_diff_vs_none"]), fmt(r["max_abs_diff_stages_vs_generate"])] for r in cfg["rows"]]
        lines.append(table(["mode", "install s", "text s", "denoise s", "decode s", "generate s", "gen/none",
                            "stages/none", "max|diff| vs none", "stages vs gen"], rows))
        lines.append("")
    return "\n".join(lines).rstrip()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_main(parse_args, run, report, argv)


if __name__ == "__main__":
    main()
