"""The Qwen3-VL text encoder from one file: transformers and ComfyUI names, scaled fp8 and comfy_quant
storage, text-only files, wrong files refused. Every route encodes bit-identically to the folder's
encoder holding the same values."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from lingbot_core.checkpoints import text_encoder_file as tef
from lingbot_core.checkpoints.loading import load_component
from lingbot_core.errors import CheckpointError
from lingbot_core.prompt import encode_text
from lingbot_core.weights.state import ModelState

TINY = Path(__file__).resolve().parent / "fixtures" / "lingbot" / "models" / "tiny-dense"
TE_FILE = TINY / "text_encoder" / "model.safetensors"
PROMPTS = ["a red boat on a lake", '{"scene": "雨の夜の街 🌧️", "camera": {"move": "pan"}}']
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def processor():
    return load_component(TINY, "processor")


@pytest.fixture(scope="module")
def state():
    return load_file(str(TE_FILE))


@pytest.fixture(scope="module")
def folder_config():
    return json.loads((TINY / "text_encoder" / "config.json").read_text())


def _image() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))


def _encodings(model, processor, state: ModelState | None = None) -> list[torch.Tensor]:
    out = [encode_text(model, processor, p, device=CPU).embeds for p in PROMPTS]
    if state is None or not state.text_only:
        out.append(encode_text(model, processor, PROMPTS[0], image=_image(), device=CPU, state=state).embeds)
    return out


def _folder_with(values: dict[str, torch.Tensor] | None = None):
    model = load_component(TINY, "text_encoder")
    if values:
        missing, unexpected = model.load_state_dict(values, strict=False)
        assert not unexpected
    return model


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _comfy_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # ComfyUI's Qwen3-VL: the text tower directly under `model.`, the vision tower under `model.visual.`
    return {k.replace("model.language_model.", "model.", 1): v for k, v in state.items()}


@pytest.mark.parametrize("variant", ["transformers", "transformers+lm_head", "comfyui", "comfyui+prefix"])
def test_plain_namings_encode_like_the_folder(tmp_path, processor, state, folder_config, variant):
    data = dict(state)
    if variant.startswith("comfyui"):
        data = _comfy_names(data)
    if variant.endswith("+lm_head"):
        data["lm_head.weight"] = state["model.language_model.embed_tokens.weight"].clone()
    if variant.endswith("+prefix"):
        data = {f"text_encoders.qwen3vl_4b.transformer.{k}": v for k, v in data.items()}
    path = tmp_path / "te.safetensors"
    save_file(data, str(path))
    info = tef.inspect_text_encoder_file(path, config=folder_config)
    assert info.naming == ("comfyui" if variant.startswith("comfyui") else "transformers")
    assert info.quantization == "none" and not info.text_only
    _assert_same(_encodings(tef.load_text_encoder_file(info), processor), _encodings(_folder_with(), processor))


def test_config_inferred_from_the_tensors_without_a_folder(tmp_path, state, folder_config):
    """Without a folder config every size the tensors show is theirs; the rest is Qwen3-VL-4B's."""
    shipped = tef.shipped_config()
    base = {**shipped, "vision_config": {**shipped["vision_config"], "deepstack_visual_indexes": [0, 1],
                                         "num_heads": 64}}  # head width 16 like the tiny tower's 2 x 8
    info = tef.inspect_text_encoder_file(TE_FILE, config=base)
    for part in ("text_config", "vision_config"):
        for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "depth", "out_hidden_size"):
            if key in folder_config[part]:
                assert info.config[part][key] == folder_config[part][key], (part, key)
    with pytest.raises(CheckpointError, match="a vision tower 16 wide is not one whose head count is known"):
        tef.inspect_text_encoder_file(TE_FILE, config=shipped)  # the 4B config's 64-wide heads do not divide it
    alone = tef.inspect_text_encoder_file(TE_FILE)  # no folder: the known shape that fits (the tiny one)
    assert alone.config["vision_config"]["num_heads"] == folder_config["vision_config"]["num_heads"]
    assert alone.config["image_token_id"] == folder_config["image_token_id"]
    wide = {**base, "vision_config": {**base["vision_config"], "deepstack_visual_indexes": [0, 1, 2]}}
    with pytest.raises(CheckpointError, match="2 DeepStack mergers, 3 in the Qwen3-VL config"):
        tef.inspect_text_encoder_file(TE_FILE, config=wide)


