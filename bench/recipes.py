"""The hardware recipes (docs/memory.md): for each GPU x RAM size, what to download and which settings fit.

Every cell comes from `lingbot_core.placement.recipes.recipe_for` (the estimator `auto` and the fit
check decide with, on the real configurations built on `meta`): an ESTIMATE, not a measurement, until a
GPU run confirms it (`python -m lingbot_core.doctor` on a GPU prints the row for its machine, checked
against measured peaks). Nothing here runs a model. How a cell is chosen: that module's docstring.

    python bench/recipes.py            # print the table
    python bench/recipes.py --write    # and put every memory block where it is (between its markers)

One source for the memory advice of the README and its docs/ pages: `--write` regenerates every block that
quotes a VRAM figure, in whichever of `GUIDE` holds its markers (the README: "Which files for my card" from
`bench/files_table.py`, the 12/16 GB choice and the 24 GB MoE command; docs/memory.md: this table, the
per-mode table from `bench/memory_table.py` and the fit-check example; docs/few-step.md: the DMD
student's recipes); the workflow Notes take
theirs from `lingbot_core.placement.recipes` too (`workflows/build.py`). Every figure is the fit check's
(`recipes.vram_needed`: the estimate plus its reserve) under the FFN chunk setting the Loaders default to
(`run_chunk`, read from `PipelineHandle.open`).

The machine: a card of N GB has N GiB, of which `DESKTOP_GIB` is taken by the driver and display;
of the host RAM, `SYSTEM_GIB` is left to the OS and other programs.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

from bench.recipe_cells import (  # noqa: F401  (the tables' cells; tests and the docs read them here too)
    GB,
    GiB,
    StudentRecipe,
    need_cell,
    run_chunk,
    student_download,
    student_plan,
    student_recipe,
    student_sizes,
)
from lingbot_core.placement.recipes import (  # noqa: F401  (re-exported: the README tests read them here)
    DESKTOP_GIB,
    FORMATS,
    FRAMES,
    SYSTEM_GIB,
    Recipe,
    machine_budget,
    model_facts,
    recipe_for,
    sizes_for,
    vram_needed,
)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The user's guide: the README and the docs/ pages it links for reference (tests/test_readme.py runs the
# commands of all of them); each generated block lives in exactly one of these files.
GUIDE = (README, *(ROOT / "docs" / f"{name}.md" for name in (
    "memory", "single-files", "comfyui", "headless", "few-step", "speed", "weights", "rewrite", "video", "parallel")))
START, END = "<!-- recipes:start (python bench/recipes.py --write) -->", "<!-- recipes:end -->"
VRAM_GB = (8, 12, 16, 24, 48, 80)
RAM_GB = (32, 64, 128)


def recipe(vram_gb: int, ram_gb: int) -> Recipe:
    """The README's cell for a card of `vram_gb` GB in a machine with `ram_gb` GB of RAM."""
    vram, host = machine_budget(vram_gb, ram_gb)
    return recipe_for(vram, host, vram_gb=vram_gb, ram_gb=ram_gb, ffn_chunk=run_chunk())


# -- the DMD student (robbyant/lingbot-video-moe-dmd-30b-a3b) ----------------------------------------------

STUDENT_START = "<!-- student-recipes:start (python bench/recipes.py --write) -->"
STUDENT_END = "<!-- student-recipes:end -->"


def student_table() -> str:
    from bench.memory_table import table as markdown

    rows = [student_recipe(v, r).row() for v in VRAM_GB for r in RAM_GB]
    return markdown(["GPU", "RAM", "student DiT weights", "offload", "offload_to", "largest size",
                     "VRAM (fit check)"], rows) + "\n\n" + student_24gb_line()


# `python bench/quantize_time.py --threads 1` on one 6144x2048 bf16 layer (a busy, shared 2-core CPU,
# load ~7): seconds per layer, extrapolated there to the MoE DiT's 30.08 B values. Not a full conversion.
QUANTIZE_LAYER_S = {"GGUF Q8_0": 0.420, "GGUF Q4_0": 0.401}
QUANTIZE_LAYER_VALUES = 6144 * 2048
DOWNLOAD_MB_S = 100  # the connection speed the download time is quoted for


def quantize_minutes(fmt: str) -> float:
    """The whole DiT's conversion time, extrapolated from the one measured layer (disk read not included)."""
    from bench.quantize_time import dit_values

    return dit_values("moe") / (QUANTIZE_LAYER_VALUES / QUANTIZE_LAYER_S[fmt]) / 60


