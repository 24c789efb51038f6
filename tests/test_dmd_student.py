"""The official DMD student (`robbyant/lingbot-video-moe-dmd-30b-a3b`) end to end, on a tiny root laid
out like the release (model_index.json, transformer/, text_encoder/, processor/, vae/, scheduler/; no
refiner/): both Loaders open it, the student recipe runs, the base's `transformer_path` takes the
root, Denoise says when a student runs off its recipe, and its quantized copy runs too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compile_fakes import counted_eager_blocks

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
    with pytest.raises(Exception, match="to refine after it, load the base MoE root with transformer_path"):
        from lingbot_core.placement.door import require_refiner

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


def test_the_base_transformer_path_takes_the_student_root(student, caplog):
    """The base MoE root with `transformer_path` at the student root: the root's transformer/ runs (the
    other components stay the base's, which the release shares; the log says so), and the refiner stays
    available."""
    import logging

    moe = ensure_tiny_checkpoint("moe")
    with caplog.at_level(logging.INFO, logger="lingbot_core.checkpoints.inspection"):
        swapped = PipelineHandle.open(moe, device="cpu", transformer_folder=student)
    assert "is a checkpoint root: its transformer/ runs" in caplog.text and "refiner" in caplog.text
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
        return out.ui.as_dict()["text"][0] or None

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


@pytest.mark.parametrize("to", ["gguf-q8_0", "gguf-q4_0", "fp8"])
def test_the_quantized_student_root_runs_the_recipe(student, tmp_path, to):
    """`python -m lingbot_core.quantize` on the release-layout root (no refiner/ to write): the copy
    opens as a student root and runs the recipe; its GGUF DiT also runs as a single file in
    models/diffusion_models with the root's VAE and text encoder (the files-table row)."""
    from lingbot_core.quantize import main as quantize

    out = tmp_path / f"student-{to}"
    assert quantize([str(student), str(out), "--to", to, "--quiet"]) == 0
    assert not (out / "refiner").exists()
    handle = PipelineHandle.open(out, device="cpu")
    assert not handle.has_refiner and handle.variant == "moe"
    frames = run_recipe(handle)
    reference = run_recipe(PipelineHandle.open(student, device="cpu"))
    assert torch.isfinite(frames).all() and not torch.equal(frames, reference)
    assert (frames - reference).abs().mean() < 0.25 * reference.abs().mean()  # the same model, quantized
    if to.startswith("gguf"):
        dit = tmp_path / "diffusion_models" / f"lingbot-video-moe-dmd-{to[5:]}.gguf"
        dit.parent.mkdir()
        (out / "transformer" / "diffusion_pytorch_model.gguf").rename(dit)
        single, = NODE_CLASS_MAPPINGS["LingBotLoaderFiles"].execute(
            node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT, node_files.FROM_CHECKPOINT, "none", device="cpu",
            dit_path=str(dit), vae_path=str(student / "vae" / "diffusion_pytorch_model.safetensors"),
            text_encoder_path=str(student / "text_encoder" / "model.safetensors"),
            processor_path=str(student / "processor")).args
        assert torch.equal(run_recipe(single), frames)


# -- what composes with the student (each on the tiny release-layout root) ----------------------------------


def test_student_with_every_offload_mode_is_bit_identical(student):
    """Every registered offload mode (and disk streaming) gives the same frames, bit for bit."""
    from lingbot_core.placement.door import configure_offload
    from lingbot_core.placement.modes import MODE_ORDER

    handle = PipelineHandle.open(student, device="cpu")
    reference = run_recipe(handle)
    runs = [(mode, "ram") for mode in MODE_ORDER] + [("sequential", "disk"), ("group", "disk")]
    for mode, to in runs:
        options = {"use_stream": False} if mode == "group" else {}
        view = configure_offload(handle, mode, offload_to=to, **options)
        assert torch.equal(run_recipe(view), reference), (mode, to)


def test_student_with_ffn_chunk_is_the_same_math(student):
    chunked = PipelineHandle.open(student, device="cpu", ffn_chunk=256)
    whole = PipelineHandle.open(student, device="cpu", ffn_chunk=0)
    assert torch.allclose(run_recipe(chunked), run_recipe(whole), atol=1e-5)


