"""The Qwen3-VL processor from a checkpoint's processor/, an explicit folder, or a Qwen tokenizer folder
(ComfyUI's qwen25_tokenizer layout) plus the shipped Qwen3-VL settings: the same ids and pixels."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lingbot_core.checkpoints import processor_files as pf
from lingbot_core.checkpoints.loading import load_component
from lingbot_core.errors import CheckpointError
from lingbot_core.prompt import build_text_inputs

TINY = Path(__file__).resolve().parent / "fixtures" / "lingbot" / "models" / "tiny-dense"
PROMPTS = ["a red boat on a lake at dawn", "雨の夜、東京の街角で傘をさす人 🌧️☂️ 猫🐈",
           '{"scene": "a market", "camera": {"movement": "dolly in", "fps": 24}, "elements": [{"id": 1, '
           '"action": "walks  left\\n"}], "duration": 5.0}']


def comfy_tokenizer_folder(target: Path, drop: str | None = None) -> Path:
    """A tokenizer folder laid out as ComfyUI ships qwen25_tokenizer (vocab.json, merges.txt,
    tokenizer_config.json with the added tokens), written from the tiny checkpoint's tokenizer.json."""
    data = json.loads((TINY / "processor" / "tokenizer.json").read_text(encoding="utf-8"))
    target.mkdir(parents=True)
    vocab = {k: v for k, v in data["model"]["vocab"].items() if k != drop}
    (target / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges = data["model"]["merges"]
    (target / "merges.txt").write_text("#version: 0.2\n" + "".join(" ".join(m) + "\n" for m in merges),
                                       encoding="utf-8")
    added = {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
             for t in data["added_tokens"] if t["content"] != drop}
    config = {"added_tokens_decoder": added, "tokenizer_class": "Qwen2Tokenizer", "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace",
              "add_prefix_space": False, "split_special_tokens": False, "clean_up_tokenization_spaces": False,
              "processor_class": "Qwen2_5_VLProcessor"}
    (target / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return target


# The published Qwen2/2.5/3/3-VL tokenizer.json pre-tokenizer: this split, then byte-level without its own regex.
# (The tiny fixture's tokenizer uses GPT-2's byte-level regex instead, which groups digits and spaces
# differently; the ComfyUI route is a Qwen2Tokenizer, so it is compared with a Qwen-pipelined copy.)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")


def qwen_pipelined_processor(target: Path) -> Path:
    folder = shutil.copytree(TINY / "processor", target)
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def reference():
    return load_component(TINY, "processor")


@pytest.fixture(scope="module")
def qwen_reference(tmp_path_factory):
    return pf.load_processor(qwen_pipelined_processor(tmp_path_factory.mktemp("p") / "processor"))


def _image() -> Image.Image:
    return Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 96, 3), dtype=np.uint8))


def _same_inputs(ours, theirs) -> None:
    for prompt in PROMPTS:
        a, b = build_text_inputs(ours, prompt), build_text_inputs(theirs, prompt)
        assert a["input_ids"].tolist() == b["input_ids"].tolist(), prompt
    a, b = build_text_inputs(ours, PROMPTS[1], _image()), build_text_inputs(theirs, PROMPTS[1], _image())
    assert a["input_ids"].tolist() == b["input_ids"].tolist()
    assert torch.equal(a["pixel_values"], b["pixel_values"]) and torch.equal(a["image_grid_thw"], b["image_grid_thw"])


@pytest.mark.parametrize("where", ["checkpoint", "processor_dir", "copied"])
def test_processor_folders(tmp_path, reference, where):
    if where == "copied":
        path = shutil.copytree(TINY / "processor", tmp_path / "my-processor")
    else:
        path = TINY if where == "checkpoint" else TINY / "processor"
    _same_inputs(pf.load_processor(path), reference)