def student_24gb_line() -> str:
    """The 24 GB answer users look for: format, offload mode, size, download and quantize time."""
    cells = {ram: student_recipe(24, ram) for ram in RAM_GB}

    def say(cell: StudentRecipe) -> str:
        return (f"{cell.weights.split(' (')[0]} ({cell.weights.split('(')[1].split(',')[0]}) under `{cell.mode}` "
                f"(`offload_to: {cell.offload_to}`), {need_cell(cell.peak_gib, cell.chunk)} at {cell.at}")

    download = student_download()
    q8, q4 = quantize_minutes("GGUF Q8_0"), quantize_minutes("GGUF Q4_0")
    return (f"**On a 24 GB card** (estimates): with 64 GB of RAM, {say(cells[64])}; with 32 GB, {say(cells[32])}; "
            f"with 128 GB, {say(cells[128])}. Download: the root is {download / GB:.1f} GB (about "
            f"{download / (DOWNLOAD_MB_S * 1e6) / 60:.0f} min at {DOWNLOAD_MB_S} MB/s). Quantize: about {q8:.0f} min "
            f"for Q8_0 ({q4:.0f} min for Q4_0) plus reading the 60 GB DiT from disk, EXTRAPOLATED from one "
            "6144x2048 layer timed on one core of a busy CPU (`python bench/quantize_time.py`), not a full run.")


def table() -> str:
    from bench.memory_table import table as markdown

    cells = [recipe(v, r) for v in VRAM_GB for r in RAM_GB]
    rows = [[*c.row(), need_cell(c.need_gib, c.chunk)] for c in cells]
    return markdown(["GPU", "RAM", "model", "download", "weights", "offload", "offload_to", "largest size",
                     "refine up to", "VRAM (fit check)"], rows)


def _block(text: str, start: str = START, end: str = END) -> re.Match:
    match = re.search(re.escape(start) + r"\n(.*?)" + re.escape(end), text, flags=re.S)
    if match is None:
        raise SystemExit(f"no {start} ... {end} block")
    return match


def readme_block(text: str, start: str = START, end: str = END) -> str:
    """The block as `text` (a guide page) holds it now (the student's: `STUDENT_START`, `STUDENT_END`)."""
    return _block(text, start, end).group(1).strip("\n")


def home(start: str) -> Path:
    """The one guide file that holds the block opened by `start`."""
    found = [path for path in GUIDE if start in path.read_text(encoding="utf-8")]
    if len(found) != 1:
        raise SystemExit(f"{start} should be in exactly one of the guide pages, found in {[p.name for p in found]}")
    return found[0]


def guide_block(start: str = START, end: str = END) -> str:
    """The block as its guide file holds it now."""
    return readme_block(home(start).read_text(encoding="utf-8"), start, end)


def write_readme(out: str, start: str = START, end: str = END) -> None:
    path = home(start)
    text = path.read_text(encoding="utf-8")
    match = _block(text, start, end)
    path.write_text(text[:match.start(1)] + out + "\n" + text[match.end(1):], encoding="utf-8")


# -- the blocks around the tables: the per-mode table, the fit-check example, the 24 GB MoE command ----------

MODES_START, MODES_END = "<!-- modes:start (python bench/recipes.py --write) -->", "<!-- modes:end -->"
FIT_START, FIT_END = "<!-- fit-example:start (python bench/recipes.py --write) -->", "<!-- fit-example:end -->"
MOE_START, MOE_END = "<!-- moe-command:start (python bench/recipes.py --write) -->", "<!-- moe-command:end -->"
MOE_MACHINE = (24, 64)  # the headless MoE command's machine: a 24 GB card, 64 GB of RAM
EXAMPLE_MACHINES = ((12, 64), (24, 64))  # the fit-check example: a card it refuses at 1920x1088, one it fits
REFINE_FULL = (1088, 1920)  # the refiner's reference size (height, width)
MOE_FOLDERS = {"bf16": "lingbot-video-moe-30b-a3b", "GGUF Q8_0": "lingbot-video-moe-q8",
               "GGUF Q4_0": "lingbot-video-moe-q4"}  # where the README's download / quantize lines put them
QUANTIZE_TO = {"GGUF Q8_0": "gguf-q8_0", "GGUF Q4_0": "gguf-q4_0"}


def modes_block() -> str:
    """The per-mode table (bench/memory_table.py) and the sentence that reads it."""
    from bench.memory_table import GiB as _GiB
    from bench.memory_table import collect, mode_table

    data = collect()
    est = data["estimate"]
    refined = est[f"moe 832x480x121 + refine {REFINE_FULL[1]}x{REFINE_FULL[0]}"]
    base = est["moe 832x480x121 (base only)"]
    sizes = model_facts()["moe"]["sizes"]
    row = replace(_moe_bf16_geometry(REFINE_FULL), vae_tiling=False, ffn_chunk=None)  # the table's row, unchunked
    off = {m: vram_needed(m, sizes, row, None)[0] for m in ("group", "sequential")}
    return (mode_table(data) + "\n\n"
            f"With `ffn_chunk: auto` the MoE refined to {REFINE_FULL[1]}x{REFINE_FULL[0]} needs at least "
            f"{refined['sequential'] / _GiB:.1f} GiB under `sequential` ({refined['group'] / _GiB:.1f} GiB under "
            f"`group`); its base pass alone {base['group'] / _GiB:.1f} GiB. With `ffn_chunk: off` the same run needs {off['sequential'] / _GiB:.1f} GiB under `sequential` "
            f"({off['group'] / _GiB:.1f} GiB under `group`). A card with more memory than the least runs larger "
            "chunks (fewer passes) or none: the recipes above give each card's figure.")


