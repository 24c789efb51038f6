"""Speed levers of the denoise loop, each against its baseline in one process: rows of ratios.

Why: issue 20's options (step caching, batched CFG, compile, fp8 matmuls, chunked FFN/MoE) each claim
a speed or memory gain; the claim is a row here, measured beside the run it replaces, on the same
handle, seed and inputs. The weights are random, so every output comparison (rel-L2, PSNR, max
difference) measures the mechanism, not image quality.

The script is a registry of *sections*. A section is one function decorated with `@section(name)`
that takes the shared `Bench` (handles, geometry, timing helpers) and returns a `Table`; `--only`
picks sections by name, and every section runs by default. Adding rows for a new lever is one
function in this file (or in a module imported at the bottom) and nothing else.

Configs:
- `mid` (default): the tiny checkpoint with a bigger random DiT (hidden 512, 8 heads, 4 blocks;
  `--hidden 2048 --heads 16 --depth 2` is real width, about 10x slower), 128x128 at 5 frames (128
  video tokens), 40 steps at guidance 3.0;
- `--quick`: the tiny checkpoint (hidden 32, depth 2), 32x32x5, 12 steps (the smoke test's size).

    python bench/speed.py                       # every section, mid config
    python bench/speed.py --only baseline --json out.json
    python bench/speed.py --quick --threads 1   # smoke size
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench._common import environment, fmt, fmt_bytes, print_machine, table, write_json
from bench.generate import PROMPT, build_mid_checkpoint


@dataclass
class Table:
    """What a section returns: a title, rows (dicts with the same keys, in column order) and notes."""

    title: str
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        lines = [f"== {self.title}"]
        if self.rows:
            headers = list(self.rows[0])
            lines.append(table(headers, [[r.get(h) for h in headers] for r in self.rows]))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


SectionFn = Callable[["Bench"], Table]
SECTIONS: dict[str, SectionFn] = {}


def section(name: str) -> Callable[[SectionFn], SectionFn]:
    """Register a section under `name` (the `--only` key); sections run in registration order."""
    def register(fn: SectionFn) -> SectionFn:
        if name in SECTIONS:
            raise ValueError(f"section {name!r} is registered twice")
        SECTIONS[name] = fn
        return fn
    return register


class BlockCounter:
    """Counts forwards of a DiT's blocks (`blocks.*`), i.e. the blocks actually computed."""

    def __init__(self, dit: torch.nn.Module):
        self.n = 0
        self._hooks = [block.register_forward_pre_hook(self._count) for block in dit.blocks]

    def _count(self, *_: Any) -> None:
        self.n += 1

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


@dataclass
class Bench:
    """What sections share: the parsed arguments, a work folder, and checkpoints built once."""

    args: argparse.Namespace
    work: Path
    _folders: dict[str, Path] = field(default_factory=dict)
    _handles: dict[str, Any] = field(default_factory=dict)
    _conds: dict[str, Any] = field(default_factory=dict)

    @property
    def geometry(self) -> dict[str, int]:
        height, width, frames = self.args.geometry
        return dict(height=height, width=width, num_frames=frames)

    def folder(self, variant: str = "dense") -> Path:
        """The checkpoint of `variant` ("dense" or "moe"): the tiny one, or the mid DiT written over it."""
        if variant not in self._folders:
            from lingbot_core.tiny import build_tiny_checkpoint

            tiny = build_tiny_checkpoint(self.work / f"tiny-{variant}", variant)
            if self.args.quick or variant != "dense":
                self._folders[variant] = tiny
            else:
                self._folders[variant] = build_mid_checkpoint(tiny, self.work / f"mid-{variant}",
                                                              hidden=self.args.hidden, depth=self.args.depth,
                                                              heads=self.args.heads, seed=0)
        return self._folders[variant]

    def handle(self, variant: str = "dense") -> Any:
        if variant not in self._handles:
            from lingbot_core.handle import PipelineHandle

            self._handles[variant] = PipelineHandle.open(self.folder(variant), device="cpu")
        return self._handles[variant]

    def cond(self, variant: str = "dense") -> Any:
        """The encoded prompt and default negative (encoded once per checkpoint)."""
        if variant not in self._conds:
            from lingbot_core import stages

            self._conds[variant] = stages.encode_prompt(self.handle(variant), PROMPT, "")
        return self._conds[variant]

    def denoise(self, variant: str = "dense", **options: Any) -> dict[str, Any]:
        """One timed denoise (`options` go to `stages.denoise`): latents, seconds, DiT blocks computed."""
        from lingbot_core import stages

        handle = self.handle(variant)
        kwargs = dict(self.geometry, steps=self.args.steps, guidance_scale=self.args.cfg, seed=self.args.seed)
        kwargs.update(options)
        counter = BlockCounter(handle.component("transformer"))
        try:
            start = time.perf_counter()
            latents = stages.denoise(handle, self.cond(variant), **kwargs)
            seconds = time.perf_counter() - start
        finally:
            counter.close()
        return dict(latents=latents, seconds=seconds, blocks=counter.n)

    def alternate(self, runs: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, dict[str, Any]]:
        """Run every entry `--repeats` times, round-robin; keep the last result and the median seconds."""
        results: dict[str, dict[str, Any]] = {}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(self.args.repeats):
            for name, fn in runs.items():
                results[name] = fn()
                times[name].append(results[name]["seconds"])
        for name in runs:
            results[name]["seconds"] = statistics.median(times[name])
        return results


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR of `a` against `b` with `b`'s value range as the peak (inf when equal)."""
    mse = float((a.float() - b.float()).pow(2).mean())
    peak = float(b.float().max() - b.float().min())
    if mse == 0.0:
        return float("inf")
    return 10.0 * torch.log10(torch.tensor(peak * peak / mse)).item()


