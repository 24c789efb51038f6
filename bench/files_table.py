"""The README's "Which files do I need?" numbers: file sizes of the single-file parts users keep in
ComfyUI's model folders, and what the recommended recipe per GPU size needs on the GPU.

Nothing runs a model or needs a GPU. Sizes are computed from the real configurations built on the
`meta` device (as `bench/memory_table.py` does): bf16 = 2 bytes per parameter; ComfyUI's scaled fp8
text encoder = 1 byte per Linear weight of the decoder layers and vision blocks (+ one float32 scale
each), the rest bf16; GGUF sizes are bits per weight times the DiT's parameter count. The settings and
the VRAM column come from `lingbot_core.placement.recipes` (the estimate and fit check `auto` decides
with, under the Loaders' default `ffn_chunk`; see bench/recipes.py): an ESTIMATE, not a measurement. Files are dequantized to bf16 for compute, so the GPU estimate does not depend on
whether the text encoder file is bf16 or fp8 (only disk and host RAM do).

    python bench/files_table.py        # print; `python bench/recipes.py --write` puts the GPU table in README.md
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

import torch

from bench.memory_table import GB, GiB, build, params, table

# The machine each row is worked out for: a card of N GB with this much RAM (bench/recipes.py's budgets)
FILES_RAM_GB = 64
DENSE_GPUS = (8, 12, 16)  # the dense route (one 2.7 GB DiT file); the 24 GB row: the community MoE GGUF
MOE_GPU, MOE_GGUF = 24, "Q4_K_M"
# The DMD student's row (its DiT as one GGUF from `python -m lingbot_core.quantize`): the recipe of
# `bench/recipes.py` for a 24 GB card with 64 GB of RAM (tests/test_dmd_student.py checks the README row)
STUDENT_GPU, STUDENT_RAM_GB = "24 GB, DMD student", 64
DENSE_DIT_FILE = "transformer/diffusion_pytorch_model.safetensors"  # the dense row's file, in the repository
START, END = "<!-- files:start (python bench/recipes.py --write) -->", "<!-- files:end -->"
# llama.cpp's bits per weight of the types in a *_K_M file (the mix is mostly these; estimate)
GGUF_BITS = {"Q3_K_M": 3.9, "Q4_K_M": 4.85}


def fp8_scaled_bytes(text_encoder: torch.nn.Module) -> int:
    total = 0
    for name, p in text_encoder.named_parameters():
        linear = p.dim() == 2 and ("layers." in name or "visual.blocks." in name)
        total += p.numel() + 4 if linear else p.numel() * 2
    return total


def _size(hw: tuple[int, int]) -> str:
    return f"{hw[1]}x{hw[0]}"


def gguf_plan(vram_gb: int, ram_gb: int, kind: str = MOE_GGUF) -> tuple[str, dict, float, int | None]:
    """The community MoE GGUF (`kind`, llama.cpp bits per weight) on this machine: offload_to, the plan
    (`recipes.plan_for`), the fit check's GiB and the FFN chunk for its headline run."""
    from bench.recipe_cells import run_chunk
    from lingbot_core.placement import recipes

    facts = recipes.model_facts()
    dit = facts["moe"]["dit"]
    bytes_ = int(dit["bf16"] / 16 * GGUF_BITS[kind])
    moe = {**facts["moe"], "dit": {**dit, kind: bytes_}}
    sizes = recipes.sizes_for("moe", kind, {**facts, "moe": moe})
    vram, host = recipes.machine_budget(vram_gb, ram_gb)
    found = recipes.plan_for("moe", sizes, bytes_, vram, host, run_chunk())
    if found is None:
        raise SystemExit(f"the {kind} GGUF fits no setting on {vram_gb} GB + {ram_gb} GB")
    to, plan = found
    need, chunk = recipes.vram_needed(plan["mode"], sizes, plan["geometry"], vram)
    return to, plan, need / GiB, chunk


