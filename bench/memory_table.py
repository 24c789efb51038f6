"""The README's tables: size on disk of the real checkpoints, and what each offload mode needs.

Why a script: the numbers in the README must be reproducible, not typed in. Nothing here runs a
model or needs a GPU. The components are built on the `meta` device from the real configurations
(the DiTs from `lingbot_core/configs/`, Qwen3-VL-4B and the Wan 2.1 VAE from the geometry that
`bench/offload_gpu.py` uses), so parameter counts are exact for those configurations and no memory
is allocated. The accelerator column is `lingbot_core.memory.estimate_peak`, the same estimate
the `auto` mode decides with: an ESTIMATE, not a measurement (no GPU run has confirmed it yet).

    python bench/memory_table.py            # markdown tables
    python bench/memory_table.py --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

import torch

from bench._common import write_json
from bench.offload_gpu import (
    QWEN3_VL_4B_TEXT,
    QWEN3_VL_4B_VISION,
    WAN_VAE,
    build_text_encoder,
    build_transformer,
    build_vae,
    qwen_config,
)
from lingbot_core.placement.modes import MODE_ORDER

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"dense": ROOT / "lingbot_core" / "configs" / "dense-1.3b.transformer.json",
           "moe": ROOT / "lingbot_core" / "configs" / "moe-30b-a3b.transformer.json"}
REPOS = {"dense": "robbyant/lingbot-video-dense-1.3b", "moe": "robbyant/lingbot-video-moe-30b-a3b",
         "moe-dmd": "robbyant/lingbot-video-moe-dmd-30b-a3b"}  # the DMD student: the MoE's shapes, no refiner/
# (height, width, frames, refine, tiled VAE decode) at the reference's default T2V size and its
# 720p (736-based) size. The base decode is untiled by default (as in the reference); the refiner
# pass always decodes tiled.
ROWS = {
    "dense": ((480, 832, 121, False, False), (480, 832, 121, False, True),
              (736, 1280, 121, False, False), (736, 1280, 121, False, True)),
    "moe": ((480, 832, 121, False, False), (480, 832, 121, True, False), (736, 1280, 121, True, False)),
}
REFINE = (1088, 1920)  # the MoE refiner's output size (reference default)
MODES = tuple(MODE_ORDER)  # every registered offload mode, fastest first
META = torch.device("meta")
GB = 1e9
GiB = 1024**3


@functools.cache
def build(variant: str) -> dict[str, Any]:
    """(Cached: the README tests build each variant once.) Meta-device components in the load dtypes on a GPU: bf16 DiT(s) and text encoder, fp32 VAE."""
    from lingbot_core.checkpoint import load_component
    from lingbot_core.tiny import ensure_tiny_checkpoint

    tokenizer = load_component(ensure_tiny_checkpoint("dense"), "processor").tokenizer  # special-token ids only
    dit = build_transformer(json.loads(CONFIGS[variant].read_text()), META, torch.bfloat16, 0)
    components = {
        "transformer": dit,
        "text_encoder": build_text_encoder(qwen_config(QWEN3_VL_4B_TEXT, QWEN3_VL_4B_VISION, tokenizer), META,
                                           torch.bfloat16, 0),
        "vae": build_vae(dict(WAN_VAE), META, torch.float32, 0),
    }
    if variant == "moe":
        components["refiner"] = dit  # same class and config as the base DiT; its own weights on disk
    return components


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table, pasted into the README as printed."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(out + ["| " + " | ".join(row) + " |" for row in rows])


def params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def collect() -> dict[str, Any]:
    from lingbot_core import memory

    out: dict[str, Any] = {"disk": {}, "estimate": {}, "reserve_bytes": memory.RESERVE_BYTES}
    for variant in ("dense", "moe"):
        components = build(variant)
        # bf16 on disk for the DiT(s) and text encoder, fp32 for the VAE: 2 and 4 bytes per parameter.
        disk = {name: params(m) * (4 if name == "vae" else 2) for name, m in components.items()}
        out["disk"][variant] = {"params": {n: params(m) for n, m in components.items()}, "bytes": disk}
        sizes = memory.sizes_from_modules(components)
        for height, width, frames, refine, tiled in ROWS[variant]:
            geometry = memory.Geometry(height=height, width=width, num_frames=frames,
                                       refine=REFINE if refine else None, vae_tiling=tiled)
            key = f"{variant} {width}x{height}x{frames}"
            key += f" + refine {REFINE[1]}x{REFINE[0]}" if refine else (" (base only)" if variant == "moe" else "")
            key += ", tiled decode" if tiled else ""
            out["estimate"][key] = {m: memory.estimate_peak(m, sizes, geometry) for m in MODES}
    return out


def report(data: dict[str, Any]) -> str:
    lines = ["Size on disk (parameters x 2 bytes for bf16 DiT and text encoder, x 4 for the fp32 VAE):", ""]
    rows = []
    for variant, info in data["disk"].items():
        b, p = info["bytes"], info["params"]
        parts = ", ".join(f"{name} {p[name] / 1e9:.2f} B params = {b[name] / GB:.2f} GB" for name in b)
        rows.append([REPOS[variant], parts, f"{sum(b.values()) / GB:.1f} GB"])
    lines += [table(["checkpoint", "components", "total"], rows), ""]
    lines += ["Peak accelerator memory per offload mode (ESTIMATE from lingbot_core.memory, GiB; "
              f"`auto` also keeps {data['reserve_bytes'] / GiB:.1f} GiB spare):", ""]
    rows = [[key, *(f"{est[m] / GiB:.1f}" for m in MODES)] for key, est in data["estimate"].items()]
    lines.append(table(["model and size", *MODES], rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args(argv)
    data = collect()
    print(report(data))
    write_json(args.json, data)
    return data


if __name__ == "__main__":
    main()
