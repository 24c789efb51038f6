"""LingBot Loader (files) and `lingbot-run --dit/--vae/--text-encoder/--processor`: the tiny checkpoint
rewritten as the single files users keep (ComfyUI folders, community namings) gives the same frames
as the folder; the dropdowns keep to ComfyUI's folders."""

from __future__ import annotations

import os
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lingbot_nodes import NODE_CLASS_MAPPINGS
from lingbot_nodes import files as node_files
from lingbot_nodes.cli import main
from tests.test_vae_file import write_original

TINY = Path(__file__).resolve().parent / "fixtures" / "lingbot" / "models" / "tiny-dense"
LOADER = NODE_CLASS_MAPPINGS["LingBotLoaderFiles"]


def single_files(models: Path) -> dict[str, Path]:
    """The tiny dense checkpoint as ComfyUI users keep it: DiT in diffusion_models, the VAE with original
    Wan names in vae, the text encoder with ComfyUI names in text_encoders, the processor folder."""
    out = {"dit": models / "diffusion_models" / "lingbot-tiny.safetensors",
           "vae": models / "vae" / "wan_2.1_vae.safetensors",
           "text_encoder": models / "text_encoders" / "qwen3vl_tiny.safetensors",
           "processor": models / "text_encoders" / "lingbot-processor"}
    for path in out.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(TINY / "transformer" / "diffusion_pytorch_model.safetensors", out["dit"])
    write_original(load_file(str(TINY / "vae" / "diffusion_pytorch_model.safetensors")), out["vae"], 1)
    te = load_file(str(TINY / "text_encoder" / "model.safetensors"))
    save_file({k.replace("model.language_model.", "model.", 1): v for k, v in te.items()}, str(out["text_encoder"]))
    shutil.copytree(TINY / "processor", out["processor"])
    return out


@pytest.fixture
def comfy_folders(tmp_path, monkeypatch):
    """A stand-in folder_paths with ComfyUI's model folder names, and `comfy` imported."""
    models = tmp_path / "models"
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.models_dir = str(models)
    folder_paths.folder_names_and_paths = {
        name: ([str(models / name)], set()) for name in ("diffusion_models", "vae", "text_encoders", "clip", "loras")}
    folder_paths.folder_names_and_paths["diffusion_models"][0].append(str(models / "unet"))
    folder_paths.get_folder_paths = lambda name: folder_paths.folder_names_and_paths[name][0]
    folder_paths.add_model_folder_path = lambda name, path: folder_paths.folder_names_and_paths.setdefault(
        name, ([], set()))[0].append(path)
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)
    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    return models


def test_dropdowns_list_files_inside_comfy_folders_only(comfy_folders, tmp_path):
    files = single_files(comfy_folders)
    (comfy_folders / "unet").mkdir()
    shutil.copy(files["dit"], comfy_folders / "unet" / "other.gguf")
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"x")
    os.symlink(outside, comfy_folders / "vae" / "escape.safetensors")
    (comfy_folders / "vae" / "notes.txt").write_text("x")
    assert node_files.file_choices("dit") == ["lingbot-tiny.safetensors", "other.gguf"]
    assert node_files.file_choices("vae") == ["wan_2.1_vae.safetensors"]
    assert node_files.file_choices("text_encoder") == ["qwen3vl_tiny.safetensors"]
    assert node_files.resolve_file("vae", "wan_2.1_vae.safetensors") == files["vae"]
    for bad in ("escape.safetensors", "../elsewhere.safetensors", str(outside)):
        with pytest.raises(ValueError):
            node_files.resolve_file("vae", bad)
    with pytest.raises(ValueError, match="under ComfyUI's model folders"):
        node_files.resolve_file("vae", node_files.FROM_CHECKPOINT, str(outside))
    inputs = LOADER.INPUT_TYPES()
    assert "wan_2.1_vae.safetensors" in inputs["required"]["vae"][1]["options"]


def test_file_flags_need_a_files_loader(tmp_path, capsys):
    assert main(["t2v", "--vae", str(tmp_path / "v.safetensors"), "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--vae given, but" in err and "has no LingBot Loader (files) node" in err


def test_every_component_must_come_from_somewhere(tmp_path):
    files = single_files(tmp_path / "models")
    with pytest.raises(ValueError, match="every component must be a file: choose text_encoder"):
        LOADER.execute(node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT, "none",
                       dit_path=str(files["dit"]), vae_path=str(files["vae"]), processor_path=str(files["processor"]))
def _frames(handle) -> torch.Tensor:
    from lingbot_core import stages

    return stages.generate(handle, "a red boat", mode="t2v", height=32, width=32, num_frames=5, steps=2,
                           seed=7).frames


def test_single_files_give_the_folders_frames(tmp_path):
    from lingbot_core.handle import PipelineHandle

    files = single_files(tmp_path / "models")
    handle, = LOADER.execute(node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT,
                             "none", device="cpu", dit_path=str(files["dit"]), vae_path=str(files["vae"]),
                             text_encoder_path=str(files["text_encoder"]),
                             processor_path=str(files["processor"])).args
    assert handle.folder is None
    assert torch.equal(_frames(handle), _frames(PipelineHandle.open(TINY, device="cpu")))


def test_files_override_the_checkpoint_components(tmp_path):
    from lingbot_core.handle import PipelineHandle

    files = single_files(tmp_path / "models")
    handle, = LOADER.execute(node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT,
                             "none", device="cpu", checkpoint_path=str(TINY), vae_path=str(files["vae"]),
                             text_encoder_path=str(files["text_encoder"])).args
    assert torch.equal(_frames(handle), _frames(PipelineHandle.open(TINY, device="cpu")))


def test_cli_runs_the_files_workflow_from_files(tmp_path, capsys):
    files = single_files(tmp_path / "models")
    code = main(["t2v-files", "--dit", str(files["dit"]), "--vae", str(files["vae"]), "--text-encoder",
                 str(files["text_encoder"]), "--processor", str(files["processor"]), "--output", str(tmp_path / "out"),
                 "--set", "Denoise.steps=2"])
    assert code == 0, capsys.readouterr().err
    written = capsys.readouterr().out.split()
    assert len(written) == 1 and written[0].endswith(".mp4")