def gpu_rows() -> list[list[str]]:
    """The README's "Which files do I need?" rows: the settings and VRAM figure each come from the estimator
    and fit check (`lingbot_core.placement.recipes`) for a card of that size with `FILES_RAM_GB` of RAM."""
    from bench.recipe_cells import need_cell, run_chunk, student_recipe
    from lingbot_core.placement import recipes

    te = "`qwen3vl_4b_bf16.safetensors` (8.88 GB) or `qwen3vl_4b_fp8_scaled.safetensors` (4.94 GB)"
    vae = "`wan_2.1_vae.safetensors` (0.25 GB)"
    dense = build("dense")
    rows = []
    for i, gb in enumerate(DENSE_GPUS):
        cell = recipes.recipe_for(*recipes.machine_budget(gb, FILES_RAM_GB), variants=("dense",),
                                  ffn_chunk=run_chunk())
        w, h, frames = cell.base.split("x")
        rows.append([f"{gb} GB", f"dense 1.3B, bf16: the checkpoint's `{DENSE_DIT_FILE}` "
                     f"({params(dense['transformer']) * 2 / GB:.2f} GB)" if i == 0
                     else "dense 1.3B, bf16", te if i == 0 else "`qwen3vl_4b_bf16.safetensors` or the fp8 one",
                     vae if i == 0 else "`wan_2.1_vae.safetensors`",
                     f"Offload `{cell.mode}`, `offload_to: {cell.offload_to}`, Decode `tiling`, {w}x{h}, {frames} frames",
                     need_cell(cell.need_gib, cell.chunk)])
    to, plan, gib, chunk = gguf_plan(MOE_GPU, FILES_RAM_GB)
    moe_bits = {k: params(build("moe")["transformer"]) * b / 8 / GB for k, b in GGUF_BITS.items()}
    refine = f", refine to {_size(plan['refine'])}" if plan["refine"] else ""
    rows.append([f"{MOE_GPU} GB", f"MoE 30B-A3B as GGUF: Q4_K_M (~{moe_bits['Q4_K_M']:.0f} GB) or Q3_K_M "
                 f"(~{moe_bits['Q3_K_M']:.0f} GB); optionally its refiner as a second file; the LightLingBot 4-step "
                 "LoRA in `models/loras`", "`qwen3vl_4b_bf16.safetensors`", "`wan_2.1_vae.safetensors`",
                 f"Offload `{plan['mode']}`, `offload_to: {to}`, 4 steps, 832x480x121{refine}",
                 need_cell(gib, chunk).replace(" GiB", f" GiB for {MOE_GGUF}", 1)])
    cell = student_recipe(int(STUDENT_GPU.split()[0]), STUDENT_RAM_GB)
    rows.append([STUDENT_GPU, "the student's `transformer/` as one GGUF written by `python -m lingbot_core.quantize` "
                 "(Q8_0, 32.0 GB; Q4_0, 17.0 GB, with 32 GB of RAM): no community GGUF of it yet",
                 "the student root's `text_encoder/` (Loader (files) `checkpoint`: the root) or "
                 "`qwen3vl_4b_bf16.safetensors`", "the root's `vae/` or `wan_2.1_vae.safetensors`",
                 f"Offload `{cell.mode}`, `offload_to: {cell.offload_to}`, Decode `tiling`, `dmd_student` 8 steps, "
                 f"cfg 1, shift 3, {cell.at}", need_cell(cell.peak_gib, cell.chunk)])
    return rows


def gpu_table() -> str:
    return table(["GPU", "DiT, in `models/diffusion_models`", "text encoder, in `models/text_encoders`",
                  "VAE, in `models/vae`", f"settings (with {FILES_RAM_GB} GB of RAM)", "VRAM (fit check)"], gpu_rows())


def main() -> None:
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
    print(gpu_table())


if __name__ == "__main__":
    main()