def _fp8_layout(state: dict[str, torch.Tensor], layout: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(file tensors, the dequantized values a folder model should hold) for ComfyUI's fp8 layouts."""
    out, reference = {}, {}
    for name, value in state.items():
        is_linear = value.dim() == 2 and name.endswith(".weight") and ("_proj." in name or ".linear_fc" in name
                                                                        or ".qkv." in name or ".proj." in name)
        if not is_linear:
            out[name] = value
            continue
        layer = name[: -len(".weight")]
        if layout == "scaled_fp8":
            scale = value.abs().amax().float() / 448.0
            out[f"{layer}.scale_weight"] = scale.reshape(())
        else:
            scale = value.abs().amax(dim=1, keepdim=True).float() / 448.0
            out[f"{layer}.weight_scale"] = scale
            out[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()),
                                                       dtype=torch.uint8)
        stored = (value / scale).to(torch.float8_e4m3fn)
        out[name] = stored
        reference[name] = stored.float() * scale
    if layout == "scaled_fp8":
        out[tef.SCALED_FP8_MARKER] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out, reference


@pytest.mark.parametrize("layout", ["scaled_fp8", "comfy_quant"])
def test_fp8_layouts_dequantize_like_a_folder_holding_the_same_values(tmp_path, processor, state, folder_config,
                                                                      layout):
    data, reference = _fp8_layout(_comfy_names(state) if layout == "scaled_fp8" else state, layout)
    path = tmp_path / f"qwen3vl_{layout}.safetensors"
    save_file(data, str(path))
    info = tef.inspect_text_encoder_file(path, config=folder_config)
    assert info.quantization == layout and len(info.scales) == len(reference)
    if layout == "scaled_fp8":
        reference = {k.replace("model.", "model.language_model.", 1) if not k.startswith("model.visual.") else k: v
                     for k, v in reference.items()}
    _assert_same(_encodings(tef.load_text_encoder_file(info), processor),
                 _encodings(_folder_with(reference), processor))


def test_text_only_file_encodes_text_and_refuses_ti2v(tmp_path, processor, state, folder_config):
    path = tmp_path / "qwen3vl_text.safetensors"
    save_file({k: v for k, v in state.items() if not k.startswith("model.visual.")}, str(path))
    state = ModelState()
    model = tef.load_text_encoder_file(path, config=folder_config, state=state)
    assert state.text_only == path.name
    _assert_same(_encodings(model, processor, state), _encodings(_folder_with(), processor)[: len(PROMPTS)])
    with pytest.raises(CheckpointError) as err:
        encode_text(model, processor, PROMPTS[0], image=_image(), device=CPU, state=state)
    assert str(err.value) == tef.TEXT_ONLY_MESSAGE.format(name=path.name)
    assert not any(k.startswith("_lingbot") for k in vars(model))  # the note is on the state, not the model


def test_a_text_only_file_keeps_the_vision_towers_buffers(tmp_path, state, folder_config):
    """The vision tower a text-only file lacks gets zero weights, and its buffers (the rotary embedding's
    frequencies) stay as built: re-allocated empty they held whatever the memory did, at times NaN, and
    the load's NaN scan then called the file corrupt."""
    whole = tmp_path / "qwen3vl.safetensors"
    save_file(dict(state), str(whole))
    text = tmp_path / "qwen3vl_text.safetensors"
    save_file({k: v for k, v in state.items() if not k.startswith("model.visual.")}, str(text))
    reference = dict(tef.load_text_encoder_file(whole, config=folder_config).model.visual.named_buffers())
    tower = tef.load_text_encoder_file(text, config=folder_config).model.visual
    buffers = dict(tower.named_buffers())
    assert buffers and buffers.keys() == reference.keys()
    for name, value in buffers.items():
        assert torch.equal(value, reference[name]), name
    assert all(not p.is_meta and not p.any() for p in tower.parameters())  # zeros where the file has nothing


