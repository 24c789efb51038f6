"""The README's hardware recipes: for each GPU x RAM size, what to download and which settings fit.

Every cell comes from `lingbot_core.placement.recipes.recipe_for` (the estimator `auto` and the fit
check decide with, on the real configurations built on `meta`): an ESTIMATE, not a measurement, until a
GPU run confirms it (`python -m lingbot_core.doctor` on a GPU prints the row for its machine, checked
against measured peaks). Nothing here runs a model. How a cell is chosen: that module's docstring.

    python bench/recipes.py            # print the table
    python bench/recipes.py --write    # and put it into README.md (between the recipes markers)

The machine: a card of N GB has N GiB, of which `DESKTOP_GIB` is taken by the driver and display;
of the host RAM, `SYSTEM_GIB` is left to the OS and other programs.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from a plain checkout

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
)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
START, END = "<!-- recipes:start (python bench/recipes.py --write) -->", "<!-- recipes:end -->"
VRAM_GB = (8, 12, 16, 24, 48, 80)
RAM_GB = (32, 64, 128)
GB, GiB = 1e9, 1024**3


def _best(sizes, geometry, to: str, vram: int, host: int) -> str | None:
    """The fastest mode that fits (the rule `auto` and the recipes use)."""
    from lingbot_core.placement.fit import _best_mode

    return _best_mode(sizes, geometry, to, vram, host)


def recipe(vram_gb: int, ram_gb: int) -> Recipe:
    """The README's cell for a card of `vram_gb` GB in a machine with `ram_gb` GB of RAM."""
    vram, host = machine_budget(vram_gb, ram_gb)
    return recipe_for(vram, host, vram_gb=vram_gb, ram_gb=ram_gb)


# -- the DMD student (robbyant/lingbot-video-moe-dmd-30b-a3b) ----------------------------------------------

STUDENT_START = "<!-- student-recipes:start (python bench/recipes.py --write) -->"
STUDENT_END = "<!-- student-recipes:end -->"
STUDENT_RECIPE = (480, 832)  # the upstream recipe's size (H, W), 121 frames, 8 steps, cfg 1


def student_sizes(fmt: str):
    """The student root as `auto` sees it: the MoE's transformer in `fmt`, no refiner."""
    return replace(sizes_for("moe", fmt), refiner=0)


def student_download() -> int:
    """Bytes of the student root: the MoE folder without refiner/ (same configurations)."""
    facts = model_facts()["moe"]
    return facts["download"] - facts["refiner"]


@dataclass(frozen=True)
class StudentRecipe:
    vram_gb: int
    ram_gb: int
    weights: str = "—"
    mode: str = "—"
    offload_to: str = "—"
    base: str = "nothing fits"
    peak_gib: float | None = None  # the estimate under `mode` at `at` (the recipe's size when it fits)
    at: str = "—"

    def row(self) -> list[str]:
        return [f"{self.vram_gb} GB", f"{self.ram_gb} GB", self.weights,
                f"`{self.mode}`" if self.mode != "—" else "—",
                f"`{self.offload_to}`" if self.offload_to != "—" else "—", self.base,
                f"{self.peak_gib:.1f} GiB at {self.at}" if self.peak_gib is not None else "—"]


def student_plan(fmt: str, to: str, vram: int, host: int) -> dict | None:
    """The student with `fmt` weights homed in `to` (cfg 1, no refiner, tiled decode): the largest base
    size that fits and the fastest mode there; None when no size fits."""
    from lingbot_core.memory import Geometry, host_bytes
    from lingbot_core.placement.fit import BASE_SIZES

    sizes = student_sizes(fmt)
    if to == "disk" and model_facts()["moe"]["dit"][fmt] > host - host_bytes("sequential", sizes, to):
        return None  # the page cache could not keep the DiT file: every step would read the disk
    fits = [(g, mode) for h, w in BASE_SIZES
            if (mode := _best(sizes, (g := Geometry(h, w, FRAMES, cfg=False, vae_tiling=True)), to, vram, host))]
    if not fits:
        return None
    recipe_g = Geometry(*STUDENT_RECIPE, FRAMES, cfg=False, vae_tiling=True)
    at_recipe = _best(sizes, recipe_g, to, vram, host)
    return dict(base=(fits[0][0].height, fits[0][0].width), mode=at_recipe or fits[0][1],
                geometry=recipe_g if at_recipe else fits[0][0], sizes=sizes, recipe=at_recipe is not None)