def test_comfy_tokenizer_folder_gives_the_checkpoint_ids(tmp_path, qwen_reference, caplog):
    folder = comfy_tokenizer_folder(tmp_path / "qwen25_tokenizer")
    with caplog.at_level(logging.WARNING, logger="lingbot_core.checkpoints.processor_files"):
        ours = pf.load_processor(folder)
        pf.load_processor(folder)
    assert [r.getMessage() for r in caplog.records] == [pf.UNVERIFIED.format(folder=folder)]
    _same_inputs(ours, qwen_reference)
    te_config = json.loads((TINY / "text_encoder" / "config.json").read_text())
    pf.check_token_ids(ours, te_config, str(folder))


def test_the_fixture_tokenizer_differs_only_where_gpt2_and_qwen_splits_differ(reference, qwen_reference):
    """Why the route above is compared with a Qwen-pipelined copy: on text without digits or runs of
    spaces both splits agree, on the JSON prompt (digits) they do not."""
    plain = PROMPTS[:2]
    assert [build_text_inputs(reference, p)["input_ids"].tolist() for p in plain] == \
        [build_text_inputs(qwen_reference, p)["input_ids"].tolist() for p in plain]
    assert build_text_inputs(reference, PROMPTS[2])["input_ids"].tolist() != \
        build_text_inputs(qwen_reference, PROMPTS[2])["input_ids"].tolist()


def test_tokenizer_without_qwen_tokens_is_refused(tmp_path):
    folder = comfy_tokenizer_folder(tmp_path / "tok", drop="<|video_pad|>")
    with pytest.raises(CheckpointError, match="lacks <\\|video_pad\\|>"):
        pf.load_processor(folder)


def test_token_ids_are_held_to_the_text_encoder(reference):
    from lingbot_core.checkpoints.text_encoder_file import shipped_config

    with pytest.raises(CheckpointError, match="gives <\\|image_pad\\|> the id 5, but the text encoder expects 151655"):
        pf.check_token_ids(reference, shipped_config(), "tiny")


def test_folder_without_processor_files(tmp_path):
    with pytest.raises(CheckpointError, match="holds no processor"):
        pf.load_processor(tmp_path)


# The published Qwen3-VL-Instruct processor (Qwen/Qwen3-VL-2B-/4B-Instruct share it), as
# `AutoProcessor.from_pretrained` prints it: the image processor (preprocessor_config.json), the video
# processor (video_preprocessor_config.json) and the tokenizer's added tokens from id 151643.
PUBLISHED_IMAGE = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                   "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "merge_size": 2, "patch_size": 16,
                   "resample": 3, "rescale_factor": 1 / 255, "size": {"longest_edge": 16777216, "shortest_edge": 65536},
                   "temporal_patch_size": 2, "image_processor_type": "Qwen2VLImageProcessor"}
PUBLISHED_VIDEO = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                   "do_sample_frames": True, "fps": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                   "max_frames": 768, "merge_size": 2, "min_frames": 4, "patch_size": 16, "resample": 3,
                   "rescale_factor": 1 / 255, "return_metadata": False,
                   "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "temporal_patch_size": 2,
                   "video_processor_type": "Qwen3VLVideoProcessor"}
PUBLISHED_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                   "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                   "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                   "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                   "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
PUBLISHED_SPECIAL = set(PUBLISHED_ADDED[:14])  # the rest are added tokens that are not special


def test_shipped_processor_settings_are_the_published_qwen3_vl_ones(tmp_path):
    """The package data the ComfyUI-tokenizer route builds from, field by field, and the processor it builds."""
    shipped = pf.shipped_settings()
    assert shipped["image_processor"] == PUBLISHED_IMAGE
    assert shipped["video_processor"] == PUBLISHED_VIDEO
    assert shipped["first_added_id"] == 151643
    assert [t["content"] for t in shipped["added_tokens"]] == PUBLISHED_ADDED
    assert {t["content"] for t in shipped["added_tokens"] if t["special"]} == PUBLISHED_SPECIAL
    built = pf.load_processor(comfy_tokenizer_folder(tmp_path / "qwen25_tokenizer"))
    assert built.video_processor.size == PUBLISHED_VIDEO["size"]
    assert built.image_processor.size == PUBLISHED_IMAGE["size"]
    assert built.image_processor.patch_size == PUBLISHED_IMAGE["patch_size"]
