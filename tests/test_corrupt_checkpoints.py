"""Corrupt and hostile checkpoints are refused when they open, with a message naming the file.

Issue 12 item 8 (and the remote-code part of item 3): malformed safetensors headers, bad
model_index entries, config values of the wrong type or range, shapes that do not match the config
(every component, the refiner included), a zero in latents_std, NaN weights, ``auto_map``.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lingbot_core.checkpoints.inspection import inspect_checkpoint
from lingbot_core.checkpoints.loading import load_component, load_refiner
from lingbot_core.errors import CheckpointError


@pytest.fixture
def dense(fixtures_root, tmp_path) -> Path:
    dst = tmp_path / "dense"
    shutil.copytree(fixtures_root / "models" / "tiny-dense", dst)
    return dst


@pytest.fixture
def moe(fixtures_root, tmp_path) -> Path:
    dst = tmp_path / "moe"
    shutil.copytree(fixtures_root / "models" / "tiny-moe", dst)
    return dst


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _write_header(path: Path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


@pytest.mark.parametrize("header,data", [
    ([1, 2, 3], b""),
    ({"w": "x"}, b""),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": "0-8"}}, b"\0" * 8),
    ({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
    ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
    ({"__metadata__": 5}, b""),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
])
def test_malformed_safetensors_headers_are_refused(dense, header, data):
    _write_header(dense / WEIGHTS, header, data)
    with pytest.raises(CheckpointError, match="diffusion_pytorch_model.safetensors"):
        inspect_checkpoint(dense)


def test_header_that_is_not_json_or_not_utf8(dense):
    path = dense / WEIGHTS
    path.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match="UTF-8"):
        inspect_checkpoint(dense)
    path.write_bytes(struct.pack("<Q", 6000) + b"[" * 3000 + b"]" * 3000)
    with pytest.raises(CheckpointError, match="nest"):
        inspect_checkpoint(dense)


@pytest.mark.parametrize("entry", [[[], []], ["diffusers"], [1, 2], None, "x", {"a": 1}])
def test_bad_model_index_entries(dense, entry):
    _edit(dense / "model_index.json", lambda d: d.__setitem__("vae", entry))
    with pytest.raises(CheckpointError, match="model_index.json"):
        inspect_checkpoint(dense)


@pytest.mark.parametrize("key,value", [
    ("num_experts", [1]), ("num_experts", -1), ("num_experts", "4"), ("hidden_size", 0),
    ("hidden_size", 33), ("depth", 1.5), ("patch_size", [1, 2]), ("axes_dims", [2, 2, 2]),
    ("norm_eps", float("nan")), ("qkv_bias", "no"), ("num_attention_heads", True),
    ("in_channels", 10 ** 40),
])
def test_bad_transformer_config_values(dense, key, value):
    _edit(dense / "transformer/config.json", lambda d: d.__setitem__(key, value))
    with pytest.raises(CheckpointError, match="transformer"):
        inspect_checkpoint(dense)


@pytest.mark.parametrize("key,value", [("num_experts_per_tok", 9), ("score_func", "relu"), ("n_group", 3),
                                       ("routed_scaling_factor", 0), ("topk_group", 5)])
def test_bad_moe_config_values_in_the_refiner(moe, key, value):
    _edit(moe / "refiner/config.json", lambda d: d.__setitem__(key, value))
    with pytest.raises(CheckpointError, match="refiner"):
        inspect_checkpoint(moe)


@pytest.mark.parametrize("change", [
    lambda d: d["latents_std"].__setitem__(3, 0),
    lambda d: d["latents_std"].__setitem__(3, -1.0),
    lambda d: d.__setitem__("latents_std", d["latents_std"][:5]),
    lambda d: d["latents_mean"].__setitem__(0, None),
    lambda d: d.__setitem__("z_dim", 8),
])
def test_bad_vae_config_values(dense, change):
    _edit(dense / "vae/config.json", change)
    with pytest.raises(CheckpointError, match="vae|VAE"):
        inspect_checkpoint(dense)


def test_text_encoder_width_must_match_the_transformer(dense):
    _edit(dense / "transformer/config.json", lambda d: d.__setitem__("text_dim", 48))
    with pytest.raises(CheckpointError, match="text_dim|text encoder"):
        inspect_checkpoint(dense)


def test_huge_integer_in_a_config_is_a_checkpoint_error(dense):
    path = dense / "scheduler/scheduler_config.json"
    path.write_text(path.read_text().replace('"num_train_timesteps": 1000', '"num_train_timesteps": ' + "9" * 5000))
    with pytest.raises(CheckpointError, match="scheduler_config.json"):
        inspect_checkpoint(dense)


def _reshape_one(path: Path, pick=lambda k: True) -> str:
    tensors = load_file(path)
    key = next(k for k in sorted(tensors) if tensors[k].ndim >= 1 and tensors[k].shape[0] > 1 and pick(k))
    tensors[key] = tensors[key][:-1].clone()
    save_file(tensors, path)
    return key


@pytest.mark.parametrize("component,weights", [
    ("transformer", "transformer/diffusion_pytorch_model.safetensors"),
    ("vae", "vae/diffusion_pytorch_model.safetensors"),
    ("text_encoder", "text_encoder/model.safetensors"),
])
def test_shape_mismatch_of_any_component_is_refused_at_open(dense, component, weights):
    _reshape_one(dense / weights)
    with pytest.raises(CheckpointError, match=f"{component}.*wrong shape"):
        inspect_checkpoint(dense)


def test_a_bad_refiner_is_refused_when_the_checkpoint_opens(moe):
    _reshape_one(moe / "refiner/diffusion_pytorch_model.safetensors", lambda k: "experts" in k or "ffn" in k)
    with pytest.raises(CheckpointError, match="refiner.*wrong shape"):
        inspect_checkpoint(moe)  # not only when the refiner loads, after base sampling


def test_missing_refiner_tensor_is_refused_at_open(moe):
    path = moe / "refiner/diffusion_pytorch_model.safetensors"
    tensors = load_file(path)
    tensors.pop(sorted(tensors)[-1])
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match="refiner.*missing"):
        inspect_checkpoint(moe)


@pytest.mark.parametrize("component,weights,value", [
    ("transformer", "transformer/diffusion_pytorch_model.safetensors", float("nan")),
    ("vae", "vae/diffusion_pytorch_model.safetensors", float("inf")),
    ("text_encoder", "text_encoder/model.safetensors", float("nan")),
])
def test_non_finite_weights_are_refused_at_load(dense, component, weights, value):
    path = dense / weights
    tensors = load_file(path)
    key = next(k for k in sorted(tensors) if tensors[k].is_floating_point() and tensors[k].numel() > 1)
    tensors[key].view(-1)[1] = value
    save_file(tensors, path)
    info = inspect_checkpoint(dense)  # headers are fine
    with pytest.raises(CheckpointError, match=f"{component}.*NaN/inf"):
        load_component(info.folder, component)


def test_non_finite_refiner_weights_are_refused(moe):
    path = moe / "refiner/diffusion_pytorch_model.safetensors"
    tensors = load_file(path)
    key = sorted(tensors)[0]
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match="refiner.*NaN/inf"):
        load_refiner(moe)


def test_pickled_weights_are_never_unpickled(dense, monkeypatch):
    import pickle

    (dense / WEIGHTS).unlink()
    torch.save({"w": torch.zeros(1)}, dense / "transformer/diffusion_pytorch_model.bin")
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    with pytest.raises(CheckpointError, match="pickled weights are never loaded"):
        inspect_checkpoint(dense)


@pytest.mark.parametrize("config", ["processor/tokenizer_config.json", "processor/preprocessor_config.json",
                                    "text_encoder/generation_config.json"])
def test_any_unparsable_json_in_the_checkpoint_is_refused_at_open(dense, config):
    (dense / config).write_text('{"oops": ')
    with pytest.raises(CheckpointError, match=config.split("/")[-1]):
        inspect_checkpoint(dense)


def test_a_text_encoder_config_transformers_cannot_build_is_ours_to_report(dense):
    _edit(dense / "text_encoder/config.json", lambda d: d["text_config"].__setitem__("num_attention_heads", 0))
    with pytest.raises(CheckpointError, match="text_encoder"):
        inspect_checkpoint(dense)


def test_a_processor_transformers_cannot_load_is_a_checkpoint_error(dense):
    (dense / "processor/tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    info = inspect_checkpoint(dense)
    with pytest.raises(CheckpointError, match="processor"):
        load_component(info.folder, "processor")
