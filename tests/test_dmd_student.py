"""The official DMD student (`robbyant/lingbot-video-moe-dmd-30b-a3b`) end to end, on a tiny root laid
out like the release (model_index.json, transformer/, text_encoder/, processor/, vae/, scheduler/; no
refiner/): both Loaders open it, the student recipe runs, the base's `transformer_path` takes the
root, Denoise says when a student runs off its recipe, and its quantized copy runs too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lingbot_core import notices
from lingbot_core.handle import PipelineHandle
from lingbot_core.tiny import STUDENT_VARIANT, ensure_tiny_checkpoint
from lingbot_nodes import NODE_CLASS_MAPPINGS
from lingbot_nodes import files as node_files
from lingbot_nodes.loader import TINY

RECIPE = notices.student_recipe()  # dmd_student, 8 steps, cfg 1, shift 3 (the sampler's own registry)
SMALL = dict(height=64, width=64, num_frames=5)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(notices, "_said", set())
    monkeypatch.setenv("LINGBOT_OUTPUT_DIR", str(tmp_path / "out"))


@pytest.fixture(scope="module")
def student() -> Path:
    return ensure_tiny_checkpoint(STUDENT_VARIANT)


def run_recipe(handle, *, steps: int | None = None, **options):
    """The student recipe at a tiny size, T2V, as frames (the text encoder skips the negative at cfg 1)."""
    from lingbot_core.stages import generate

    return generate(handle, "a red boat", steps=steps or RECIPE["steps"], guidance_scale=RECIPE["guidance_scale"],
                    shift=RECIPE["shift"], sampler=RECIPE["sampler"], seed=3, **SMALL, **options).frames


def test_the_tiny_student_root_is_laid_out_like_the_release(student):
    index = json.loads((student / "model_index.json").read_text())
    assert {"transformer", "text_encoder", "processor", "vae", "scheduler"} <= set(index)
    assert {p.name for p in student.iterdir() if p.is_dir()} == {"transformer", "text_encoder", "processor", "vae",
                                                                "scheduler"}
    assert TINY["tiny (built-in moe dmd student)"] == STUDENT_VARIANT
    moe = ensure_tiny_checkpoint("moe")
    # the same architecture as the base MoE, its own DiT weights, the base's text encoder and VAE
    assert json.loads((student / "transformer" / "config.json").read_text()) == \
        json.loads((moe / "transformer" / "config.json").read_text())
    for sub, name in (("transformer", "diffusion_pytorch_model.safetensors"),
                      ("vae", "diffusion_pytorch_model.safetensors"), ("text_encoder", "model.safetensors")):
        same = (student / sub / name).read_bytes() == (moe / sub / name).read_bytes()
        assert same is (sub != "transformer"), sub


def test_the_folder_loader_opens_the_root_and_runs_the_recipe(student):
    handle, = NODE_CLASS_MAPPINGS["LingBotLoader"].execute("tiny (built-in moe dmd student)", "moe", "auto",
                                                          "default", device="cpu").args
    assert handle.variant == "moe" and not handle.has_refiner
    frames = run_recipe(handle)
    assert frames.shape[0] == SMALL["num_frames"] and torch.isfinite(frames).all()
    with pytest.raises(Exception, match="refiner"):  # no refiner/ in the release: Refine is refused at once
        from lingbot_core.offload import require_refiner

        require_refiner(handle, (128, 128))


def test_the_files_loader_opens_the_student_dit_file_with_shared_vae_and_text_encoder(student, tmp_path):
    """The student DiT as one file (models/diffusion_models) plus the VAE, text encoder and processor
    as single files: the frames equal the root's."""
    import shutil

    dit = tmp_path / "diffusion_models" / "lingbot-video-moe-dmd.safetensors"
    dit.parent.mkdir()
    shutil.copy(student / "transformer" / "diffusion_pytorch_model.safetensors", dit)
    loader = NODE_CLASS_MAPPINGS["LingBotLoaderFiles"]
    handle, = loader.execute(node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT,
                             "none", device="cpu", dit_path=str(dit),
                             vae_path=str(student / "vae" / "diffusion_pytorch_model.safetensors"),
                             text_encoder_path=str(student / "text_encoder" / "model.safetensors"),
                             processor_path=str(student / "processor")).args
    assert handle.folder is None and handle.variant == "moe"
    assert torch.equal(run_recipe(handle), run_recipe(PipelineHandle.open(student, device="cpu")))
    # the student file over the base MoE folder's VAE and text encoder (the same files as the release's)
    over_base, = loader.execute(node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT,
                                "tiny (built-in moe)", device="cpu", dit_path=str(dit)).args
    assert torch.equal(run_recipe(over_base), run_recipe(PipelineHandle.open(student, device="cpu")))


