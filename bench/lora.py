"""A real-size LoRA on the real-shape MoE DiT (CPU): merge and removal time, RAM, forward cost.

Why: the LightLingBot-Video 4-step LoRA (rank 128, 305 MB) is the LoRA users will load; how long
its merge takes, how much RAM the pristine copies cost, and what runtime deltas cost a forward on
fp8 weights should be measured, not estimated. The file itself is not available, so this builds
one with its layout (see the project's LoRA notes): no prefix, mixed suffixes in one file
(`blocks.{i}.attn.to_{q,k,v}.lora.down/.lora.up.weight`, `attn.to_out` and
`ffn.shared_experts.{gate,up,down}_proj` with `lora_A/lora_B.weight`), no alpha, bf16, rank 128,
random values. Everything is built outside the repository (`--data`):

- the 48-block LoRA (the real file's size) and its first 4 blocks as a second file;
- the MoE DiT with 4 of its 48 blocks at real size (bench/weights.py's builder, bf16, ~5.1 GB).

Three child processes, one after the other (each stays under ~7 GB RSS):

- `file`:  read the 48-block LoRA (time, RSS growth) and match it against the 48-block model's
           layout (meta tensors, no weights): modules matched, and the pristine bytes a full merge
           would hold (computed from the shapes);
- `bf16`:  load the 4-block DiT, then rounds of plain forward / apply (merge) / merged forward /
           remove, side by side in the one process: apply and remove time, peak RSS growth of the
           first apply, bytes of pristine copies held, forward with LoRA vs without, and whether
           every plain forward after a removal is bit-identical to the first;
- `fp8`:   the same DiT quantized on load (weights='fp8_e4m3'), where the LoRA is a runtime delta
           on each quantized linear: the same rounds, and the output's rel-L2 against bf16.

Per-block figures are the 4-block ones / 4; the "x12" column extrapolates them to 48 blocks (not
measured). The weights are random: this measures cost, not quality.

    python bench/lora.py --data DATA_DIR/lora       # real shapes, 256 video + 64 text tokens
    python bench/lora.py --quick --data /tmp/lora-quick       # tiny shapes (the smoke test)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

import torch

from bench._common import environment, fmt, fmt_bytes, print_machine, table, write_json
from bench.weights import MOE, QUICK, _inputs, _reset_peak, _rss, build_bf16

FULL_DEPTH = 48
BENCH_BLOCKS = 4
RANK = 128
# (module inside a block, suffix pair): the LightLingBot-Video file's spellings (peft saved through
# diffusers' converter, which renames only to_q/to_k/to_v).
DOT, AB = (".lora.down.weight", ".lora.up.weight"), (".lora_A.weight", ".lora_B.weight")
TARGETS = (("attn.to_q", DOT), ("attn.to_k", DOT), ("attn.to_v", DOT), ("attn.to_out", AB),
           ("ffn.shared_experts.gate_proj", AB), ("ffn.shared_experts.up_proj", AB),
           ("ffn.shared_experts.down_proj", AB))


def moe_config(depth: int, quick: bool = False) -> dict[str, Any]:
    cfg = {"_class_name": "LingBotVideoTransformer3DModel", **MOE, "depth": depth}
    if quick:
        cfg.update(QUICK)
    return cfg


def _skeleton(config: dict[str, Any]) -> torch.nn.Module:
    from lingbot_core.models.transformer import LingBotVideoTransformer3DModel

    with torch.device("meta"):
        return LingBotVideoTransformer3DModel.from_config(config)


def build_lora(path: Path, config: dict[str, Any], blocks: int, rank: int, seed: int = 0) -> Path:
    """A LightLingBot-shaped LoRA for the first `blocks` blocks of `config` (bf16, no alpha, no prefix)."""
    if path.is_file():
        return path
    from safetensors.torch import save_file

    shapes = {n: tuple(p.shape) for n, p in _skeleton(config).named_parameters()}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(blocks):
        for module, (down_suffix, up_suffix) in TARGETS:
            out, inp = shapes[f"blocks.{i}.{module}.weight"]
            down = torch.randn(rank, inp, generator=g) / inp**0.5
            up = torch.randn(out, rank, generator=g) * (0.02 / rank**0.5)
            tensors[f"blocks.{i}.{module}{down_suffix}"] = down.bfloat16()
            tensors[f"blocks.{i}.{module}{up_suffix}"] = up.bfloat16()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp, metadata={"format": "pt", "built_by": "bench/lora.py"})
    tmp.rename(path)
    return path


# -- children ----------------------------------------------------------------------------------------------

def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def child_file(lora_path: str, config: dict[str, Any]) -> dict[str, Any]:
    """Read the whole LoRA file and resolve it on the full-depth layout (no weights)."""
    from lingbot_core import lora as lora_ops

    gc.collect()
    before, _ = _rss()
    reset = _reset_peak()
    t0 = time.perf_counter()
    lora = lora_ops.load_lora_file(lora_path)
    seconds = time.perf_counter() - t0
    after, peak = _rss()
    held = _tensor_bytes(t for g in lora.groups.values() for t in g.tensors.values())
    layout = lora_ops.matching._layout(_skeleton(config))
    # safetensors maps the file lazily: the first match (it checks every factor) reads it in; the
    # second is what every stage entry repeats.
    gc.collect()
    untouched, _ = _rss()
    t0, c0 = time.perf_counter(), time.process_time()
    report = lora_ops.match(lora, layout, "transformer")
    match_seconds, match_cpu = time.perf_counter() - t0, time.process_time() - c0
    touched, _ = _rss()
    t0, c0 = time.perf_counter(), time.process_time()
    lora_ops.match(lora, layout, "transformer")
    warm_seconds, warm_cpu = time.perf_counter() - t0, time.process_time() - c0
    targeted = {p.param for p in report.patches}
    pristine = sum(torch.Size(layout["params"][name]).numel() * 2 for name in targeted)  # bf16 weights
    return {"file_bytes": os.path.getsize(lora_path), "keys": lora.num_keys, "load_seconds": seconds,
            "rss_growth": after - before, "peak_growth": peak - before if reset else None, "tensors_held": held,
            "match_seconds": match_seconds, "match_warm_seconds": warm_seconds,
            "match_cpu_seconds": match_cpu, "match_warm_cpu_seconds": warm_cpu,
            "rss_growth_first_match": touched - untouched, "modules": report.modules, "unmatched": len(report.unmatched),
            "pristine_bytes_computed": pristine, "depth": config["depth"]}


def _rounds(model, lora, inputs, repeats: int) -> dict[str, Any]:
    """Plain forward / apply / LoRA forward / remove, `repeats` times, in one process."""
    from lingbot_core import lora as lora_ops

    stack = lora_ops.LoraStack((lora_ops.LoraItem(lora, 1.0),))
    from lingbot_core.weights.state import Models

    parts = Models({"transformer": model})  # the module and the owner of its state
    with torch.no_grad():
        model(*inputs)  # warm up
    out: dict[str, Any] = {"plain_s": [], "lora_s": [], "apply_s": [], "remove_s": [], "plain_cpu_s": [],
                           "lora_cpu_s": [], "apply_cpu_s": []}
    first_plain = first_lora = None
    plain_exact = lora_repeatable = True
    for r in range(repeats):
        with torch.no_grad():
            t0, c0 = time.perf_counter(), time.process_time()
            plain = model(*inputs).sample.float()
            out["plain_s"].append(time.perf_counter() - t0)
            out["plain_cpu_s"].append(time.process_time() - c0)
        gc.collect()
        before, _ = _rss()
        reset = _reset_peak()
        t0, c0 = time.perf_counter(), time.process_time()
        stack.apply(parts, ["transformer"])
        out["apply_s"].append(time.perf_counter() - t0)
        out["apply_cpu_s"].append(time.process_time() - c0)
        after, peak = _rss()
        if r == 0:
            out["first_apply_rss_growth"] = after - before
            out["first_apply_peak_growth"] = peak - before if reset else None
            out["pristine_bytes"] = _tensor_bytes(lora_ops.pristine_copies(parts.state("transformer")).values())
            out["runtime_deltas"] = len(parts.state("transformer").runtime)
        with torch.no_grad():
            t0, c0 = time.perf_counter(), time.process_time()
            adapted = model(*inputs).sample.float()
            out["lora_s"].append(time.perf_counter() - t0)
            out["lora_cpu_s"].append(time.process_time() - c0)
        t0 = time.perf_counter()
        stack.remove(parts, ["transformer"])
        out["remove_s"].append(time.perf_counter() - t0)
        if first_plain is None:
            first_plain, first_lora = plain, adapted
        plain_exact &= torch.equal(plain, first_plain)
        lora_repeatable &= torch.equal(adapted, first_lora)
    with torch.no_grad():
        plain_exact &= torch.equal(model(*inputs).sample.float(), first_plain)  # after the last removal
    out.update(plain_bit_exact_after_removal=bool(plain_exact), lora_repeatable=bool(lora_repeatable),
               lora_effect_rel_l2=float((first_lora - first_plain).norm() / first_plain.norm()))
    out["_outputs"] = (first_plain, first_lora)
    return out


def child_model(folder: str, lora_path: str, weights: str, tokens: tuple[int, int], repeats: int,
                outputs: str) -> dict[str, Any]:
    """Load the DiT (bf16, or fp8 quantized on load), then the rounds; bf16 saves its outputs for fp8's error."""
    import lingbot_core.models.transformer  # noqa: F401  (imported before the baseline)
    from lingbot_core import lora as lora_ops
    from lingbot_core.weights.loader import load_dit

    base, _ = _rss()
    t0 = time.perf_counter()
    from lingbot_core.weights.state import ModelState

    state = ModelState()
    model = load_dit(folder, dtype=torch.bfloat16, weights=weights, state=state)
    load_seconds = time.perf_counter() - t0
    loaded, _ = _rss()
    lora = lora_ops.load_lora_file(lora_path)
    report = lora_ops.match(lora, model, "transformer")
    inputs = _inputs(dict(model.config), *tokens)
    result = _rounds(model, lora, inputs, repeats)
    plain, adapted = result.pop("_outputs")
    result.update(load_seconds=load_seconds, baseline_rss=base, model_rss=loaded - base, modules=report.modules,
                  unmatched=len(report.unmatched), peak_rss=_rss()[1], format=state.format)
    if weights == "auto":
        torch.save({"plain": plain, "lora": adapted}, outputs)
    elif Path(outputs).is_file():
        ref = torch.load(outputs)
        result["rel_l2_vs_bf16_plain"] = float((plain - ref["plain"]).norm() / ref["plain"].norm())
        result["rel_l2_vs_bf16_merged"] = float((adapted - ref["lora"]).norm() / ref["lora"].norm())
    return result