def test_student_with_cfg_batch_is_a_no_op_at_cfg_1_and_says_so(student, caplog):
    import logging

    handle = PipelineHandle.open(student, device="cpu")
    with caplog.at_level(logging.INFO, logger="lingbot_core"):
        batched = run_recipe(handle, cfg_batch="on")
    assert torch.equal(batched, run_recipe(handle))
    assert "nothing to batch at cfg <= 1" in caplog.text
    said = notices.cfg_batch_notice("on", RECIPE["guidance_scale"])
    assert said and "does nothing at cfg 1" in said
    assert notices.cfg_batch_notice("on", 3.0) is None and notices.cfg_batch_notice("off", 1.0) is None


def test_student_with_a_lora_changes_the_run_and_comes_off(student, tmp_path):
    from lingbot_core.lora import with_lora
    from tests.test_parallel import write_moe_lora

    path = tmp_path / "moe_lora.safetensors"
    write_moe_lora(path)
    handle = PipelineHandle.open(student, device="cpu")
    plain = run_recipe(handle)
    with_it = run_recipe(with_lora(handle, str(path), 0.8))
    assert not torch.equal(with_it, plain)
    assert torch.equal(run_recipe(handle), plain)  # the plain view is untouched after the LoRA run


def test_student_with_compiled_blocks_matches_eager(student):
    """compile="blocks" runs the student's blocks compiled (dynamo with the eager backend here: the
    same graph capture without inductor's minutes) and gives the eager frames."""

    with counted_eager_blocks() as calls:
        compiled = PipelineHandle.open(student, device="cpu", compile="blocks")
        frames = run_recipe(compiled)
    depth = json.loads((student / "transformer" / "config.json").read_text())["depth"]
    assert calls[0] == RECIPE["steps"] * depth  # every block of every step ran compiled
    assert torch.allclose(frames, run_recipe(PipelineHandle.open(student, device="cpu")), atol=1e-5)


def test_student_step_cache_stays_refused_with_its_message(student):
    handle = PipelineHandle.open(student, device="cpu")
    for method in ("first_block", "magcache"):
        with pytest.raises(ValueError, match="dmd_student"):
            run_recipe(handle, step_cache=method)
    assert "transformer" not in handle.shared.loaded  # refused before the DiT loads


def test_refining_after_the_student_keeps_flow_unipc(student):
    """The base MoE root with transformer_path at the student root: the student's 8-step base pass,
    then the refiner with its own flow_unipc (the student's sampler refuses the refiner)."""
    from lingbot_core import sampling
    from lingbot_core.stages import generate

    moe = ensure_tiny_checkpoint("moe")
    handle = PipelineHandle.open(moe, device="cpu", transformer_folder=student)
    result = generate(handle, "a red boat", steps=RECIPE["steps"], guidance_scale=RECIPE["guidance_scale"],
                      shift=RECIPE["shift"], sampler=RECIPE["sampler"], seed=3, **SMALL, refine_output=True,
                      refine_options=dict(height=128, width=128, steps=2))
    assert result.refined is not None and tuple(result.refined.shape[1:3]) == (128, 128)
    assert torch.equal(result.frames, run_recipe(PipelineHandle.open(student, device="cpu")))
    with pytest.raises(ValueError, match="Refine with flow_unipc"):
        sampling.get_sampler("dmd_student").check(steps=8, shift=3.0, refine=True)


