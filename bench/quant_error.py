"""Where the DiT's output error under fp8 / GGUF weights comes from (analysis for bench/weights.py).

On the real-shape random bf16 checkpoint that `bench/weights.py` builds, this simulates each weight
format in place ("fake quantization": the writer's selection of layers, quantized with the writer's
quantizer, decoded back to bf16 exactly as the quantized layers decode at forward time) and reports
- the weight-level relative L2 error of the quantized layers (the format's own precision),
- the DiT output's relative L2 error against bf16 (what bench/weights.py reports) and its ratio to
  the weight error (how much the network amplifies it),
- the error of every block's output (error vs depth) and the hidden state's RMS vs depth,
- optionally (`--kinds`) the output error when only one kind of layer is quantized,
- `noiseN`: plain Gaussian noise of N % of each layer's RMS on the same layers: the amplification of
  a format-free weight error of known size.

    python bench/quant_error.py --data DATA_DIR/weights/dense/bf16 --formats noise1,fp8,q8_0,q4_0

Memory: one bf16 model (2.8 GB for the dense DiT) plus one layer kind's originals with `--kinds`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import torch.nn as nn

KINDS = ("text_embedder", "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out", "ffn.gate_proj", "ffn.up_proj",
         "ffn.down_proj")


def quantized_layers(model: nn.Module, fmt: str) -> list[tuple[str, nn.Linear]]:
    """The linears the writers quantize for `fmt` (GGUF: rows of a multiple of 32 values)."""
    from lingbot_core.weights.loader import quantizable

    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and quantizable(f"{name}.weight", tuple(module.weight.shape)):
            if fmt == "fp8" or module.weight.shape[-1] % 32 == 0:
                out.append((name, module))
    return out


def fake_quantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """`weight` through format `fmt` and back to its dtype, as the loaded layer decodes it."""
    from lingbot_core.weights import gguf_codec
    from lingbot_core.weights.fp8 import dequantize_fp8, quantize_fp8

    if fmt.startswith("noise"):  # e.g. noise1: Gaussian noise of 1 % of the tensor's RMS, no format at all
        g = torch.Generator().manual_seed(weight.numel())
        rms = weight.float().pow(2).mean().sqrt()
        return (weight.float() + float(fmt[5:]) / 100 * rms * torch.randn(weight.shape, generator=g)).to(weight.dtype)
    if fmt == "fp8":
        q, scale = quantize_fp8(weight)
        return dequantize_fp8(q, scale, weight.dtype)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[fmt.upper()]
    raw = quantize(weight.float().numpy(), qtype)
    return gguf_codec.dequantize(torch.from_numpy(raw), int(qtype), tuple(weight.shape), weight.dtype)


def _forward(model: nn.Module, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    captured: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda _m, _a, out: captured.append(out.detach().float().clone()))
             for b in model.blocks]
    try:
        with torch.no_grad():
            sample = model(*inputs).sample.float()
    finally:
        for h in hooks:
            h.remove()
    return sample, captured


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def run(folder: Path, formats: list[str], kinds: bool, video_tokens: int, text_tokens: int) -> dict[str, Any]:
    from bench.weights import _inputs
    from lingbot_core.weights.loader import load_dit

    def fresh() -> nn.Module:
        return load_dit(folder, dtype=torch.bfloat16)

    model = fresh()
    inputs = _inputs(dict(model.config), video_tokens, text_tokens)
    reference, ref_blocks = _forward(model, inputs)
    report: dict[str, Any] = {"folder": str(folder), "video_tokens": video_tokens, "text_tokens": text_tokens,
                              "hidden_rms_by_depth": [float(h.pow(2).mean().sqrt()) for h in ref_blocks],
                              "formats": {}}
    for fmt in formats:
        t0 = time.perf_counter()
        if model is None:
            model = fresh()
        num = den = 0.0
        per_kind_weight: dict[str, list[float]] = {}
        for name, layer in quantized_layers(model, fmt):
            w = layer.weight.data
            q = fake_quantize(w, fmt)
            diff = float((q.float() - w.float()).pow(2).sum())
            norm = float(w.float().pow(2).sum())
            num, den = num + diff, den + norm
            kind = next((k for k in KINDS if k in name), "other")
            per_kind_weight.setdefault(kind, []).append((diff / norm) ** 0.5)
            w.copy_(q)
        sample, blocks = _forward(model, inputs)
        weight_err = (num / den) ** 0.5
        out_err = _rel(sample, reference)
        report["formats"][fmt] = {
            "weight_rel_l2": weight_err, "output_rel_l2": out_err, "amplification": out_err / weight_err,
            "block_rel_l2_by_depth": [_rel(b, r) for b, r in zip(blocks, ref_blocks)],
            "weight_rel_l2_by_kind": {k: float(np.mean(v)) for k, v in per_kind_weight.items()},
            "seconds": time.perf_counter() - t0,
        }
        print(fmt, json.dumps({k: v for k, v in report["formats"][fmt].items() if k != "block_rel_l2_by_depth"}),
              flush=True)
        del model
        model = None
    if kinds:
        model = fresh()
        for fmt in [f for f in formats if not f.startswith("noise")]:
            only: dict[str, float] = {}
            for kind in KINDS:
                layers = [(n, m) for n, m in quantized_layers(model, fmt) if kind in n]
                saved = [m.weight.data.clone() for _, m in layers]
                for _, m in layers:
                    m.weight.data.copy_(fake_quantize(m.weight.data, fmt))
                only[kind] = _rel(_forward(model, inputs)[0], reference)
                for (_, m), w in zip(layers, saved):
                    m.weight.data.copy_(w)
                del saved
                print(fmt, kind, f"{only[kind]:.4f}", flush=True)
            report["formats"][fmt]["output_rel_l2_only_kind"] = only
    return report


def render(report: dict[str, Any]) -> str:
    lines = [f"{report['video_tokens']} video + {report['text_tokens']} text tokens; {report['folder']}",
             "| format | weight rel-L2 | output rel-L2 | output / weight | block 1 | block 12 | block 24 |",
             "|---|---|---|---|---|---|---|"]
    for fmt, r in report["formats"].items():
        depth = r["block_rel_l2_by_depth"]
        picks = [depth[0], depth[len(depth) // 2 - 1], depth[-1]]
        lines.append(f"| {fmt} | {r['weight_rel_l2']:.2%} | {r['output_rel_l2']:.2%} | {r['amplification']:.2f} | "
                     + " | ".join(f"{p:.2%}" for p in picks) + " |")
    rms = report["hidden_rms_by_depth"]
    lines.append(f"hidden-state RMS by depth: block 1 {rms[0]:.3g}, block 12 {rms[len(rms) // 2 - 1]:.3g}, "
                 f"block 24 {rms[-1]:.3g}")
    for fmt, r in report["formats"].items():
        if "output_rel_l2_only_kind" in r:
            parts = ", ".join(f"{k} {v:.2%}" for k, v in r["output_rel_l2_only_kind"].items())
            lines.append(f"{fmt}, only one kind quantized -> output rel-L2: {parts}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a bf16 checkpoint folder (with transformer/)")
    parser.add_argument("--formats", default="noise1,fp8,q8_0,q4_0")
    parser.add_argument("--kinds", action="store_true", help="also quantize one layer kind at a time")
    parser.add_argument("--video-tokens", type=int, default=256)
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    report = run(args.data, args.formats.split(","), args.kinds, args.video_tokens, args.text_tokens)
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
