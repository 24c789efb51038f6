"""The single-file route with Refine: the shipped files + Refine workflow runs as shipped and from a base
and a refiner file; a refiner file given to a workflow without Refine is refused."""

from __future__ import annotations

import shutil

import pytest

from lingbot_nodes.cli import SHORT_NAMES, main, resolve_workflow

NAME = "moe-gguf-refine"


def test_the_files_refine_workflow_has_a_name_and_both_nodes():
    from lingbot_core.workflow import load_workflow
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    path = resolve_workflow(NAME)
    from workflows import build

    assert path == build.api_path(SHORT_NAMES[NAME]) and build.thumbnail_path(path.stem).is_file()
    kinds = {n["class_type"] for n in load_workflow(path, NODE_CLASS_MAPPINGS).nodes.values()}
    assert {"LingBotLoaderFiles", "LingBotRefine"} <= kinds


@pytest.fixture
def moe_files(tmp_path):
    """The tiny MoE's base and refiner DiTs as two single files (as a user keeps them in diffusion_models)."""
    from lingbot_core.tiny import ensure_tiny_checkpoint

    root = ensure_tiny_checkpoint("moe")
    folder = tmp_path / "diffusion_models"
    folder.mkdir()
    out = {}
    for part in ("transformer", "refiner"):
        out[part] = folder / f"lingbot-tiny-moe-{part}.safetensors"
        shutil.copy(root / part / "diffusion_pytorch_model.safetensors", out[part])
    return out


def test_base_and_refiner_files_run_through_refine(tmp_path, capsys, moe_files, monkeypatch):
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    seen = {}
    real = NODE_CLASS_MAPPINGS["LingBotLoaderFiles"].execute.__func__

    def recorded(cls, *args, **kwargs):
        seen.update(kwargs)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(NODE_CLASS_MAPPINGS["LingBotLoaderFiles"], "execute", classmethod(recorded))
    code = main([NAME, "-q", "--dit", str(moe_files["transformer"]), "--refiner", str(moe_files["refiner"]),
                 "--output", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert seen["dit_path"] == str(moe_files["transformer"]) and seen["refiner_path"] == str(moe_files["refiner"])
    written = captured.out.split()
    assert len(written) == 1 and written[0].endswith(".mp4")


def test_a_refiner_file_for_a_workflow_without_refine_is_refused(tmp_path, capsys, moe_files):
    assert main(["moe-gguf", "--refiner", str(moe_files["refiner"]), "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--refiner" in err[0] and NAME in err[0], err