def student_recipe(vram_gb: int, ram_gb: int) -> StudentRecipe:
    """The best way to run the student on this machine: the recipe's 832x480 first, then the largest
    base size, bf16 over smaller formats, RAM over disk, the fastest mode; each from the estimator."""
    from lingbot_core import memory

    vram = int((vram_gb - DESKTOP_GIB) * GiB)
    host = int((ram_gb - SYSTEM_GIB) * GiB)
    options = [(fmt, to, plan) for to in ("ram", "disk") for fmt in FORMATS
               if (plan := student_plan(fmt, to, vram, host)) is not None]
    if not options:
        return StudentRecipe(vram_gb, ram_gb)
    fmt, to, plan = max(options, key=lambda o: (o[2]["recipe"], o[2]["base"][0] * o[2]["base"][1],
                                                -FORMATS.index(o[0]), o[1] == "ram"))
    dit = model_facts()["moe"]["dit"][fmt]
    weights = f"{fmt} ({dit / GB:.1f} GB" + (", quantize)" if fmt != "bf16" else ", as published)")
    peak = memory.estimate_peak(plan["mode"], plan["sizes"], plan["geometry"]) / GiB
    h, w = plan["base"]
    g = plan["geometry"]
    return StudentRecipe(vram_gb, ram_gb, weights, plan["mode"], to, f"{w}x{h}x{FRAMES}", peak,
                         f"{g.width}x{g.height}x{FRAMES}")


def student_table() -> str:
    from bench.memory_table import table as markdown

    rows = [student_recipe(v, r).row() for v in VRAM_GB for r in RAM_GB]
    return markdown(["GPU", "RAM", "student DiT weights", "offload", "offload_to", "largest size",
                     "GPU peak (estimate)"], rows) + "\n\n" + student_24gb_line()


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
                f"(`offload_to: {cell.offload_to}`), {cell.peak_gib:.1f} GiB at {cell.at}")

    download = student_download()
    q8, q4 = quantize_minutes("GGUF Q8_0"), quantize_minutes("GGUF Q4_0")
    return (f"**On a 24 GB card** (estimates): with 64 GB of RAM, {say(cells[64])}; with 32 GB, {say(cells[32])}; "
            f"with 128 GB, {say(cells[128])}. Download: the root is {download / GB:.1f} GB (about "
            f"{download / (DOWNLOAD_MB_S * 1e6) / 60:.0f} min at {DOWNLOAD_MB_S} MB/s). Quantize: about {q8:.0f} min "
            f"for Q8_0 ({q4:.0f} min for Q4_0) plus reading the 60 GB DiT from disk, EXTRAPOLATED from one "
            "6144x2048 layer timed on one core of a busy CPU (`python bench/quantize_time.py`), not a full run.")


def table() -> str:
    from bench.memory_table import table as markdown

    rows = [recipe(v, r).row() for v in VRAM_GB for r in RAM_GB]
    return markdown(["GPU", "RAM", "model", "download", "weights", "offload", "offload_to", "largest size",
                     "refine up to"], rows)


def _block(text: str, start: str = START, end: str = END) -> re.Match:
    match = re.search(re.escape(start) + r"\n(.*?)" + re.escape(end), text, flags=re.S)
    if match is None:
        raise SystemExit(f"README.md has no {start} ... {end} block")
    return match


def readme_block(text: str, start: str = START, end: str = END) -> str:
    """The table as the README holds it now (the student's: `STUDENT_START`, `STUDENT_END`)."""
    return _block(text, start, end).group(1).strip("\n")


def write_readme(out: str, start: str = START, end: str = END) -> None:
    text = README.read_text()
    match = _block(text, start, end)
    README.write_text(text[:match.start(1)] + out + "\n" + text[match.end(1):])


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="replace the table in README.md")
    args = parser.parse_args(argv)
    out = table()
    student = student_table()
    print(out)
    print()
    print(student)
    if args.write:
        write_readme(out)
        if STUDENT_START in README.read_text():
            write_readme(student, STUDENT_START, STUDENT_END)
    return out


if __name__ == "__main__":
    main()