# -- sections --------------------------------------------------------------------------------------

@section("baseline")
def baseline(bench: Bench) -> Table:
    """The run every other section is a ratio to: the plain denoise loop, two forwards per step."""
    run = bench.alternate({"off": lambda: bench.denoise()})["off"]
    return Table("baseline denoise (eager, two forwards per step)", [
        dict(run="off", steps=bench.args.steps, dit_blocks=run["blocks"], seconds=run["seconds"])])


@section("cache")
def step_cache(bench: Bench) -> Table:
    """Each step-cache method and threshold against `off`: blocks computed, time, output drift."""
    from lingbot_core.sampling.step_cache import StepCacheSettings

    calibration = str(bench.work / "magcache")
    calibrated = bench.denoise(step_cache=StepCacheSettings("magcache_calibrate", calibration_dir=calibration))
    runs: dict[str, Callable[[], dict[str, Any]]] = {"off": lambda: bench.denoise()}
    for t in bench.args.fb_thresholds:
        runs[f"first_block {t:g}"] = lambda t=t: bench.denoise(step_cache=StepCacheSettings("first_block", threshold=t))
    for t in bench.args.mag_thresholds:
        runs[f"magcache {t:g}"] = lambda t=t: bench.denoise(
            step_cache=StepCacheSettings("magcache", threshold=t, calibration_dir=calibration))
    results = bench.alternate(runs)
    base = results["off"]
    rows = []
    for name, r in results.items():
        rows.append(dict(run=name, dit_blocks=r["blocks"], blocks_ratio=r["blocks"] / base["blocks"],
                         seconds=r["seconds"], time_ratio=r["seconds"] / base["seconds"],
                         rel_l2=rel_l2(r["latents"], base["latents"]), psnr_db=psnr(r["latents"], base["latents"])))
    rows.append(dict(run="magcache_calibrate", dit_blocks=calibrated["blocks"],
                     blocks_ratio=calibrated["blocks"] / base["blocks"], seconds=calibrated["seconds"],
                     time_ratio=calibrated["seconds"] / base["seconds"],
                     rel_l2=rel_l2(calibrated["latents"], base["latents"]),
                     psnr_db=psnr(calibrated["latents"], base["latents"])))
    return Table(f"step caching, {bench.args.steps} steps, CFG {bench.args.cfg} (warm-up and max skips at their "
                 "defaults)", rows, [
        "random weights: rel_l2 / psnr_db (final latents vs off) measure the mechanism, not image quality",
        "first_block's change is mean|d residual| / mean|residual| of block 0; real weights change far less "
        "between steps than random ones, so useful thresholds differ (published: 0.05-0.1 on Wan)",
    ])


@section("cfg")
def cfg_batch(bench: Bench) -> Table:
    """CFG as one batch-2 forward against two forwards: time, peak CPU bytes of one step, max diff."""
    from bench._common import cpu_peak_bytes

    results = bench.alternate({"two forwards": lambda: bench.denoise(cfg_batch="off"),
                               "batched": lambda: bench.denoise(cfg_batch="on")})
    peaks = {name: cpu_peak_bytes(lambda name=name: bench.denoise(
        cfg_batch="on" if name == "batched" else "off", steps=1))[0] for name in results}
    base = results["two forwards"]
    rows = [dict(run=name, seconds=r["seconds"], time_ratio=r["seconds"] / base["seconds"],
                 peak_bytes_one_step=fmt_bytes(peaks[name]), peak_ratio=peaks[name] / max(peaks["two forwards"], 1),
                 max_abs_diff=float((r["latents"] - base["latents"]).abs().max()),
                 rel_l2=rel_l2(r["latents"], base["latents"]))
            for name, r in results.items()]
    return Table(f"batched vs two-forward CFG, {bench.args.steps} steps", rows, [
        "peak: torch CPU bytes allocated during a 1-step denoise (profiler), net of weights and inputs",
        "batched differs from two forwards only by float rounding (matmul / softmax reduction order)",
    ])