def test_the_base_transformer_path_takes_the_student_root(student):
    """The base MoE root with `transformer_path` at the student root: the root's transformer/ runs (the
    other components stay the base's, which the release shares), and the refiner stays available."""
    moe = ensure_tiny_checkpoint("moe")
    swapped = PipelineHandle.open(moe, device="cpu", transformer_folder=student)
    assert swapped.shared.transformer_source == (student, "transformer") and swapped.has_refiner
    assert torch.equal(run_recipe(swapped), run_recipe(PipelineHandle.open(student, device="cpu")))
    assert not torch.equal(run_recipe(swapped), run_recipe(PipelineHandle.open(moe, device="cpu")))
    dense = ensure_tiny_checkpoint("dense")
    with pytest.raises(Exception, match="not the base checkpoint's architecture"):
        PipelineHandle.open(dense, device="cpu", transformer_folder=student)


def _real_size(monkeypatch):
    monkeypatch.setattr(notices, "is_real_size", lambda info: True)


def test_denoise_on_the_student_root_says_the_recipe_on_the_node(student, monkeypatch):
    """At real size (faked here: the tiny workflows must run as shipped without notices), Denoise on the
    release-layout root run with the base recipe shows the student recipe on the node, and says why it
    thinks so; on the recipe it says nothing."""
    _real_size(monkeypatch)
    handle = PipelineHandle.open(student, device="cpu")
    cond = NODE_CLASS_MAPPINGS["LingBotTextEncode"].execute(handle, "a red boat").args[0]
    denoise = NODE_CLASS_MAPPINGS["LingBotDenoise"]

    def said(**widgets):
        args = dict(width=64, height=64, frames=5, steps=2, cfg=1.0, shift=3.0, seed=1)
        args.update(widgets)
        out = denoise.execute(handle, cond, **args)
        return out.ui.as_dict()["text"][0] if out.ui is not None else None

    base = said(sampler="flow_unipc", steps=9, cfg=3.0)  # the base recipe, shortened (> 8 steps, cfg 3)
    assert base and "without refiner/" in base and "sampler dmd_student, 8 steps, cfg 1, shift 3" in base
    assert said(sampler="dmd_student", steps=8) is None
    assert "twice" in said(sampler="dmd_student", steps=8, cfg=2.0)


def test_the_core_cli_defaults_to_the_student_recipe(student, tmp_path, monkeypatch):
    """`python -m lingbot_core --sampler dmd_student` without --steps/--cfg runs the recipe's 8 steps at
    cfg 1 (one DiT call per step, no negative pass)."""
    from lingbot_core.__main__ import main
    from lingbot_core.models.transformer import LingBotVideoTransformer3DModel

    calls = []
    real = LingBotVideoTransformer3DModel.forward
    monkeypatch.setattr(LingBotVideoTransformer3DModel, "forward",
                        lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])
    code = main(["--model", str(student), "--sampler", "dmd_student", "--height", "64", "--width", "64",
                 "--frames", "5", "--output", str(tmp_path / "out"), "-q"])
    assert code == 0 and len(calls) == RECIPE["steps"]


@pytest.mark.parametrize("name, short", [("lingbot_t2v_moe_dmd8", "moe-dmd8"), ("lingbot_ti2v_moe_dmd8", "ti2v-moe-dmd8")])
def test_the_shipped_student_workflows_run_the_recipe_on_the_tiny_root(name, short):
    """As shipped: the tiny release-layout root, the recipe (one DiT call per step, no negative), a
    `lingbot-run` name each; the Notes name the release and the flow_unipc refiner after it."""
    import sys

    from lingbot_core.workflow import Engine, load_workflow
    from lingbot_nodes import NODE_DISPLAY_NAME_MAPPINGS
    from lingbot_nodes.cli import SHORT_NAMES, build_parser

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from workflows import build

    assert SHORT_NAMES[short] == name and short in build_parser().format_help()
    assert build.STUDENT_RELEASE == notices.STUDENT_RELEASE and build.STUDENT_TINY in TINY
    note = build.WORKFLOWS[name]["note"]
    assert notices.STUDENT_RELEASE in note and "flow_unipc" in note and "transformer_path" in note
    assert "No dense DMD student is published" in build.WORKFLOWS["lingbot_t2v_dense_dmd8"]["note"]
    prompt = load_workflow(root / "workflows" / "api" / f"{name}.json", NODE_CLASS_MAPPINGS,
                           display_names=NODE_DISPLAY_NAME_MAPPINGS)
    denoise = next(n for n in prompt.nodes.values() if n["class_type"] == "LingBotDenoise")["inputs"]
    assert (denoise["sampler"], denoise["steps"], denoise["cfg"], denoise["shift"]) == \
        (RECIPE["sampler"], RECIPE["steps"], RECIPE["guidance_scale"], RECIPE["shift"])
    engine = Engine(NODE_CLASS_MAPPINGS)
    handle = engine.run(prompt, outputs=["1"]).output("1")
    assert not handle.has_refiner and handle.folder.name == "tiny-moe-dmd"
    calls = []
    hook = handle.component("transformer").register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        engine.run(prompt)
    finally:
        hook.remove()
    assert len(calls) == RECIPE["steps"]