def _parallel_worker(rank: int, world: int, port: int, out: str, student: str) -> None:
    """Two gloo processes: the student recipe on a ulysses=2 view against one process, a cfg=2 view at
    cfg 1 (refused in one line), and `lingbot-run moe-dmd8 --parallel ulysses=2` as torchrun starts it."""
    import contextlib
    import io
    import os

    from lingbot_core.distributed import ParallelLayout
    from lingbot_core.distributed.launch import init_loopback_group
    from lingbot_nodes.cli import main

    torch.set_num_threads(1)
    init_loopback_group(rank, world, port)
    try:
        handle = PipelineHandle.open(student, device="cpu")
        shared = run_recipe(handle.with_parallel(ParallelLayout.create(1, 2)))
        found = {"shape": list(shared.shape)}
        if rank == 0:
            found["diff"] = float((shared - run_recipe(handle)).abs().max())
        try:
            run_recipe(handle.with_parallel(ParallelLayout.create(2, 1)))
            found["cfg2"] = None
        except ValueError as err:
            found["cfg2"] = str(err)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            found["cli"] = main(["moe-dmd8", "--parallel", "ulysses=2", "--output", str(Path(out, "cli")), "-q"])
        found["printed"] = printed.getvalue().split()
        Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_student_on_two_processes_with_ulysses_and_cfg_parallel_refused(student, tmp_path):
    import torch.multiprocessing as mp

    from lingbot_core.distributed.launch import free_loopback_port

    method = "spawn" if torch.cuda.is_initialized() else "fork"
    mp.start_processes(_parallel_worker, args=(2, free_loopback_port(), str(tmp_path), str(student)), nprocs=2,
                       join=True, start_method=method)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["diff"] <= 1e-5, ranks[0]  # ulysses=2 gives the one-process frames
    for rank, found in enumerate(ranks):
        assert found["cfg2"] and "cfg=2" in found["cfg2"] and "ulysses" in found["cfg2"], (rank, found)
        assert "\n" not in found["cfg2"]  # one line
        assert found["cli"] == 0, (rank, found)
    assert len(ranks[0]["printed"]) == 1 and ranks[0]["printed"][0].endswith(".mp4") and not ranks[1]["printed"]


# -- the README's few-step section: recipes and files row from the estimator ----------------------------------


def test_readme_student_recipes_are_what_the_estimator_gives():
    """The student's recipe table and 24 GB line are bench/recipes.py's output; each cell fits the fit
    check for its machine; the 'none is published' line is gone; SGLang's defaults are named as not
    the recipe."""
    from bench import recipes
    from lingbot_core.placement import fit
    from lingbot_core.placement.estimate import Geometry

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    page = recipes.home(recipes.STUDENT_START).read_text()  # docs/few-step.md
    assert recipes.readme_block(page, recipes.STUDENT_START, recipes.STUDENT_END) == recipes.student_table()
    assert "none is published** so far" not in page + readme and notices.STUDENT_RELEASE in readme
    from bench.memory_table import REPOS

    assert REPOS[STUDENT_VARIANT] == notices.STUDENT_RELEASE  # the README's download command is checked against it
    assert "cfg 6, 16 fps, 480x480, 81 frames) are not the upstream recipe" in page
    for vram_gb in recipes.VRAM_GB:
        cell = recipes.student_recipe(vram_gb, 64)
        fmt = cell.weights.split(" (")[0]
        w, h, frames = map(int, cell.at.split("x"))
        verdict = fit.check(recipes.student_sizes(fmt), Geometry(h, w, frames, cfg=False, vae_tiling=True,
                                                                  ffn_chunk=recipes.run_chunk()),
                            cell.mode, cell.offload_to, vram_free=int((vram_gb - recipes.DESKTOP_GIB) * fit.GiB),
                            host_free=int((64 - recipes.SYSTEM_GIB) * fit.GiB))
        assert verdict.ok, (vram_gb, verdict.line())
    assert recipes.student_recipe(24, 64).at == "832x480x121"  # the recipe's own size fits a 24 GB card


def test_readme_files_row_for_the_student_is_the_24gb_recipe():
    from bench import files_table, recipes

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (row,) = [line for line in readme.splitlines() if line.startswith(f"| {files_table.STUDENT_GPU} |")]
    cell = recipes.student_recipe(int(files_table.STUDENT_GPU.split()[0]), files_table.STUDENT_RAM_GB)
    fmt = cell.weights.split(" (")[0].replace("GGUF ", "")
    assert row.rstrip(" |").endswith(recipes.need_cell(cell.peak_gib, cell.chunk)) and f"`{cell.mode}`" in row, row
    assert fmt in row
    assert "832x480x121" in row and "`dmd_student` 8 steps, cfg 1, shift 3" in row