@section("compose")
def compose(bench: Bench) -> Table:
    """The options together: few-step + compile, and step cache + compile + group offload, each
    against the eager run it replaces (compile time shown apart: the first compiled run pays it)."""
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.models.compile import compile_problem
    from lingbot_core.placement.door import configure_offload
    from lingbot_core.sampling.step_cache import StepCacheSettings

    if (problem := compile_problem("cpu")):
        return Table("composition rows", [], [f"not run: {problem}"])
    eager = bench.handle()
    compiled = PipelineHandle.open(bench.folder(), device="cpu", compile="blocks")
    compiled_group = configure_offload(compiled, "group", use_stream=False)
    bench.cond()
    calibration = str(bench.work / "magcache")
    mag = StepCacheSettings("magcache", threshold=bench.args.mag_thresholds[-1], calibration_dir=calibration)
    few = dict(steps=4, guidance_scale=1.0, sampler="euler")

    def run(handle: Any, **options: Any) -> dict[str, Any]:
        bench._handles["dense"], saved = handle, bench._handles["dense"]
        try:
            return bench.denoise(**options)
        finally:
            bench._handles["dense"] = saved

    base = run(eager)
    bench.denoise(step_cache=StepCacheSettings("magcache_calibrate", calibration_dir=calibration))
    few_eager = run(eager, **few)
    first = run(compiled, **few)  # compiles the blocks (one graph for all)
    few_compiled = run(compiled, **few)
    cached_eager = run(eager, step_cache=mag)
    cached_first = run(compiled_group, step_cache=mag)  # group hooks around the compiled blocks
    cached_compiled = run(compiled_group, step_cache=mag)
    rows = []
    for name, r, ref in ((f"{bench.args.steps}-step CFG, eager (baseline)", base, base),
                         ("few-step (euler 4, cfg 1), eager", few_eager, base),
                         ("few-step + compile, first run (compile included)", first, few_eager),
                         ("few-step + compile", few_compiled, few_eager),
                         (f"magcache {mag.threshold:g}, eager", cached_eager, base),
                         ("magcache + compile + group offload, first run", cached_first, cached_eager),
                         ("magcache + compile + group offload", cached_compiled, cached_eager)):
        rows.append(dict(run=name, dit_blocks=r["blocks"], seconds=r["seconds"],
                         vs_baseline=r["seconds"] / base["seconds"], vs_row_it_replaces=r["seconds"] / ref["seconds"],
                         max_abs_diff_vs_it=float((r["latents"] - ref["latents"]).abs().max())))
    return Table(f"composition, {bench.args.steps}-step CFG {bench.args.cfg} baseline", rows, [
        "vs_row_it_replaces: few-step + compile against few-step eager; cache + compile + group against cache eager",
        "max_abs_diff_vs_it: the final latents against that row (the eager cache row: against the baseline)",
    ])


# DiT-forward sections (quantized weights, fp8 matmul, chunked FFN/MoE, the estimate, regional compile)
from bench.speed_dit import register_sections  # noqa: E402

register_sections(section, Table)


# -- the script ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny checkpoint and shapes (smoke test)")
    p.add_argument("--only", nargs="+", choices=None, metavar="SECTION",
                   help="sections to run (default: all)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--fb-thresholds", type=float, nargs="+", default=[0.05, 0.2, 0.5],
                   help="first_block thresholds to sweep")
    p.add_argument("--mag-thresholds", type=float, nargs="+", default=[0.06, 0.25, 1.0],
                   help="magcache thresholds to sweep")
    p.add_argument("--steps", type=int, default=None, help="denoise steps (default 40; 12 with --quick)")
    p.add_argument("--cfg", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    unknown = sorted(set(args.only or ()) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    if args.steps is None:
        args.steps = 12 if args.quick else 40
    args.geometry = (32, 32, 5) if args.quick else (128, 128, 5)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = args.only or list(SECTIONS)
    print_machine()
    out: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "json"},
                           "environment": environment(), "sections": {}}
    with tempfile.TemporaryDirectory(prefix="lingbot-speed-") as tmp:
        bench = Bench(args, Path(tmp))
        for name in chosen:
            result = SECTIONS[name](bench)
            print(result.render(), flush=True)
            out["sections"][name] = {"title": result.title, "rows": result.rows, "notes": result.notes}
    write_json(args.json, out)
    return out


__all__ = ["SECTIONS", "Bench", "Table", "section", "main", "rel_l2", "psnr", "fmt"]

if __name__ == "__main__":
    main()
