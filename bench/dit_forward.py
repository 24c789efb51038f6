"""One DiT forward on CPU: our broadcast time modulation against the reference's per-token one.

Why: the reference expands the timestep embedding to every token and runs `time_modulation` (and
`norm_out_modulation`) per token in float32, a (B, S, 6D) tensor that is gigabytes at video sizes.
Ours computes it once per sample and broadcasts. This script runs both on the same random-weight
model, in one process, checks they compute the same thing, and reports time and memory as ratios.

Peak memory is what torch allocates on the CPU during the forward, from the profiler's memory
events (`bench/_common.cpu_peak_bytes`); weights and inputs that exist before the call are excluded.

    python bench/dit_forward.py                 # dense, hidden 512, depth 4, 3200 video + 256 text tokens
    python bench/dit_forward.py --moe           # 16 experts top-4, 4 groups top-2, one shared expert
    python bench/dit_forward.py --quick         # tiny sizes (the smoke test)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's C++ logger is chatty on stderr
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

import torch

from bench._common import (
    cpu_peak_bytes,
    environment,
    fmt,
    fmt_bytes,
    max_abs_diff,
    run_main,
    table,
)
from lingbot_core.models.rotary import joint_positions
from lingbot_core.models.transformer import LingBotVideoTransformer3DModel

TOLERANCE = 1e-5
REAL_SIZES = (  # (label, video tokens, text tokens, hidden): reference-model.md §8
    ("dense 480x832x121", 31 * 30 * 52, 1024, 2048),
    ("refiner 1088x1920x121", 31 * 68 * 120, 1024, 2048),
)


class PerTokenModulationDiT(torch.nn.Module):
    """The reference's timestep path over one of our models: t_emb expanded to every token.

    Everything else is our forward, unchanged (same modules, same weights), so the two variants
    differ only in where the modulation is computed: `time_modulation` and `norm_out_modulation`
    run on (B, S, D) in float32, and every block gets a (B, S, 6D) temb6.
    """

    def __init__(self, model: LingBotVideoTransformer3DModel):
        super().__init__()
        self.model = model

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        m = self.model
        b, _, t, h, w = hidden_states.shape
        pt, ph, pw = m.config.patch_size
        grid = (t // pt, h // ph, w // pw)
        n_video, n_text = math.prod(grid), encoder_hidden_states.shape[1]
        device = hidden_states.device
        dtype = m.patch_embedder.weight.dtype
        video = m.patch_embedder(m._patchify(hidden_states).to(dtype))
        text = m.text_embedder(encoder_hidden_states.to(m.text_embedder.linear_1.weight.dtype))
        x = torch.cat([video, text.to(video.dtype)], dim=1)
        rotations = torch.stack([m.rope(joint_positions(n_text, n_text, grid, device))] * b)

        timestep = timestep.to(device=device).float().reshape(-1).expand(b)
        t_emb = m.time_embedder(m.time_proj(timestep).to(m.time_embedder.linear_1.weight.dtype))
        per_token = t_emb[:, None, :].expand(b, x.shape[1], t_emb.shape[-1])  # the reference's expand
        temb6 = m.time_modulation(per_token).float()  # (B, S, 6D) float32
        for block in m.blocks:
            x = block(x, temb6, rotations, None)
        shift, scale = m.norm_out_modulation(per_token).float()[:, :n_video].chunk(2, dim=-1)
        x = m.norm_out(x[:, :n_video]) * (1.0 + scale) + shift
        return m._unpatchify(m.proj_out(x.to(m.proj_out.weight.dtype)), hidden_states.shape)


def dit_config(args: argparse.Namespace) -> dict[str, Any]:
    axes = tuple(int(a) for a in args.axes_dims.split(","))
    config: dict[str, Any] = dict(
        hidden_size=args.hidden, num_attention_heads=args.heads, depth=args.depth,
        intermediate_size=args.intermediate, text_dim=args.text_dim, freq_dim=args.freq_dim, axes_dims=axes,
    )
    if args.moe:
        config.update(num_experts=args.experts, num_experts_per_tok=args.top_k, n_group=args.n_group,
                      topk_group=args.topk_group, n_shared_experts=1, moe_intermediate_size=args.moe_intermediate,
                      routed_scaling_factor=2.5)
    return config


def build_model(config: dict[str, Any], seed: int) -> LingBotVideoTransformer3DModel:
    """Random weights with the tiny checkpoint's rules (seeded per tensor; non-zero tables and biases)."""
    from lingbot_core.tiny import _randomize

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LingBotVideoTransformer3DModel(**config).eval().requires_grad_(False)
    _randomize(model, seed, "transformer")
    return model


