"""One source of truth for memory advice: every VRAM figure the README and the workflow Notes print comes
from `bench/recipes.py` (which calls `lingbot_core.placement.recipes`: the fit check's figure under the
FFN chunk setting the Loaders default to), so no two places can disagree."""

from __future__ import annotations

import inspect
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _guide() -> str:
    """The README and the docs/ pages that hold the reference it moved out (`bench.recipes.GUIDE`)."""
    from bench.recipes import GUIDE

    return "\n".join(path.read_text(encoding="utf-8") for path in GUIDE)


@pytest.fixture(scope="module")
def blocks():
    from bench import recipes

    return recipes.blocks()


def test_every_memory_block_in_the_readme_is_the_generators(blocks):
    """`python bench/recipes.py --write` owns each block, in the one guide page that holds it; a hand edit
    or a stale figure fails here. The README keeps the blocks a user acts on (the files table, the 12/16 GB
    choice, the 24 GB MoE command); the others are reference (docs/memory.md, docs/few-step.md)."""
    from bench import files_table, recipes

    assert len(blocks) == 7
    guide = _guide()
    for start, end, text in blocks:
        assert guide.count(start) == 1 and guide.count(end) == 1, start
        page = recipes.home(start).read_text(encoding="utf-8")
        assert recipes.readme_block(page, start, end) == text, f"stale {start}: run python bench/recipes.py --write"
    for start in (files_table.START, recipes.CHOICE_START, recipes.MOE_START):
        assert recipes.home(start) == recipes.README, start


def test_the_generator_uses_the_loaders_default_ffn_chunk_and_the_fit_checks_reserve():
    """The chunk setting is read from the handle, and it is what both Loaders default to; the figure is
    the fit check's (its estimate plus `RESERVE_BYTES`), for the chunk the fit check resolves."""
    from bench import recipes
    from lingbot_core.handle import ffn_chunk_setting
    from lingbot_core.placement import fit
    from lingbot_core.placement import recipes as core
    from lingbot_core.placement.estimate import Geometry
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    chunk = recipes.run_chunk()
    for name in ("LingBotLoader", "LingBotLoaderFiles"):
        schema = NODE_CLASS_MAPPINGS[name].define_schema()
        (widget,) = [i for i in schema.inputs if getattr(i, "id", getattr(i, "name", None)) == "ffn_chunk"]
        assert ffn_chunk_setting(widget.default) == chunk, name
    assert inspect.signature(core.recipe_for).parameters["ffn_chunk"].default == chunk  # the doctor's recipe too
    cell = recipes.recipe(24, 64)
    vram, host = recipes.machine_budget(24, 64)
    w, h = map(int, cell.refine.split("x"))
    verdict = fit.check(recipes.sizes_for("moe", cell.weights.split(" (")[0]),
                        Geometry(480, 832, 121, refine=(h, w), vae_tiling=True, release_base=True, ffn_chunk=chunk),
                        cell.mode, cell.offload_to, vram_free=vram, host_free=host)
    assert verdict.ok, verdict.line()
    assert f"~{cell.need_gib:.1f} GiB VRAM" in verdict.line() and verdict.ffn_chunk == cell.chunk


def test_a_24gb_card_refines_where_the_fit_check_says_it_does():
    """The recipes once said 1280x736 (counted without FFN chunks) while the fit check refined a 24 GB
    card at 1920x1088: the two now agree, and no README line quotes the unchunked ~36 GiB."""
    from bench import recipes

    lines = dict(((v, r), line) for v, r, line in recipes.fit_lines())
    assert lines[recipes.EXAMPLE_MACHINES[1]].startswith("fits:")
    assert recipes.recipe(24, 64).refine == "1920x1088"
    assert lines[recipes.EXAMPLE_MACHINES[0]].startswith("needs ")  # the example shows advice too
    assert "needs about 36 GiB" not in _guide() and "needs about 36 GiB" not in _notes()


def _notes() -> str:
    out = []
    for path in sorted((ROOT / "workflows").glob("*.json")):
        for node in json.loads(path.read_text()).get("nodes", []):
            if node.get("type") in ("Note", "MarkdownNote"):
                out.extend(str(v) for v in node.get("widgets_values", []))
    return "\n".join(out)


