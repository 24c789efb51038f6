"""The loader: fixture models load through it, and every broken checkpoint fails early and clearly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from lingbot_core.checkpoints import inspection
from lingbot_core.checkpoints import loading as ckpt
from lingbot_core.checkpoints.inspection import inspect_checkpoint
from lingbot_core.checkpoints.loading import load_refiner
from lingbot_core.errors import CheckpointError


def load_checkpoint(folder: Path, components: tuple[str, ...] = inspection.COMPONENTS) -> SimpleNamespace:
    """Inspect `folder`, then load each named component on the CPU in its default dtype (the product loads
    through `PipelineHandle`; this reads the loader's two steps in order): `.info`, `.components`, and
    each component as an attribute."""
    info = inspect_checkpoint(folder)
    dtypes = inspection.default_dtypes("cpu")
    loaded = {name: ckpt.load_component(info.folder, name, dtype=dtypes.get(name), source=info.sources.get(name))
              for name in components}
    return SimpleNamespace(info=info, components=loaded, **loaded)


@pytest.fixture
def dense_copy(fixtures_root, tmp_path) -> Path:
    dst = tmp_path / "dense"
    shutil.copytree(fixtures_root / "models" / "tiny-dense", dst)
    return dst


@pytest.mark.parametrize("model,variant,refiner", [("tiny-dense", "dense", False), ("tiny-moe", "moe", True)])
def test_fixture_models_load(fixtures_root, model, variant, refiner):
    loaded = load_checkpoint(fixtures_root / "models" / model)
    assert loaded.info.variant == variant and loaded.info.has_refiner is refiner
    assert type(loaded.transformer).__name__ == "LingBotVideoTransformer3DModel"
    assert type(loaded.vae).__name__ == "AutoencoderKLWan"
    assert type(loaded.text_encoder).__name__ == "Qwen3VLForConditionalGeneration"
    assert type(loaded.processor).__name__ == "Qwen3VLProcessor"
    assert type(loaded.scheduler).__name__ == "FlowUniPCScheduler"
    assert "refiner" not in loaded.components  # loaded only when asked for
    # Bit-identical to the stored weights.
    stored = load_file(fixtures_root / "models" / model / "transformer" / "diffusion_pytorch_model.safetensors")
    state = loaded.transformer.state_dict()
    assert stored.keys() == state.keys()
    assert all(torch.equal(stored[k], state[k]) for k in stored)
    assert all(p.dtype == torch.float32 for p in loaded.text_encoder.parameters())


def test_refiner_loads_lazily_from_moe(fixtures_root):
    folder = fixtures_root / "models" / "tiny-moe"
    refiner = load_refiner(folder)
    stored = load_file(folder / "refiner" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(stored[k], v) for k, v in refiner.state_dict().items())


def test_dense_checkpoint_has_no_refiner(fixtures_root):
    with pytest.raises(CheckpointError, match=r"no refiner/ folder.*MoE checkpoint"):
        load_refiner(fixtures_root / "models" / "tiny-dense")


def test_cuda_dtype_policy():
    d = inspection.default_dtypes("cuda")
    assert d["transformer"] == d["text_encoder"] == torch.bfloat16 and d["vae"] == torch.float32
    assert set(inspection.default_dtypes("cpu").values()) == {torch.float32}


def test_sharded_weights_load_like_single_file(dense_copy):
    single = dense_copy / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(single)
    keys = sorted(tensors)
    half = len(keys) // 2
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": keys[:half],
              "diffusion_pytorch_model-00002-of-00002.safetensors": keys[half:]}
    for name, part in shards.items():
        save_file({k: tensors[k] for k in part}, dense_copy / "transformer" / name)
    index = {"metadata": {}, "weight_map": {k: n for n, part in shards.items() for k in part}}
    (dense_copy / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    single.unlink()
    model = ckpt.load_transformer(dense_copy)
    assert all(torch.equal(tensors[k], v) for k, v in model.state_dict().items())
    # A missing shard is named.
    (dense_copy / "transformer" / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard .*00002-of-00002.safetensors.* is missing"):
        inspect_checkpoint(dense_copy)


def _truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: keep if keep is not None else len(data) - 100])


@pytest.mark.parametrize(
    "breakage,pattern",
    [
        (lambda d: shutil.rmtree(d), r"does not exist"),
        (lambda d: (d / "model_index.json").unlink(), r"missing file .*model_index.json"),
        (lambda d: (d / "model_index.json").write_text("{not json"), r"cannot parse .*model_index.json"),
        (lambda d: shutil.rmtree(d / "vae"), r"vae: missing folder"),
        (lambda d: (d / "vae" / "diffusion_pytorch_model.safetensors").unlink(),
         r"vae: missing weights .*diffusion_pytorch_model.safetensors"),
        (lambda d: _truncate(d / "transformer" / "diffusion_pytorch_model.safetensors"),
         r"transformer.*diffusion_pytorch_model.safetensors is truncated"),
        (lambda d: _truncate(d / "text_encoder" / "model.safetensors", 4), r"model.safetensors is truncated"),
        (lambda d: (d / "text_encoder" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad header!!!!}"),
         r"model.safetensors is not a valid safetensors file"),
        (lambda d: (d / "scheduler" / "scheduler_config.json").unlink(), r"missing file .*scheduler_config.json"),
        (lambda d: (d / "processor" / "tokenizer.json").unlink() or (d / "processor" / "tokenizer_config.json").unlink(),
         r"no tokenizer"),
    ],
    ids=["no-folder", "no-index", "bad-index", "no-vae-dir", "no-vae-weights", "truncated-dit",
         "truncated-header", "bad-header", "no-scheduler-config", "no-tokenizer"],
)
def test_broken_checkpoints_fail_before_loading(dense_copy, monkeypatch, breakage, pattern):
    breakage(dense_copy)
    # Nothing heavy may run before the error: make any weight load blow up.
    monkeypatch.setattr(ckpt, "load_component", lambda *a, **k: pytest.fail("loaded before validating"))
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(dense_copy)


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_unknown_class_in_model_index(dense_copy):
    _edit_json(dense_copy / "model_index.json", transformer=["somepkg.models", "OtherTransformer"])
    with pytest.raises(CheckpointError, match=r"'transformer' is somepkg.models.OtherTransformer.*does not know"):
        inspect_checkpoint(dense_copy)


def test_unknown_config_class(dense_copy):
    _edit_json(dense_copy / "transformer" / "config.json", _class_name="WanTransformer3DModel")
    with pytest.raises(CheckpointError, match=r"declares class 'WanTransformer3DModel'.*only knows"):
        inspect_checkpoint(dense_copy)


def test_wrong_text_encoder_type(dense_copy):
    _edit_json(dense_copy / "text_encoder" / "config.json", model_type="qwen2_vl")
    with pytest.raises(CheckpointError, match=r"needs a Qwen3-VL text encoder"):
        inspect_checkpoint(dense_copy)


def test_pickled_weights_are_refused(dense_copy):
    weights = dense_copy / "vae" / "diffusion_pytorch_model.safetensors"
    weights.rename(dense_copy / "vae" / "diffusion_pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pickled weights are never loaded"):
        inspect_checkpoint(dense_copy)


def test_weights_that_do_not_match_the_config(dense_copy):
    path = dense_copy / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(path)
    tensors.pop("blocks.1.norm2.weight")
    tensors["proj_out.bias"] = torch.zeros(3)
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"1 missing tensors \(e.g. blocks.1.norm2.weight\).*wrong shape"):
        load_checkpoint(dense_copy, components=("transformer",))


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_freshly_built_tiny_checkpoint_loads_through_the_loader(tmp_path, variant):
    from lingbot_core.tiny import build_tiny_checkpoint

    folder = build_tiny_checkpoint(tmp_path / variant, variant)
    loaded = load_checkpoint(folder)
    assert loaded.info.variant == variant and loaded.info.has_refiner is (variant == "moe")
    assert loaded.transformer.config.text_dim == loaded.text_encoder.config.get_text_config().hidden_size
    if variant == "moe":
        assert load_refiner(folder).config.num_experts > 0
