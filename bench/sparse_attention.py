"""Sparse attention (`attention: sparse`) against dense SDPA: attention time, the output's error, the work.

One self-attention layer of the real DiT's shape per head (head_dim 128, the model's RMS norms and
3-axis rotary embedding, random weights), fed a hidden state with the smooth spatial structure of a
video latent (low-frequency waves over the token grid plus noise), at the token counts of
832x480 videos of 33, 65 and 121 frames (12,480 / 24,960 / 48,360 video tokens, 30x52 per latent
frame) plus 512 text tokens at the end. Per density setting it reports, side by side with dense
SDPA in the same process:
- `attn s`: seconds of the attention call (best of `--repeats`);
- `rel L2`: ||sparse - dense|| / ||dense|| of the attention output;
- `blocks`: the share of (query block, key block) pairs computed exactly, by the path's own count
  (dense computes all of them; the pooled rest costs one score per pair).

This is a mechanism check on a CPU through the **eager path** (plain torch, a Python loop over
query blocks): it shows the work the routing skips and the error it costs on random weights. The
eager path is not a fast kernel; its time says little about comfy-kitchen's CUDA kernel, which
was not run (no GPU). Random weights: real activations route differently.

    python bench/sparse_attention.py --heads 1 --threads 2
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

FRAMES = (8, 16, 31)  # latent frames of 33, 65 and 121 video frames
ROWS, COLS, TEXT = 30, 52, 512  # 832x480 after the VAE (8x) and the 2x2 patch
SETTINGS = {"tau 1.0 (default)": dict(tau=1.0), "tau 0.5": dict(tau=0.5),
            "density 0.5": dict(density=0.5), "density 0.25": dict(density=0.25)}


def layer_inputs(frames: int, heads: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """q, k, v (1, S, heads, 128) of one random-weight DiT attention layer over a structured hidden
    state, and the video token count."""
    from lingbot_core.models.config import DiTConfig
    from lingbot_core.models.rotary import AxialRotary, joint_positions, rotate_pairs
    from lingbot_core.models.transformer import SelfAttention

    torch.manual_seed(seed)
    spec = DiTConfig(hidden_size=128 * heads, num_attention_heads=heads)
    attn = SelfAttention(spec).eval()
    grid = (frames, ROWS, COLS)
    n_video = frames * ROWS * COLS
    pos = torch.stack(torch.meshgrid(*(torch.arange(n, dtype=torch.float32) / n for n in grid), indexing="ij"), -1)
    pos = pos.reshape(n_video, 3)
    width = spec.hidden_size
    freqs = torch.randn(3, 16) * 3.0  # 16 low-frequency waves over (t, y, x)
    waves = torch.cos(pos @ freqs + torch.rand(16) * 2 * math.pi)  # (n_video, 16)
    video = waves @ torch.randn(16, width) + 0.5 * torch.randn(n_video, width)
    text = torch.randn(TEXT, width)
    x = torch.cat((video, text))[None]
    rotations = AxialRotary(spec.axes_dims, spec.axes_lens, spec.rope_theta)(joint_positions(TEXT, TEXT, grid, x.device))
    with torch.no_grad():
        q = rotate_pairs(attn.norm_q(attn.to_q(x).unflatten(-1, attn.heads)), rotations[None])
        k = rotate_pairs(attn.norm_k(attn.to_k(x).unflatten(-1, attn.heads)), rotations[None])
        v = attn.to_v(x).unflatten(-1, attn.heads)
    return q, k, v, n_video


def best_time(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=1, help="attention heads of 128 (the model has 16)")
    parser.add_argument("--frames", default=",".join(map(str, FRAMES)), help="latent frames per size, comma-separated")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="which density settings, comma-separated")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from bench._common import print_machine
    from lingbot_core.models.sparse_attention import SparseSettings, eager_sparse_attention

    chosen = [s.strip() for s in args.settings.split(",") if s.strip()]
    print_machine()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.heads} head(s) of 128, float32, "
          "eager sparse path (not the fast kernel)")
    print(f"{'tokens':>7} {'setting':<18} {'attn s':>8} {'vs dense':>8} {'rel L2':>7} {'blocks':>7}")
    for frames in (int(f) for f in args.frames.split(",")):
        q, k, v, n_video = layer_inputs(frames, args.heads)
        tokens = q.shape[1]

        dense = partial(torch.nn.functional.scaled_dot_product_attention,
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        with torch.no_grad():
            dense_s, want = best_time(dense, args.repeats)
            want = want.transpose(1, 2)
            print(f"{tokens:>7} {'dense SDPA':<18} {dense_s:>8.2f} {1.0:>8.2f} {0.0:>7.3f} {1.0:>7.3f}", flush=True)
            for name in chosen:
                settings = SparseSettings(min_tokens=0, dense_first=0.0, dense_blocks=(), **SETTINGS[name])
                stats: dict[str, int] = {}
                took, got = best_time(partial(eager_sparse_attention, q, k, v, settings, n_video, stats), args.repeats)
                error = float((got - want).norm() / want.norm())
                share = stats["computed"] / stats["dense"]
                print(f"{tokens:>7} {name:<18} {took:>8.2f} {took / dense_s:>8.2f} {error:>7.3f} {share:>7.3f}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