def test_the_quantize_time_bench_runs_and_extrapolates(tmp_path):
    from bench import quantize_time

    result = quantize_time.main(["--rows", "64", "--width", "64", "--targets", "gguf-q8_0", "--threads", "1",
                                 "--json", str(tmp_path / "q.json")])
    (row,) = result["rows"]
    assert result["extrapolated"] and row["dit_values"] > 30e9 and row["dit_minutes_extrapolated"] > 0
    assert json.loads((tmp_path / "q.json").read_text())["rows"][0]["target"] == "gguf-q8_0"


# -- K-quants: the quantizer writes the K types the pack decodes ----------------------------------------------


def test_k_quant_blocks_decode_alike_in_the_reference_and_the_pack():
    """Every K type's bytes decode to the same values in the `gguf` package's reference decoder and in
    the pack's torch decoder; the error falls as the bits rise (Q4_K below Q4_0's); zeros stay zeros."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from lingbot_core.weights import gguf_codec, kquants

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 512)) * 0.05).astype(np.float32)
    x[1] = 0.0
    x[2, :300] = np.abs(x[2, :300])  # a one-signed stretch (asymmetric blocks with min 0)
    errors = {}
    for name in kquants.K_TYPES:
        qtype = GGMLQuantizationType[name]
        packed = kquants.encode(x, name)
        assert packed.shape == (6, 2 * gguf_codec.block_bytes(qtype)), name
        reference = quants.dequantize(packed, qtype).reshape(x.shape)
        ours = gguf_codec.dequantize(torch.from_numpy(packed), qtype, x.shape).float().numpy()
        assert np.allclose(reference, ours, atol=1e-7), name
        assert not reference[1].any(), name
        errors[name] = float(np.abs(reference - x).mean() / np.abs(x).mean())
    q4_0 = quants.dequantize(quants.quantize(x, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
    assert [errors[n] for n in kquants.K_TYPES] == sorted(errors.values(), reverse=True), errors
    assert errors["Q4_K"] < float(np.abs(q4_0.reshape(x.shape) - x).mean() / np.abs(x).mean()) and errors["Q6_K"] < 0.03
    with pytest.raises(ValueError, match="multiple of 256"):
        kquants.encode(x[:, :100], "Q4_K")


def test_the_quantizer_writes_k_quants_and_q8_0_where_a_row_is_too_short(tmp_path):
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader
    from safetensors.torch import save_file

    from lingbot_core.quantize import write_gguf
    from lingbot_core.weights.sources import SafetensorsSource

    g = torch.Generator().manual_seed(1)
    tensors = {"blocks.0.attn.to_q.weight": torch.randn(4, 512, generator=g) * 0.05,
               "blocks.0.attn.to_k.weight": torch.randn(4, 64, generator=g) * 0.05}
    save_file(tensors, str(tmp_path / "in.safetensors"))
    source = SafetensorsSource([tmp_path / "in.safetensors"])
    write_gguf(source, tmp_path / "out.gguf", "Q4_K")
    source.close()
    from gguf import quants

    stored = {t.name: t for t in GGUFReader(tmp_path / "out.gguf").tensors}
    assert stored["blocks.0.attn.to_q.weight"].tensor_type == GGMLQuantizationType.Q4_K
    assert stored["blocks.0.attn.to_k.weight"].tensor_type == GGMLQuantizationType.Q8_0  # 64 is not 256-wide
    for name, t in stored.items():
        back = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tensors[name].shape)
        assert np.abs(back - tensors[name].numpy()).mean() < 0.1 * tensors[name].abs().mean().item(), name


@pytest.mark.parametrize("to", ["gguf-q6_k", "gguf-q4_k", "gguf-q2_k"])
def test_the_k_quant_student_root_runs_the_recipe(student, tmp_path, to):
    """The tiny root's rows are narrower than 256, so its K-quant copy holds Q8_0 blocks: the path runs
    end to end (the K blocks themselves are checked above on 512-wide rows)."""
    from lingbot_core.quantize import main as quantize

    out = tmp_path / "student-k"
    assert quantize([str(student), str(out), "--to", to, "--quiet"]) == 0
    frames = run_recipe(PipelineHandle.open(out, device="cpu"))
    assert torch.isfinite(frames).all() and frames.shape[0] == SMALL["num_frames"]
