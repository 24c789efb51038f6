"""The README's "Which files do I need?" numbers: file sizes of the single-file parts users keep in
ComfyUI's model folders, and what the recommended recipe per GPU size needs on the GPU.

Nothing runs a model or needs a GPU. Sizes are computed from the real configurations built on the
`meta` device (as `bench/memory_table.py` does): bf16 = 2 bytes per parameter; ComfyUI's scaled fp8
text encoder = 1 byte per Linear weight of the decoder layers and vision blocks (+ one float32 scale
each), the rest bf16; GGUF sizes are bits per weight times the DiT's parameter count. The GPU column
is `lingbot_core.memory.estimate_peak` (the estimate `auto` decides with): an ESTIMATE, not a
measurement. Files are dequantized to bf16 for compute, so the GPU estimate does not depend on
whether the text encoder file is bf16 or fp8 (only disk and host RAM do).

    python bench/files_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

import torch

from bench.memory_table import GB, GiB, build, params, table

# (GPU, variant, W, H, frames, refine size or None, tiled decode, offload mode)
RECIPES = (
    ("8 GB", "dense", 576, 320, 121, None, True, "group"),
    ("12 GB", "dense", 832, 480, 121, None, True, "model"),
    ("16 GB", "dense", 1280, 736, 121, None, True, "group"),
    ("24 GB", "moe", 832, 480, 121, (736, 1280), True, "group"),
)
# The DMD student's row (its DiT as one GGUF from `python -m lingbot_core.quantize`): the recipe of
# `bench/recipes.py` for a 24 GB card with 64 GB of RAM (tests/test_dmd_student.py checks the README row)
STUDENT_GPU, STUDENT_RAM_GB = "24 GB, DMD student", 64
# llama.cpp's bits per weight of the types in a *_K_M file (the mix is mostly these; estimate)
GGUF_BITS = {"Q3_K_M": 3.9, "Q4_K_M": 4.85}


def fp8_scaled_bytes(text_encoder: torch.nn.Module) -> int:
    total = 0
    for name, p in text_encoder.named_parameters():
        linear = p.dim() == 2 and ("layers." in name or "visual.blocks." in name)
        total += p.numel() + 4 if linear else p.numel() * 2
    return total


def main() -> None:
    from lingbot_core import memory

    dense, moe = build("dense"), build("moe")
    te = dense["text_encoder"]
    sizes_gb = {
        "dense DiT, bf16": params(dense["transformer"]) * 2 / GB,
        "MoE DiT, bf16 (each of base, refiner)": params(moe["transformer"]) * 2 / GB,
        **{f"MoE DiT, GGUF {k} (estimate)": params(moe["transformer"]) * b / 8 / GB for k, b in GGUF_BITS.items()},
        "text encoder, bf16 (qwen3vl_4b_bf16)": params(te) * 2 / GB,
        "text encoder, scaled fp8 (qwen3vl_4b_fp8_scaled)": fp8_scaled_bytes(te) / GB,
        "VAE, bf16 (wan_2.1_vae)": params(dense["vae"]) * 2 / GB,
        "VAE, fp32 (checkpoint vae/)": params(dense["vae"]) * 4 / GB,
    }
    print(table(["file", "GB"], [[k, f"{v:.2f}"] for k, v in sizes_gb.items()]))
    print()
    rows = []
    for gpu, variant, width, height, frames, refine, tiled, mode in RECIPES:
        components = dense if variant == "dense" else moe
        sizes = memory.sizes_from_modules(components)
        geometry = memory.Geometry(height=height, width=width, num_frames=frames, refine=refine, vae_tiling=tiled)
        peak = memory.estimate_peak(mode, sizes, geometry)
        what = f"{variant} {width}x{height}x{frames}" + (f" + refine {refine[1]}x{refine[0]}" if refine else "")
        rows.append([gpu, what + (", tiled decode" if tiled else ""), mode, f"{peak / GiB:.1f}"])
    from bench.recipes import student_recipe

    cell = student_recipe(int(STUDENT_GPU.split()[0]), STUDENT_RAM_GB)
    rows.append([STUDENT_GPU, f"student {cell.at}, no CFG, tiled decode; DiT {cell.weights}", cell.mode,
                 f"{cell.peak_gib:.1f}"])
    print(table(["GPU", "recipe", "offload", "GPU GiB (estimate)"], rows))


if __name__ == "__main__":
    main()
