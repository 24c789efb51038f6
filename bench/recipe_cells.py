"""The cells the generated tables share, below the writer that assembles them (`bench/recipes.py`):
the FFN chunk setting runs use, how a VRAM figure is printed, and the DMD student's recipe per machine.

`bench/memory_table.py` and `bench/files_table.py` take these from here; `bench/recipes.py` imports
those tables and hands these names on, so the arrows run one way (tables -> this module, writer ->
tables). Every figure comes from `lingbot_core.placement` (the estimator and fit check `auto` decides
with): an ESTIMATE, not a measurement. Nothing here runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lingbot_core.placement.recipes import (
    FORMATS,
    FRAMES,
    machine_budget,
    model_facts,
    sizes_for,
    vram_needed,
)

GB, GiB = 1e9, 1024**3


def _best(sizes, geometry, to: str, vram: int, host: int) -> str | None:
    """The fastest mode that fits (the rule `auto` and the recipes use)."""
    from lingbot_core.placement.fit import _best_mode

    return _best_mode(sizes, geometry, to, vram, host)


def run_chunk() -> int | str | None:
    """The FFN chunk setting runs use unless told otherwise: the handle settings' default (the Loaders'
    widget defaults to the same; tests/test_advice.py checks), read from the field, not copied."""
    from lingbot_core.handle import HandleSettings

    return HandleSettings().ffn_chunk


def need_cell(gib: float | None, chunk: int | None) -> str:
    """A VRAM figure as the tables print it: the fit check's GiB, and the FFN chunk `auto` resolves to."""
    if gib is None:
        return "—"
    return f"{gib:.1f} GiB" + (f" ({chunk:,}-token chunks)" if chunk else "")


# -- the DMD student (robbyant/lingbot-video-moe-dmd-30b-a3b) ----------------------------------------------

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
    peak_gib: float | None = None  # the fit check's figure under `mode` at `at` (the recipe's size when it fits)
    at: str = "—"
    chunk: int | None = None  # the FFN/MoE chunk `ffn_chunk: auto` resolves to there

    def row(self) -> list[str]:
        return [f"{self.vram_gb} GB", f"{self.ram_gb} GB", self.weights,
                f"`{self.mode}`" if self.mode != "—" else "—",
                f"`{self.offload_to}`" if self.offload_to != "—" else "—", self.base,
                f"{need_cell(self.peak_gib, self.chunk)} at {self.at}" if self.peak_gib is not None else "—"]


def student_plan(fmt: str, to: str, vram: int, host: int) -> dict | None:
    """The student with `fmt` weights homed in `to` (cfg 1, no refiner, tiled decode): the largest base
    size that fits and the fastest mode there; None when no size fits."""
    from lingbot_core.placement.estimate import Geometry, host_bytes
    from lingbot_core.placement.fit import BASE_SIZES

    sizes = student_sizes(fmt)
    if to == "disk" and model_facts()["moe"]["dit"][fmt] > host - host_bytes("sequential", sizes, to):
        return None  # the page cache could not keep the DiT file: every step would read the disk
    fits = [(g, mode) for h, w in BASE_SIZES
            if (mode := _best(sizes, (g := Geometry(h, w, FRAMES, cfg=False, vae_tiling=True, ffn_chunk=run_chunk())),
                              to, vram, host))]
    if not fits:
        return None
    recipe_g = Geometry(*STUDENT_RECIPE, FRAMES, cfg=False, vae_tiling=True, ffn_chunk=run_chunk())
    at_recipe = _best(sizes, recipe_g, to, vram, host)
    return dict(base=(fits[0][0].height, fits[0][0].width), mode=at_recipe or fits[0][1],
                geometry=recipe_g if at_recipe else fits[0][0], sizes=sizes, recipe=at_recipe is not None)


def student_recipe(vram_gb: int, ram_gb: int) -> StudentRecipe:
    """The best way to run the student on this machine: the recipe's 832x480 first, then the largest
    base size, bf16 over smaller formats, RAM over disk, the fastest mode; each from the estimator."""
    vram, host = machine_budget(vram_gb, ram_gb)
    options = [(fmt, to, plan) for to in ("ram", "disk") for fmt in FORMATS
               if (plan := student_plan(fmt, to, vram, host)) is not None]
    if not options:
        return StudentRecipe(vram_gb, ram_gb)
    fmt, to, plan = max(options, key=lambda o: (o[2]["recipe"], o[2]["base"][0] * o[2]["base"][1],
                                                -FORMATS.index(o[0]), o[1] == "ram"))
    dit = model_facts()["moe"]["dit"][fmt]
    weights = f"{fmt} ({dit / GB:.1f} GB" + (", quantize)" if fmt != "bf16" else ", as published)")
    need, chunk = vram_needed(plan["mode"], plan["sizes"], plan["geometry"], vram)
    h, w = plan["base"]
    g = plan["geometry"]
    return StudentRecipe(vram_gb, ram_gb, weights, plan["mode"], to, f"{w}x{h}x{FRAMES}", need / GiB,
                         f"{g.width}x{g.height}x{FRAMES}", chunk)