def _dispatch(kind: str, args: dict[str, Any]) -> dict[str, Any]:
    if kind == "file":
        return child_file(args["lora"], args["config"])
    return child_model(args["folder"], args["lora"], args["weights"], tuple(args["tokens"]), args["repeats"],
                       args["outputs"])


def _child(kind: str, args: dict[str, Any], inline: bool) -> dict[str, Any]:
    if inline:
        return _dispatch(kind, args)
    env = {**os.environ, "LINGBOT_SKIP_WEIGHT_SCAN": "1"}
    proc = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(args)], capture_output=True,
                          text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"child {kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the report -------------------------------------------------------------------------------------------

def run(data: Path, *, quick: bool, tokens: tuple[int, int], repeats: int, formats: list[str]) -> dict[str, Any]:
    blocks = 2 if quick else BENCH_BLOCKS
    depth = 4 if quick else FULL_DEPTH
    rank = 8 if quick else RANK
    root = data / ("quick" if quick else "real")
    t0 = time.perf_counter()
    full = build_lora(root / f"lightlingbot-shaped-{depth}blocks-r{rank}.safetensors", moe_config(depth, quick),
                      depth, rank)
    part = build_lora(root / f"lightlingbot-shaped-{blocks}blocks-r{rank}.safetensors", moe_config(depth, quick),
                      blocks, rank)
    folder = build_bf16(root / f"moe-{blocks}blocks-bf16", moe_config(blocks, quick))
    print(f"data ready in {time.perf_counter() - t0:.0f} s under {root}", flush=True)
    report: dict[str, Any] = {"environment": environment(), "blocks": blocks, "depth": depth, "rank": rank,
                              "tokens": list(tokens), "repeats": repeats, "quick": quick}
    report["file"] = _child("file", {"lora": str(full), "config": moe_config(depth, quick)}, quick)
    print(f"file: {report['file']}", flush=True)
    outputs = str(root / "bf16-outputs.pt")
    for name in formats:
        weights = "auto" if name == "bf16" else "fp8_e4m3"
        report[name] = _child("model", {"folder": str(folder), "lora": str(part), "weights": weights,
                                        "tokens": list(tokens), "repeats": repeats, "outputs": outputs}, quick)
        print(f"{name}: {report[name]}", flush=True)
    return report