def _moe_bf16_geometry(refine: tuple[int, int] | None) -> Any:
    from lingbot_core.placement.estimate import Geometry

    return Geometry(480, 832, FRAMES, refine=refine, vae_tiling=True, release_base=True, ffn_chunk=run_chunk())


def fit_lines() -> list[tuple[int, int, str]]:
    """The Offload node's line for the MoE (bf16, `group`, `offload_to: disk`) at 832x480x121 refined at
    1920x1088, on each of `EXAMPLE_MACHINES`: (GPU GB, RAM GB, the line)."""
    from lingbot_core.placement import fit

    out = []
    for vram_gb, ram_gb in EXAMPLE_MACHINES:
        vram, host = machine_budget(vram_gb, ram_gb)
        verdict = fit.check(sizes_for("moe", "bf16"), _moe_bf16_geometry(REFINE_FULL), "group", "disk",
                            vram_free=vram, host_free=host)
        out.append((vram_gb, ram_gb, verdict.line()))
    return out


def fit_example() -> str:
    lines = fit_lines()
    said = [f"on a {v} GB card with {r} GB of RAM:\n`{line}`" for v, r, line in lines]
    return ("e.g. for the MoE under `group` with `offload_to: disk`, " + ";\n".join(said) + ".")


def moe_command() -> str:
    """The headless MoE command, the recipe's own for `MOE_MACHINE`: its weights, mode, home and sizes."""
    vram_gb, ram_gb = MOE_MACHINE
    cell = recipe(vram_gb, ram_gb)
    fmt = cell.weights.split(" (")[0]
    refine = cell.refine.split("x") if "x" in cell.refine else None
    first = (f"quantized to {fmt} first (`--to {QUANTIZE_TO[fmt]}` under \"Smaller DiT files\")" if fmt in QUANTIZE_TO
             else "as published")
    home = "streamed from disk" if cell.offload_to == "disk" else "offloaded to RAM"
    lines = [f"# MoE 30B-A3B on a {vram_gb} GB GPU with {ram_gb} GB of RAM, the recipe for that machine:",
             f"# the DiTs {first},",
             f"# {home} under `{cell.mode}`; the base pass at 832x480 (121 frames, 40 steps)"
             + (f" refined to {refine[0]}x{refine[1]}" if refine else ""),
             f"# (the fit check counts ~{cell.need_gib:.1f} GiB of VRAM with `ffn_chunk: auto`)",
             f"lingbot-run moe --model models/lingbot_video/{MOE_FOLDERS[fmt]} --output output \\",
             f"    --set Offload.mode={cell.mode} --set Offload.offload_to={cell.offload_to} \\",
             '    --set "Denoise (base).width=832" --set "Denoise (base).height=480" \\',
             '    --set "Denoise (base).frames=121" --set "Denoise (base).steps=40" \\']
    if refine:
        lines.append(f"    --set Refine.width={refine[0]} --set Refine.height={refine[1]} --set Refine.steps=8 \\")
    lines.append("    --set Save.filename_prefix=lingbot/moe_boat")
    return "```bash\n" + "\n".join(lines) + "\n```"


CHOICE_START, CHOICE_END = "<!-- choice:start (python bench/recipes.py --write) -->", "<!-- choice:end -->"
CHOICE_GPUS, CHOICE_RAM = (12, 16), 64


