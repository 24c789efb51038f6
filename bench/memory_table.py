"""The README's tables: size on disk of the real checkpoints, and what each offload mode needs.

Why a script: the numbers in the README must be reproducible, not typed in. Nothing here runs a
model or needs a GPU. The components are built on the `meta` device from the real configurations
(the DiTs from `lingbot_core/configs/`, Qwen3-VL-4B and the Wan 2.1 VAE from the geometry that
`bench/offload_gpu.py` uses), so parameter counts are exact for those configurations and no memory
is allocated. The accelerator columns are the fit check's figure (`lingbot_core.placement.recipes.
vram_needed`: the estimate `auto` decides with plus its reserve) under the Loaders' default `ffn_chunk`
("auto", read from `PipelineHandle.open`) on the smallest card that can run it, i.e. with the FFN/MoE at
its smallest chunk where chunks help: an ESTIMATE, not a measurement (no GPU run has confirmed it yet).

    python bench/memory_table.py            # markdown tables
    python bench/memory_table.py --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import replace
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
    from lingbot_core.checkpoints.loading import load_component
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
    from bench.recipe_cells import run_chunk
    from lingbot_core.placement import estimate, recipes

    out: dict[str, Any] = {"disk": {}, "estimate": {}, "reserve_bytes": estimate.RESERVE_BYTES,
                           "ffn_chunk": run_chunk()}
    for variant in ("dense", "moe"):
        components = build(variant)
        # bf16 on disk for the DiT(s) and text encoder, fp32 for the VAE: 2 and 4 bytes per parameter.
        disk = {name: params(m) * (4 if name == "vae" else 2) for name, m in components.items()}
        out["disk"][variant] = {"params": {n: params(m) for n, m in components.items()}, "bytes": disk}
        sizes = recipes.model_facts()[variant]["sizes"]
        for height, width, frames, refine, tiled in ROWS[variant]:
            geometry = estimate.Geometry(height=height, width=width, num_frames=frames,
                                       refine=REFINE if refine else None, vae_tiling=tiled, ffn_chunk=run_chunk())
            key = f"{variant} {width}x{height}x{frames}"
            key += f" + refine {REFINE[1]}x{REFINE[0]}" if refine else (" (base only)" if variant == "moe" else "")
            key += ", tiled decode" if tiled else ""
            # Refine's release_base "auto" (its default): the base DiT is dropped unless the mode is `none`
            out["estimate"][key] = {m: recipes.vram_needed(m, sizes, replace(geometry, release_base=bool(refine)
                                                                             and m != "none"), 0)[0]
                                    for m in MODES}
    return out


def report(data: dict[str, Any]) -> str:
    lines = ["Size on disk (parameters x 2 bytes for bf16 DiT and text encoder, x 4 for the fp32 VAE):", ""]
    rows = []
    for variant, info in data["disk"].items():
        b, p = info["bytes"], info["params"]
        parts = ", ".join(f"{name} {p[name] / 1e9:.2f} B params = {b[name] / GB:.2f} GB" for name in b)
        rows.append([REPOS[variant], parts, f"{sum(b.values()) / GB:.1f} GB"])
    lines += [table(["checkpoint", "components", "total"], rows), ""]
    lines += ["The least VRAM each offload mode needs (the fit check's ESTIMATE, GiB, with its "
              f"{data['reserve_bytes'] / GiB:.1f} GiB reserve, ffn_chunk {data['ffn_chunk']!r}):", ""]
    lines.append(mode_table(data))
    return "\n".join(lines)


def mode_table(data: dict[str, Any]) -> str:
    """The README's per-mode table (`python bench/recipes.py --write` puts it there)."""
    rows = [[key, *(f"{est[m] / GiB:.1f}" for m in MODES)] for key, est in data["estimate"].items()]
    return table(["model and size (W x H x frames)", *MODES], rows)


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
