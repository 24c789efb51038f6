"""The "wrong file" table (docs/single-files.md) says what the code says: each message is produced here from a file
of that kind and must match the README's text (X = the file's name, N/M = numbers, ... = a path)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lingbot_core.checkpoints import text_encoder_file as tef
from lingbot_core.checkpoints import vae_file
from lingbot_core.checkpoints.dit_file import dit_file_source
from lingbot_core.checkpoints.loading import load_component
from lingbot_core.checkpoints.processor_files import check_folder, check_token_ids
from lingbot_core.errors import CheckpointError
from tests.gguf_fakes import T, write_gguf

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "lingbot" / "models" / "tiny-dense"


def readme_messages() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "single-files.md").read_text()
    start = text.index("What you see when a file is the wrong one")
    rows: dict[str, list[str]] = {}
    lines = text[start:].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    for line in lines[first + 2:]:  # past the header and its rule
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows[cells[0]] = [m.replace("\\|", "|") for m in re.findall(r"`((?:[^`])+)`", cells[1])]
    return rows


def pattern(message: str, name: str) -> str:
    out = re.sub(r"(?<![A-Za-z])X(?![A-Za-z])", lambda _m: re.escape(name), re.escape(message))
    return out.replace(r"\.\.\.", ".+?").replace(" N,", r" \d+,").replace(" M;", r" \d+;")


def _fake(path: Path, tensors: dict[str, tuple[int, ...]]) -> Path:
    save_file({k: torch.zeros(s) for k, s in tensors.items()}, str(path))
    return path


def _error(fn, *args) -> str:
    with pytest.raises(CheckpointError) as err:
        fn(*args)
    return str(err.value)


def produced(row: str, tmp: Path) -> tuple[list[str], str]:
    """(the code's messages for this row, the file name in them)"""
    name = "x.safetensors"
    if row == "the Wan 2.2 VAE":
        path = _fake(tmp / name, {"decoder.upsamples.0.upsamples.0.residual.2.weight": (2, 2, 1, 1, 1)})
        return [_error(vae_file.inspect_vae_file, path)], name
    if row == "an SD / SDXL / Flux VAE":
        out = []
        for z in (4, 16):
            path = _fake(tmp / name, {"encoder.down.0.block.0.conv1.weight": (2, 2, 3, 3),
                                      "decoder.conv_in.weight": (8, z, 3, 3)})
            out.append(_error(vae_file.inspect_vae_file, path))
        return out, name
    if row == "a text encoder or DiT as the VAE":
        path = _fake(tmp / name, {"model.language_model.embed_tokens.weight": (4, 2)})
        return [_error(vae_file.inspect_vae_file, path)], name
    if row == "a llama.cpp GGUF text encoder":
        name = "qwen3-vl-4b-q4_k_m.gguf"
        (tmp / name).write_bytes(b"GGUF" + b"\0" * 20)
        return [_error(tef.inspect_text_encoder_file, tmp / name)], name
    if row == "Wan's UMT5 text encoder":
        path = _fake(tmp / name, {"encoder.block.0.layer.0.SelfAttention.q.weight": (2, 2), "shared.weight": (4, 2)})
        return [_error(tef.inspect_text_encoder_file, path)], name
    if row == "a VAE as the text encoder":
        path = _fake(tmp / name, {"decoder.middle.0.residual.0.gamma": (4, 1, 1, 1)})
        return [_error(tef.inspect_text_encoder_file, path)], name
    if row == "a text-only Qwen3-VL file, with TI2V":
        from lingbot_core.weights.state import ModelState

        state = ModelState()
        state.text_only = name  # what loading a text-only file notes
        return [_error(tef.require_vision, state)], name
    if row == "a tokenizer of another model":
        processor = load_component(TINY, "processor")
        config = json.loads((TINY / "text_encoder" / "config.json").read_text())
        config["image_token_id"] = 151655
        return [_error(check_token_ids, processor, config, str(TINY / "processor"))], name
    if row == "a tokenizer without the Qwen3-VL tokens":
        from tests.test_processor_files import comfy_tokenizer_folder

        folder = comfy_tokenizer_folder(tmp / "tokenizer", drop="<|video_pad|>")
        return [_error(check_folder, folder, json.loads((TINY / "text_encoder" / "config.json").read_text()))], name
    if row == "a Wan 2.1 / 2.2 DiT":
        path = _fake(tmp / name, {"model.diffusion_model.blocks.0.self_attn.q.weight": (4, 4),
                                  "model.diffusion_model.patch_embedding.weight": (4, 4)})
        return [_error(dit_file_source, path)], name
    if row == "a Flux GGUF (or another image model) as the DiT":
        name = "flux1-dev-Q4_K_S.gguf"
        f32 = (np.zeros((4, 4), np.float32), T.F32)
        write_gguf(tmp / name, {"img_in.weight": f32, "double_blocks.0.img_attn.qkv.weight": f32}, arch="flux")
        return [_error(dit_file_source, tmp / name)], name
    if row == "a LingBot-Video DiT of a size neither published checkpoint has":
        sd = load_file(str(TINY / "transformer" / "diffusion_pytorch_model.safetensors"))
        sd["blocks.1.attn.to_k.weight"] = torch.zeros(16, 32)
        save_file(sd, str(tmp / name))
        return [_error(dit_file_source, tmp / name)], name
    raise AssertionError(f"README row {row!r} has no producer here: add one")


# The wrong files the issue names (each must be a README row): a Wan 2.1/2.2 DiT, a Flux GGUF, the Wan 2.2
# VAE (48 channels), a text-only text encoder for TI2V, and a DiT whose shapes match neither config.
ISSUE_CASES = ("a Wan 2.1 / 2.2 DiT", "a Flux GGUF (or another image model) as the DiT", "the Wan 2.2 VAE",
               "a text-only Qwen3-VL file, with TI2V", "a LingBot-Video DiT of a size neither published checkpoint has")


def test_readme_table_lists_the_issues_wrong_files():
    assert set(ISSUE_CASES) <= set(readme_messages())


@pytest.mark.parametrize("row", list(readme_messages()))
def test_readme_message_is_the_codes(tmp_path, row):
    messages, name = produced(row, tmp_path)
    shown = readme_messages()[row]
    assert shown
    for text, message in zip(shown, messages):
        assert re.search(pattern(text, name), message), (text, message)
        assert "\n" not in message
