"""Weight formats at real shapes on CPU: load memory, accuracy and forward time of bf16 / fp8 / GGUF.

Builds, outside the repository (`--data`, default ~/.cache/lingbot-nodes/bench-weights), random bf16
checkpoints of real shape: the dense DiT (1,357,171,264 parameters, ~2.7 GB) and the MoE DiT with 4
of its 48 blocks (each block real size), then their fp8 / GGUF-Q8_0 / GGUF-Q4_0 copies with the
quantize command's writers. For each format it reports
- peak RSS while loading (a fresh process per load) minus the process's RSS before loading, divided by
  the bytes the loaded model holds (`load/stored`); the torch baseline RSS is printed once;
- the DiT output's relative L2 error against bf16 on the same input;
- forward time relative to bf16 (all formats timed in one process, one after the other);
- under `sequential` and `group` with `offload_to=disk`: peak RSS during one forward (the peak is
  reset after loading, `/proc/self/clear_refs`) divided by the model's stored bytes.

    python bench/weights.py                       # dense + MoE-4, 256 video + 64 text tokens
    python bench/weights.py --which dense --formats bf16,fp8
    python bench/weights.py --full-moe            # 48 blocks; needs ~100 GB of disk (opt-in)

The machine is small: every child keeps at most one model (plus bf16 for the error) in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

import torch

from bench._common import environment, fmt, fmt_bytes, table, write_json

FORMATS = ("bf16", "fp8", "gguf-q8_0", "gguf-q4_0")
DENSE = dict(hidden_size=2048, num_attention_heads=16, depth=24, intermediate_size=6144, text_dim=2560,
             freq_dim=256, axes_dims=[32, 48, 48])
MOE = dict(DENSE, depth=4, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, n_shared_experts=1,
           n_group=4, topk_group=2, routed_scaling_factor=2.5, score_func="sigmoid", norm_topk_prob=True)
EXPECTED_PARAMS = {"dense": 1_357_171_264, "moe": 4 * 625_760_512 + 48_001_600}


# -- building the checkpoints --------------------------------------------------------------------------

QUICK = dict(hidden_size=256, num_attention_heads=2, intermediate_size=512, text_dim=64, freq_dim=32,
             moe_intermediate_size=64, num_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2)


def _config(which: str, full_moe: bool, quick: bool = False) -> dict[str, Any]:
    cfg = dict(DENSE if which == "dense" else MOE)
    if which == "moe" and full_moe:
        cfg["depth"] = 48
    if quick:  # the smoke test's sizes
        cfg.update({k: v for k, v in QUICK.items() if k in cfg or which == "moe"}, depth=2)
    return {"_class_name": "LingBotVideoTransformer3DModel", **cfg}


def build_bf16(folder: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """A bf16 transformer/ folder with random weights, written tensor by tensor (fp32-kept ones in fp32)."""
    from lingbot_core.models.precision import stays_float32
    from lingbot_core.models.transformer import LingBotVideoTransformer3DModel

    target = folder / "transformer"
    weights = target / "diffusion_pytorch_model.safetensors"
    if weights.is_file():
        return folder
    target.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        skeleton = LingBotVideoTransformer3DModel.from_config(config)
    plan = [(k, torch.float32 if stays_float32(k) else torch.bfloat16, tuple(v.shape))
            for k, v in skeleton.state_dict().items()]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = {torch.float32: "F32", torch.bfloat16: "BF16"}
    for key, dtype, shape in plan:
        n = dtype.itemsize * (int(torch.Size(shape).numel()))
        header[key] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    g = torch.Generator().manual_seed(seed)
    tmp = weights.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for _key, dtype, shape in plan:
            fan_in = shape[-1] if len(shape) >= 2 else 1
            rows = shape[0] if len(shape) >= 2 else 1
            flat = torch.Size(shape).numel()
            per = flat // rows
            for start in range(0, rows, max(1, (1 << 24) // max(per, 1))):
                stop = min(rows, start + max(1, (1 << 24) // max(per, 1)))
                chunk = torch.randn((stop - start) * per, generator=g)
                chunk = chunk / fan_in**0.5 if len(shape) >= 2 else 1.0 + 0.1 * chunk
                fh.write(chunk.to(dtype).view(torch.uint8).numpy().data)
    tmp.rename(weights)
    (target / "config.json").write_text(json.dumps(config))
    return folder


def build_quantized(src: Path, dst: Path, target: str) -> Path:
    from lingbot_core.quantize import write_fp8, write_gguf
    from lingbot_core.weights.sources import SafetensorsSource

    out = dst / "transformer"
    name = "diffusion_pytorch_model." + ("safetensors" if target == "fp8" else "gguf")
    if (out / name).is_file():
        return dst
    out.mkdir(parents=True, exist_ok=True)
    source = SafetensorsSource([src / "transformer" / "diffusion_pytorch_model.safetensors"])
    tmp = out / (name + ".tmp")
    if target == "fp8":
        write_fp8(source, tmp)
    else:
        write_gguf(source, tmp, target.split("-")[1].upper())
    tmp.rename(out / name)
    (out / "config.json").write_text((src / "transformer" / "config.json").read_text())
    return dst


# -- the measurements (children) -------------------------------------------------------------------------

def _rss() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process in bytes, from /proc/self/status."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _inputs(config: dict[str, Any], video_tokens: int, text_tokens: int):
    side = int(round((video_tokens) ** 0.5))
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 16, 1, 2 * side, 2 * side, generator=g)
    text = torch.randn(1, text_tokens, config["text_dim"], generator=g)
    return latents, torch.tensor([700.0]), text


def _held_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta")


def child_load(folder: str) -> dict[str, Any]:
    import lingbot_core.models.transformer  # noqa: F401  (imports before the baseline)
    from lingbot_core.weights.loader import load_dit

    base, _ = _rss()
    start = time.perf_counter()
    model = load_dit(folder, dtype=torch.bfloat16)
    seconds = time.perf_counter() - start
    _, peak = _rss()
    return {"baseline_rss": base, "peak_rss": peak, "held": _held_bytes(model), "seconds": seconds,
            "format": model.weights_format}


def child_forward(folders: dict[str, str], video_tokens: int, text_tokens: int, out: str, repeats: int) -> dict:
    """Every format in this one process, one after the other: output error vs bf16 and forward time."""
    from lingbot_core.weights.loader import load_dit

    results: dict[str, Any] = {}
    reference = None
    torch.manual_seed(0)
    for name, folder in folders.items():
        model = load_dit(folder, dtype=torch.bfloat16)
        config = dict(model.config)
        inputs = _inputs(config, video_tokens, text_tokens)
        with torch.no_grad():
            model(*inputs)  # warm up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                sample = model(*inputs).sample.float()
                times.append(time.perf_counter() - t0)
        if reference is None:
            reference = sample
        err = float((sample - reference).norm() / reference.norm())
        results[name] = {"seconds": min(times), "rel_l2": err}
        del model
    return results


def child_disk(folder: str, mode: str, video_tokens: int, text_tokens: int) -> dict[str, Any]:
    from lingbot_core import offload
    from lingbot_core.weights.loader import load_dit

    model = load_dit(folder, dtype=torch.bfloat16)
    stored = _held_bytes(model)
    config = dict(model.config)
    inputs = _inputs(config, video_tokens, text_tokens)

    from lingbot_core.weights.disk import UNIT_OF_MODE, DiskStreaming

    streaming = DiskStreaming(model, torch.device("cpu"), UNIT_OF_MODE[mode])
    assert offload.component_device(model) == torch.device("cpu")
    import gc

    gc.collect()
    before, _ = _rss()
    reset = _reset_peak()
    t0 = time.perf_counter()
    with torch.no_grad():
        model(*inputs)
    seconds = time.perf_counter() - t0
    _, peak = _rss()
    streaming.remove(restore=False)
    return {"stored": stored, "rss_before": before, "peak_rss": peak, "peak_reset": reset, "seconds": seconds}


def _child(args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "LINGBOT_SKIP_WEIGHT_SCAN": "1"}
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the report -------------------------------------------------------------------------------------------

def run(which: list[str], formats: list[str], data: Path, video_tokens: int, text_tokens: int, full_moe: bool,
        repeats: int, quick: bool = False) -> dict[str, Any]:
    report: dict[str, Any] = {"environment": environment(), "video_tokens": video_tokens,
                              "text_tokens": text_tokens, "models": {}}
    for kind in which:
        config = _config(kind, full_moe, quick)
        root = data / (("quick-" if quick else "") + (f"{kind}-full" if kind == "moe" and full_moe else kind))
        t0 = time.perf_counter()
        folders = {"bf16": build_bf16(root / "bf16", config)}
        for fmt_name in formats:
            if fmt_name != "bf16":
                folders[fmt_name] = build_quantized(folders["bf16"], root / fmt_name, fmt_name)
        print(f"[{kind}] checkpoints ready in {time.perf_counter() - t0:.0f} s under {root}", flush=True)
        if not quick and not full_moe:
            from lingbot_core.weights.sources import SafetensorsSource

            entries = SafetensorsSource([folders["bf16"] / "transformer" / "diffusion_pytorch_model.safetensors"]).entries
            params = sum(torch.Size(e.shape).numel() for e in entries.values())
            assert params == EXPECTED_PARAMS[kind], (kind, params)  # the real shape, to the parameter
        rows: dict[str, Any] = {}
        for fmt_name in formats:
            rows[fmt_name] = {"load": _child(["load", str(folders[fmt_name])])}
            print(f"[{kind}] {fmt_name} load: {rows[fmt_name]['load']}", flush=True)
        timed = _child(["forward", json.dumps({k: str(folders[k]) for k in formats}), str(video_tokens),
                        str(text_tokens), str(repeats)])
        for fmt_name in formats:
            rows[fmt_name]["forward"] = timed[fmt_name]
            for mode in ("sequential", "group"):
                rows[fmt_name][f"disk_{mode}"] = _child(["disk", str(folders[fmt_name]), mode, str(video_tokens),
                                                         str(text_tokens)])
                print(f"[{kind}] {fmt_name} disk {mode}: {rows[fmt_name][f'disk_{mode}']}", flush=True)
        report["models"][kind] = {"config": config, "rows": rows}
    return report


def render(report: dict[str, Any]) -> str:
    out = []
    for kind, entry in report["models"].items():
        rows = entry["rows"]
        base_t = rows["bf16"]["forward"]["seconds"] if "bf16" in rows else None
        table_rows = []
        for name, r in rows.items():
            load = r["load"]
            grown = load["peak_rss"] - load["baseline_rss"]
            table_rows.append([
                name, fmt_bytes(load["held"]), fmt(grown / load["held"]),
                fmt(r["forward"]["rel_l2"]),
                fmt(r["forward"]["seconds"] / base_t) if base_t else "-",
                *(fmt(r[f"disk_{m}"]["peak_rss"] / r[f"disk_{m}"]["stored"]) + " ("
                  + fmt((r[f"disk_{m}"]["peak_rss"] - r[f"disk_{m}"]["rss_before"]) / r[f"disk_{m}"]["stored"]) + ")"
                  for m in ("sequential", "group")),
            ])
        baseline = next(iter(rows.values()))["load"]["baseline_rss"]
        out.append(f"{kind}: {report['video_tokens']} video + {report['text_tokens']} text tokens, CPU bf16 compute; "
                   f"torch baseline RSS {fmt_bytes(baseline)}")
        out.append(table(["format", "stored", "load peak/stored", "rel-L2 vs bf16", "forward vs bf16",
                          "seq+disk peak/stored (forward growth)", "group+disk peak/stored (forward growth)"],
                         table_rows))
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--which", default="dense,moe")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--data", type=Path, default=Path.home() / ".cache" / "lingbot-nodes" / "bench-weights")
    p.add_argument("--video-tokens", type=int, default=256)
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--full-moe", action="store_true", help="48 MoE blocks (~60 GB bf16 on disk; not run here); opt-in")
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true", help="small shapes (the smoke test)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if args.child:
        kind, *rest = args.child
        if kind == "load":
            result = child_load(rest[0])
        elif kind == "forward":
            result = child_forward(json.loads(rest[0]), int(rest[1]), int(rest[2]), "", int(rest[3]))
        else:
            result = child_disk(rest[0], rest[1], int(rest[2]), int(rest[3]))
        print(json.dumps(result))
        return 0
    formats = [f for f in args.formats.split(",") if f]
    if "bf16" not in formats:
        formats.insert(0, "bf16")
    report = run(args.which.split(","), formats, args.data, args.video_tokens, args.text_tokens, args.full_moe,
                 args.repeats, args.quick)
    print(render(report))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