def test_a_handle_on_a_text_only_file_refuses_a_ti2v_encode(tmp_path, state):
    from lingbot_core.components import ComponentFiles
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.stages import encode_prompt

    path = tmp_path / "qwen3vl_text.safetensors"
    save_file({k: v for k, v in state.items() if not k.startswith("model.visual.")}, str(path))
    handle = PipelineHandle.open(TINY, device="cpu", files=ComponentFiles(text_encoder=path))
    encode_prompt(handle, "a cat", None)  # text alone encodes
    assert handle.shared.states["text_encoder"].text_only == path.name
    with pytest.raises(CheckpointError, match="qwen3vl_text.safetensors"):
        encode_prompt(handle, "a cat", None, mode="ti2v", image=torch.full((1, 3, 1, 64, 64), 0.5))


def test_a_text_only_file_is_refused_for_ti2v_before_it_loads(tmp_path, state):
    """The TI2V encode reads the file's header facts (resolved at open) and refuses before loading it."""
    from lingbot_core import stages
    from lingbot_core.components import ComponentFiles
    from lingbot_core.handle import PipelineHandle

    path = tmp_path / "qwen3vl_text.safetensors"
    save_file({k: v for k, v in state.items() if not k.startswith("model.visual.")}, str(path))
    handle = PipelineHandle.open(TINY, files=ComponentFiles(text_encoder=path), device="cpu")
    with pytest.raises(CheckpointError) as err:
        stages.encode_prompt(handle, "a boat", image=torch.full((1, 3, 1, 32, 32), 0.5), mode="ti2v")
    assert str(err.value) == tef.TEXT_ONLY_MESSAGE.format(name=path.name)
    assert "text_encoder" not in handle.shared.loaded


def test_unknown_comfy_quant_format_is_refused(tmp_path, state, folder_config):
    data, _ = _fp8_layout(state, "comfy_quant")
    key = next(k for k in data if k.endswith(".comfy_quant"))
    data[key] = torch.tensor(list(b'{"format": "int8_tensorwise"}'), dtype=torch.uint8)
    save_file(data, str(tmp_path / "q.safetensors"))
    with pytest.raises(CheckpointError, match="comfy_quant format 'int8_tensorwise'"):
        tef.inspect_text_encoder_file(tmp_path / "q.safetensors", config=folder_config)


@pytest.mark.parametrize(("tensors", "says"), [
    ({"decoder.middle.0.residual.0.gamma": (4, 1, 1, 1)}, "is a VAE"),
    ({"blocks.0.attn.to_q.weight": (2, 2)}, "is a diffusion model (DiT)"),
    ({"encoder.block.0.layer.0.SelfAttention.q.weight": (2, 2), "shared.weight": (4, 2)},
     "is a T5 / UMT5 text encoder (Wan's), not Qwen3-VL"),
])
def test_other_files_are_refused_by_name(tmp_path, tensors, says):
    save_file({k: torch.zeros(s) for k, s in tensors.items()}, str(tmp_path / "x.safetensors"))
    with pytest.raises(CheckpointError) as err:
        tef.inspect_text_encoder_file(tmp_path / "x.safetensors")
    assert str(err.value).startswith(f"x.safetensors {says}. Use the Qwen3-VL-4B text encoder")


def test_gguf_text_encoder_is_refused(tmp_path):
    (tmp_path / "Qwen3-VL-4B-Instruct-Q4_K_M.gguf").write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(CheckpointError, match="is a GGUF text encoder"):
        tef.inspect_text_encoder_file(tmp_path / "Qwen3-VL-4B-Instruct-Q4_K_M.gguf")