def choice_block() -> str:
    """The one place the README weighs the dense model against the MoE on a 12 or 16 GB card: both
    answers from `recipe_for` (the MoE's as the recipes table gives it, the dense model's as "Which files
    do I need?" does), with the download, the quantize step and what each step moves."""
    facts = model_facts()
    dense_dl, moe_dl = facts["dense"]["download"], facts["moe"]["download"]
    dit = facts["moe"]["dit"]

    def gib(cell: Recipe) -> str:
        return f"~{cell.need_gib:.1f} GiB" + (f", {cell.chunk:,}-token FFN chunks" if cell.chunk else "")

    parts, formats = [], []
    for gb in CHOICE_GPUS:
        moe = recipe(gb, CHOICE_RAM)
        vram, host = machine_budget(gb, CHOICE_RAM)
        dense = recipe_for(vram, host, vram_gb=gb, ram_gb=CHOICE_RAM, variants=("dense",), ffn_chunk=run_chunk())
        fmt = moe.weights.split(" (")[0]
        formats.append(fmt)
        parts.append(f"on {gb} GB the dense model runs {dense.base} under `{dense.mode}` ({gib(dense)}); the MoE "
                     f"832x480x121 refined to {moe.refine}, with {fmt} DiTs ({dit[fmt] / GB:.1f} GB each) under "
                     f"`{moe.mode}` and `offload_to: {moe.offload_to}` ({gib(moe)})")
    quantize = [f"{fmt} about {2 * quantize_minutes(fmt):.0f} min" for fmt in dict.fromkeys(formats)
                if fmt in QUANTIZE_LAYER_S]
    return (f"Both run (estimates, {CHOICE_RAM} GB of RAM): "
            + "; ".join(parts) + ". "
            f"The dense model is the short route: a {dense_dl / GB:.1f} GB download, no conversion, its "
            f"{facts['dense']['dit']['bf16'] / GB:.1f} GB DiT on the GPU for the whole run; its settings per card are "
            "in [Which files for my card](#which-files-for-my-card). The MoE is the larger model (30B parameters, "
            f"about 3B active per token) and the longer route: a {moe_dl / GB:.1f} GB download (the refiner "
            "included), then both DiTs quantized with `python -m lingbot_core.quantize` (output error per format: "
            "[Smaller DiT files](#smaller-dit-files))"
            + (": " + ", ".join(quantize) + " for the pair, EXTRAPOLATED from one layer timed on one core of an AMD EPYC "
               "(`python bench/quantize_time.py`), plus reading the bf16 files once" if quantize else "")
            + ". Each of its steps then moves a whole DiT to the GPU (from the page cache, or the disk when RAM "
            "is short), where the dense model computes on weights already there, so a MoE step is slower; "
            "neither the time per video nor the two models' output quality has been measured side by side yet. "
            "Start with the dense model; take the MoE for its larger model when the download, the disk and the "
            "slower steps are worth it to you.")


# -- the workflow Notes' figures (workflows/build.py writes them into the Notes) -------------------------------

NOTE_RUNS = {  # name -> (variant, mode, tiled decode, cfg): the least VRAM of an 832x480x121 run (per-mode table)
    "dense_model": ("dense", "model", False, True),
    "dense_tiled": ("dense", "group", True, True),
    "dense_none": ("dense", "none", False, True),
    "moe_base": ("moe", "group", False, True),
    "moe_base_cfg1": ("moe", "group", False, False),  # the few-step profiles (LightLingBot, the DMD student): cfg 1
}
NOTE_MACHINE = MOE_MACHINE  # the refine advice in the MoE Notes: this machine's recipe


def note_figures() -> dict[str, Any]:
    """What the workflow Notes quote: per `NOTE_RUNS` name the GiB the per-mode table prints (the fit
    check's least need under `ffn_chunk: auto`), and `refine`: the recipe of `NOTE_MACHINE` (its refine
    size "WxH", the fit check's GiB there, the chunk)."""
    from lingbot_core.placement.estimate import Geometry

    facts = model_facts()
    out: dict[str, Any] = {}
    for name, (variant, mode, tiled, cfg) in NOTE_RUNS.items():
        g = Geometry(480, 832, FRAMES, cfg=cfg, vae_tiling=tiled, ffn_chunk=run_chunk())
        out[name] = round(vram_needed(mode, facts[variant]["sizes"], g, 0)[0] / GiB, 1)
    cell = recipe(*NOTE_MACHINE)
    out["refine"] = dict(gpu_gb=NOTE_MACHINE[0], ram_gb=NOTE_MACHINE[1], size=cell.refine,
                         gib=round(cell.need_gib, 1), chunk=cell.chunk, mode=cell.mode,
                         weights=cell.weights.split(" (")[0], offload_to=cell.offload_to,
                         quantize=QUANTIZE_TO.get(cell.weights.split(" (")[0]))
    return out


def blocks() -> list[tuple[str, str, str]]:
    """Every README block this script owns: (start marker, end marker, text)."""
    from bench import files_table

    return [(START, END, table()), (STUDENT_START, STUDENT_END, student_table()),
            (files_table.START, files_table.END, files_table.gpu_table()), (MODES_START, MODES_END, modes_block()),
            (FIT_START, FIT_END, fit_example()), (MOE_START, MOE_END, moe_command()),
            (CHOICE_START, CHOICE_END, choice_block())]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="replace every memory block in the guide page that holds it")
    args = parser.parse_args(argv)
    out = blocks()
    for _start, _end, text in out:
        print(text)
        print()
    if args.write:
        for start, end, text in out:
            write_readme(text, start, end)
    return out[0][2]


if __name__ == "__main__":
    main()