def temb_bytes(video_tokens: int, text_tokens: int, hidden: int, batch: int = 1) -> dict[str, int]:
    """Analytic float32 bytes of the modulation tensors: per token (reference) vs per sample (ours)."""
    s = video_tokens + text_tokens
    return {"per_token_temb6": batch * s * 6 * hidden * 4, "per_token_norm_out": batch * s * 2 * hidden * 4,
            "ours_temb6": batch * 6 * hidden * 4, "ours_norm_out": batch * 2 * hidden * 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--axes-dims", default="16,24,24", help="RoPE axes (t,h,w); must sum to hidden/heads")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1536, help="dense FFN width")
    p.add_argument("--text-dim", type=int, default=256)
    p.add_argument("--freq-dim", type=int, default=256)
    p.add_argument("--text-tokens", type=int, default=256)
    p.add_argument("--latent", default="1,16,5,40,64", help="B,C,T,H,W of the DiT-space latent")
    p.add_argument("--moe", action="store_true", help="MoE FFN in every block instead of the dense one")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--n-group", type=int, default=4)
    p.add_argument("--topk-group", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per variant (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat (smoke test)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.heads, args.axes_dims, args.depth, args.intermediate = 64, 2, "8,12,12", 2, 128
        args.text_dim, args.freq_dim, args.text_tokens, args.latent = 32, 32, 16, "1,16,2,8,8"
        args.experts, args.top_k, args.n_group, args.topk_group, args.moe_intermediate = 8, 2, 2, 1, 32
        args.repeats, args.warmup = 1, 0
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    config = dit_config(args)
    model = build_model(config, args.seed)
    baseline = PerTokenModulationDiT(model)
    shape = tuple(int(v) for v in args.latent.split(","))
    g = torch.Generator().manual_seed(args.seed + 1)
    latents = torch.randn(shape, generator=g)
    text = torch.randn(shape[0], args.text_tokens, args.text_dim, generator=g)
    timestep = torch.tensor([737.0])
    n_video = shape[2] * (shape[3] // 2) * (shape[4] // 2)

    variants = {
        "ours (broadcast)": lambda: model(latents, timestep, text, return_dict=False)[0],
        "baseline (per-token)": lambda: baseline(latents, timestep, text),
    }
    with torch.inference_mode():
        outputs = {name: fn() for name, fn in variants.items()}  # also the first warm-up
        for _ in range(args.warmup):
            for fn in variants.values():
                fn()
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats):  # interleaved, so drift on a busy machine hits both alike
            for name, fn in variants.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        peaks = {name: cpu_peak_bytes(fn)[0] for name, fn in variants.items()}

    ours, base = outputs["ours (broadcast)"], outputs["baseline (per-token)"]
    diff = max_abs_diff(ours, base)
    analytic = temb_bytes(n_video, args.text_tokens, args.hidden, shape[0])
    medians = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    rows = []
    for name in variants:
        per_token = name.startswith("baseline")
        rows.append({
            "variant": name,
            "median_s": medians[name],
            "times_s": times[name],
            "peak_bytes": peaks[name],
            "temb_bytes": analytic["per_token_temb6" if per_token else "ours_temb6"]
            + analytic["per_token_norm_out" if per_token else "ours_norm_out"],
            "time_ratio_vs_baseline": medians[name] / medians["baseline (per-token)"],
            "peak_ratio_vs_baseline": peaks[name] / max(peaks["baseline (per-token)"], 1),
            "max_abs_diff_vs_baseline": 0.0 if per_token else diff,
        })
    base_times = times["baseline (per-token)"]
    paired = sorted(o / b for o, b in zip(times["ours (broadcast)"], base_times))
    real = [{"size": label, "tokens": v + t, **temb_bytes(v, t, d)} for label, v, t, d in REAL_SIZES]
    return {
        "benchmark": "dit_forward",
        "config": {**config, "latent": list(shape), "text_tokens": args.text_tokens, "video_tokens": n_video,
                   "dtype": "float32", "repeats": args.repeats, "warmup": args.warmup},
        "memory_method": "torch.profiler profile_memory=True: peak of the running sum of CPU [memory] events",
        "rows": rows,
        "paired_time_ratio_median": paired[len(paired) // 2] if paired else None,
        "max_abs_diff": diff,
        "tolerance": TOLERANCE,
        "equal_within_tolerance": bool(diff <= TOLERANCE),
        "real_sizes": real,
        "environment": environment(),
    }


def report(result: dict[str, Any]) -> str:
    c = result["config"]
    kind = f"MoE {c['num_experts']}e top-{c['num_experts_per_tok']}" if c.get("num_experts") else "dense"
    head = (f"DiT forward, {kind}, hidden {c['hidden_size']}, depth {c['depth']}, {c['video_tokens']} video + "
            f"{c['text_tokens']} text tokens, fp32, {result['environment']['threads']} threads, "
            f"median of {c['repeats']}")
    rows = [[r["variant"], fmt(r["median_s"]), fmt(r["time_ratio_vs_baseline"]), fmt_bytes(r["peak_bytes"]),
             fmt(r["peak_ratio_vs_baseline"]), fmt_bytes(r["temb_bytes"]), fmt(r["max_abs_diff_vs_baseline"])]
            for r in result["rows"]]
    verdict = "PASS" if result["equal_within_tolerance"] else "FAIL"
    lines = [head, table(["variant", "time s", "time/base", "peak alloc", "peak/base", "temb fp32", "max|diff|"], rows),
             f"outputs equal within {result['tolerance']:g}: {verdict} (max |diff| {result['max_abs_diff']:.3g}); "
             f"median of per-repeat time ratios ours/base: {fmt(result['paired_time_ratio_median'])}",
             f"peak = {result['memory_method']}", "",
             "analytic modulation memory at real sizes (fp32; the reference also makes a same-size transient "
             "`temb6 + table` in every block):"]
    lines.append(table(["size", "tokens", "per-token temb6", "per-token norm_out", "ours temb6"],
                       [[r["size"], str(r["tokens"]), fmt_bytes(r["per_token_temb6"]),
                         fmt_bytes(r["per_token_norm_out"]), fmt_bytes(r["ours_temb6"])] for r in result["real_sizes"]]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_main(parse_args, run, report, argv)


if __name__ == "__main__":
    main()
