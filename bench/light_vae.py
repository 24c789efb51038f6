"""The light decoder (TAEHV / LightTAE) against the full Wan 2.1 VAE: decode time and peak memory.

Why: Decode's `vae: light` claims to be many times faster and to need a fraction of the memory of
the Wan 2.1 VAE. Side by side in one process, on the same latents (1,16,T,h,w), both with seeded
random weights (time and memory only; random weights say nothing of quality):

- `full`: diffusers' `AutoencoderKLWan` built from the shipped Wan 2.1 config (what Decode runs);
- `light`: `models.light_vae.LightVideoDecoder` (what `vae: light` runs), float32 on the CPU.

Reported per decoder: seconds and CPU seconds of this process (best of `--repeats`, after one profiled
call; on a shared machine the CPU seconds are the steadier figure), the torch CPU bytes the call adds at its peak
(`_common.cpu_peak_bytes`: net of weights and inputs) and the process's peak RSS after it (the light
one runs first: peak RSS only grows), then the ratios full / light.

832x480x121 (31 latent frames) takes the full VAE far too long on a small shared CPU, so the default
is 832x480 at `--frames 5` (2 latent frames); both decoders run frame by frame (the Wan VAE with its
causal cache, the light one a latent frame per chunk), so time grows about linearly with the frames.

    python bench/light_vae.py --threads 2                # 832x480, 5 frames
    python bench/light_vae.py --frames 121 --only light  # the light decoder alone at the real length
    python bench/light_vae.py --quick                    # 16x16, 5 frames (smoke test)
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench._common import cpu_peak_bytes, environment, fmt_bytes, run_main, table

DECODERS = ("light", "full")  # the light one first: peak RSS only grows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--frames", type=int, default=5, help="video frames (4k+1)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--only", choices=DECODERS, help="run one decoder only (no ratios)")
    p.add_argument("--quick", action="store_true", help="16x16, 5 frames (smoke test)")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    if args.quick:
        args.height, args.width, args.frames = 16, 16, 5
    if (args.frames - 1) % 4 or args.height % 8 or args.width % 8:
        p.error("--frames must be 4k+1 and --height/--width multiples of 8")
    return args


def _full_vae() -> Any:
    from diffusers import AutoencoderKLWan

    from lingbot_core.checkpoints.vae_file import shipped_config

    torch.manual_seed(0)
    config = {k: v for k, v in shipped_config().items() if not k.startswith("_")}
    return AutoencoderKLWan.from_config(config).eval().requires_grad_(False)


def _light_vae() -> Any:
    from lingbot_core.models.light_vae import LightVideoDecoder

    torch.manual_seed(0)
    model = LightVideoDecoder().eval().requires_grad_(False)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    return model


def _decode(name: str, model: Any, z: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if name == "full":
            return model.decode(z, return_dict=False)[0]
        return model(z)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lingbot_core.latents import latent_shape

    torch.set_num_threads(args.threads)
    shape = latent_shape(args.height, args.width, args.frames)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    rows: dict[str, dict[str, Any]] = {}
    for name in DECODERS:
        if args.only and name != args.only:
            continue
        model = _full_vae() if name == "full" else _light_vae()
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        peak, out = cpu_peak_bytes(lambda m=model, n=name: _decode(n, m, z))  # also the warm-up
        best, cpu = float("inf"), float("inf")
        for _ in range(args.repeats):  # timed without the profiler
            start, start_cpu = time.perf_counter(), time.process_time()
            _decode(name, model, z)
            best, cpu = min(best, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
        rows[name] = {"seconds": best, "cpu_seconds": cpu, "peak_bytes": peak, "peak_rss": _peak_rss(), "weights_bytes": weights,
                      "frames_out": tuple(out.shape[2:])}
        del model, out
    result: dict[str, Any] = {"latents": list(shape), "video": [args.frames, args.height, args.width],
                              "decoders": rows, "env": environment()}
    if "full" in rows and "light" in rows:
        full, light = rows["full"], rows["light"]
        result["ratios"] = {"time_full_over_light": full["seconds"] / light["seconds"],
                            "cpu_time_full_over_light": full["cpu_seconds"] / light["cpu_seconds"],
                            "peak_full_over_light": full["peak_bytes"] / max(light["peak_bytes"], 1)}
    return result


def report(result: dict[str, Any]) -> str:
    frames, height, width = result["video"]
    lines = [f"decode {width}x{height}x{frames} (latents {'x'.join(map(str, result['latents']))}), CPU, "
             f"{result['env']['threads']} thread(s), random weights"]
    rows = [[name, f"{r['seconds']:.2f}", f"{r['cpu_seconds']:.2f}", fmt_bytes(r["peak_bytes"]), fmt_bytes(r["peak_rss"]),
             fmt_bytes(r["weights_bytes"]), "x".join(map(str, r["frames_out"]))]
            for name, r in result["decoders"].items()]
    lines.append(table(["decoder", "seconds", "CPU seconds", "peak (torch)", "peak RSS", "weights", "out T x H x W"], rows))
    if "ratios" in result:
        r = result["ratios"]
        lines.append(f"full / light: {r['time_full_over_light']:.1f}x the time ({r['cpu_time_full_over_light']:.1f}x the "
                     f"CPU time), "
                     f"{r['peak_full_over_light']:.1f}x the peak memory")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_main(parse_args, run, report, argv)


if __name__ == "__main__":
    main()