def _best(values: list[float]) -> float:
    return min(values)


def render(report: dict[str, Any]) -> str:
    blocks, depth = report["blocks"], report["depth"]
    scale = depth / blocks
    f = report["file"]
    out = [f"LoRA file ({depth} blocks, rank {report['rank']}, bf16): {fmt_bytes(f['file_bytes'])} on disk, "
           f"{f['keys']} keys; opened (mapped) in {fmt(f['load_seconds'])} s, RSS +{fmt_bytes(f['rss_growth'])}; "
           f"first match on the {depth}-block layout (reads and checks every factor) {fmt(f['match_seconds'])} s "
           f"({fmt(f['match_cpu_seconds'])} CPU s), "
           f"RSS +{fmt_bytes(f['rss_growth_first_match'])} more (tensors {fmt_bytes(f['tensors_held'])}); "
           f"again (what each stage entry repeats) {fmt(f['match_warm_seconds'])} s ({fmt(f['match_warm_cpu_seconds'])} "
           f"CPU s); {f['modules']} modules, "
           f"{f['unmatched']} keys unmatched; a full merge keeps {fmt_bytes(f['pristine_bytes_computed'])} of "
           "pristine bf16 copies (computed from the shapes)."]
    if "bf16" in report:
        b = report["bf16"]
        rows = [
            ["apply (merge), best", f"{fmt(_best(b['apply_s']))} s", f"{fmt(_best(b['apply_s']) / blocks)} s",
             f"{fmt(_best(b['apply_s']) * scale)} s"],
            ["apply (merge), first", f"{fmt(b['apply_s'][0])} s", f"{fmt(b['apply_s'][0] / blocks)} s",
             f"{fmt(b['apply_s'][0] * scale)} s"],
            ["remove, best", f"{fmt(_best(b['remove_s']))} s", f"{fmt(_best(b['remove_s']) / blocks)} s",
             f"{fmt(_best(b['remove_s']) * scale)} s"],
            ["pristine copies held", fmt_bytes(b["pristine_bytes"]), fmt_bytes(b["pristine_bytes"] / blocks),
             fmt_bytes(b["pristine_bytes"] * scale)],
            ["RSS growth, first apply", fmt_bytes(b["first_apply_rss_growth"]),
             fmt_bytes(b["first_apply_rss_growth"] / blocks), fmt_bytes(b["first_apply_rss_growth"] * scale)],
            ["peak RSS growth, first apply", fmt_bytes(b["first_apply_peak_growth"]),
             fmt_bytes((b["first_apply_peak_growth"] or 0) / blocks),
             fmt_bytes((b["first_apply_peak_growth"] or 0) * scale)],
        ]
        out.append(f"bf16 merge on the {blocks}-block DiT ({b['modules']} modules; model RSS "
                   f"{fmt_bytes(b['model_rss'])}, process peak RSS {fmt_bytes(b['peak_rss'])}):")
        out.append(table(["", f"measured ({blocks} blocks)", "per block", f"x{scale:g} -> {depth} blocks (extrapolated)"],
                         rows))
    rows = []
    for name in ("bf16", "fp8"):
        if name not in report:
            continue
        r = report[name]
        plain, lora = _best(r["plain_s"]), _best(r["lora_s"])
        cpu_ratio = _best(r["lora_cpu_s"]) / _best(r["plain_cpu_s"])
        rows.append([name, "merged" if name == "bf16" else f"runtime deltas ({r['runtime_deltas']})",
                     f"{fmt(plain)} s", f"{fmt(lora)} s", fmt(lora / plain), fmt(cpu_ratio),
                     f"{fmt(_best(r['apply_s']))} s ({fmt(_best(r['apply_cpu_s']))} CPU s)",
                     f"{fmt(_best(r['remove_s']))} s", fmt(r["plain_bit_exact_after_removal"]),
                     fmt(r.get("rel_l2_vs_bf16_merged")), fmt_bytes(r["peak_rss"])])
    out.append(f"forward ({report['tokens'][0]} video + {report['tokens'][1]} text tokens, wall and process CPU time, best of "
               f"{report['repeats']}; LoRA effect rel-L2 {fmt(report.get('bf16', {}).get('lora_effect_rel_l2'))}):")
    out.append(table(["weights", "LoRA as", "forward", "with LoRA", "ratio (wall)", "ratio (CPU time)", "apply", "remove",
                      "plain bit-exact after removal", "rel-L2 vs bf16 merged", "process peak RSS"], rows))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any] | int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, default=Path.home() / ".cache" / "lingbot-nodes" / "bench-lora")
    p.add_argument("--video-tokens", type=int, default=256)
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--formats", default="bf16,fp8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true", help="tiny shapes, children in this process (the smoke test)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    if args.child:
        print(json.dumps(_dispatch(args.child[0], json.loads(args.child[1]))))
        return 0
    print_machine()
    formats = [f for f in args.formats.split(",") if f]
    unknown = set(formats) - {"bf16", "fp8"}
    if unknown:
        p.error(f"--formats: unknown {', '.join(sorted(unknown))} (bf16, fp8)")
    tokens = (16, 8) if args.quick else (args.video_tokens, args.text_tokens)
    report = run(args.data, quick=args.quick, tokens=tokens, repeats=args.repeats, formats=formats)
    print(render(report))
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    result = main()
    sys.exit(result if isinstance(result, int) else 0)