def test_workflow_notes_quote_the_generators_figures():
    """Notes are built from `note_figures()` (workflows/build.py), each the per-mode table's figure for
    the same run, and every GiB figure a shipped Note prints is one of them."""
    sys.path.insert(0, str(ROOT))
    from bench import recipes
    from bench.memory_table import collect
    from workflows import build

    figures = recipes.note_figures()
    assert build.NOTE_FIGURES == figures
    table = collect()["estimate"]
    rows = {"dense_model": ("dense 832x480x121", "model"), "dense_tiled": ("dense 832x480x121, tiled decode", "group"),
            "dense_none": ("dense 832x480x121", "none"), "moe_base": ("moe 832x480x121 (base only)", "group")}
    for name, (row, mode) in rows.items():
        assert f"{table[row][mode] / 1024**3:.1f}" == f"{figures[name]}", name
    refine = figures["refine"]
    cell = recipes.recipe(refine["gpu_gb"], refine["ram_gb"])
    assert (refine["size"], refine["gib"]) == (cell.refine, round(cell.need_gib, 1))
    notes = _notes()
    quoted = {float(x) for x in re.findall(r"about (\d+(?:\.\d+)?) GiB", notes)}
    assert quoted and quoted <= {v for k, v in figures.items() if k != "refine"} | {refine["gib"]}, quoted


def _moe_command() -> list[str]:
    block = README[README.index("<!-- moe-command:start"):README.index("<!-- moe-command:end")]
    return shlex.split(block.split("lingbot-run", 1)[1].split("```")[0].replace("\\\n", " "))


def test_the_24gb_moe_command_is_the_recipes_own():
    """Its folder is the quantize command's output for the recipe's format; its mode, home and refine
    size are the recipe's; its comment names the RAM size."""
    from bench import recipes

    cell = recipes.recipe(*recipes.MOE_MACHINE)
    argv = _moe_command()
    fmt = cell.weights.split(" (")[0]
    folder = argv[argv.index("--model") + 1]
    assert folder.endswith(recipes.MOE_FOLDERS[fmt])
    if fmt in recipes.QUANTIZE_TO:
        assert re.search(rf"lingbot_core\.quantize \S+ {re.escape(folder)} --to {recipes.QUANTIZE_TO[fmt]}", README)
    sets = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    assert sets["Offload.mode"] == cell.mode and sets["Offload.offload_to"] == cell.offload_to
    assert f"{sets['Refine.width']}x{sets['Refine.height']}" == cell.refine
    assert f"with {recipes.MOE_MACHINE[1]} GB of RAM" in README[README.index("<!-- moe-command:start"):]


def test_the_12_16gb_choice_is_explained_once_and_pointed_to():
    """Both tables that answer for a 12 or 16 GB card point to the one place that weighs the two: the
    README's files table (dense) and the recipes in docs/memory.md (the MoE)."""
    heading = "### 12 or 16 GB: dense or MoE?"
    assert _guide().count(heading) == 1 and README.count(heading) == 1
    assert "](#12-or-16-gb-dense-or-moe)" in README
    assert "](../README.md#12-or-16-gb-dense-or-moe)" in (ROOT / "docs" / "memory.md").read_text(encoding="utf-8")
    from bench import recipes

    block = recipes.readme_block(README, recipes.CHOICE_START, recipes.CHOICE_END)
    for word in ("download", "quantize", "quality", "step"):
        assert word in block, word


def test_the_readmes_words_about_the_figures_name_the_real_constants():
    """The prose around the tables states the reserve and the machine's shares: each is the constant the
    generator uses (a changed constant makes the prose wrong: this fails)."""
    from lingbot_core.placement.estimate import RESERVE_BYTES
    from lingbot_core.placement.recipes import DESKTOP_GIB, SYSTEM_GIB, GiB

    guide = _guide()
    reserves = set(re.findall(r"(\d+(?:\.\d+)?) GiB reserve", guide))
    assert reserves == {f"{RESERVE_BYTES / GiB:g}"}, reserves
    for share in re.findall(r"(\d+(?:\.\d+)?) GiB of the\s+card", guide):
        assert float(share) == DESKTOP_GIB, share
    for share in re.findall(r"(\d+(?:\.\d+)?) GiB of RAM (?:are taken|left)", guide):
        assert float(share) == SYSTEM_GIB, share
    assert re.search(r"\d GiB of the\s+card", README) and re.search(r"GiB of RAM (?:are taken|left)", guide)
