"""Text conditioning parity: caption strings, template, crop and encoder output against the fixtures."""

from __future__ import annotations

import gc
import json
import re
import weakref
from pathlib import Path

import pytest
import torch
from parity_cases import discover

from lingbot_core.image import load_image, prepare_image_pixels, vision_image, vision_patch_size
from lingbot_core.prompt import (
    DEFAULT_NEGATIVE_PROMPT,
    DEFAULT_NEGATIVE_PROMPT_IMAGE,
    IMAGE_PROMPT_PREFIX,
    PROMPT_TEMPLATE,
    build_text_inputs,
    caption_to_text,
    crop_start,
    encode_text,
)

PIPELINE_MODES = {"t2v", "t2i", "ti2v", "refine"}
CPU = torch.device("cpu")


CASES = discover(PIPELINE_MODES)


@pytest.fixture(scope="module")
def encoders():
    """Loads (text_encoder, processor) once per model folder for the whole module."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    cache: dict[Path, tuple] = {}

    def get(model_dir: Path):
        if model_dir not in cache:
            encoder = Qwen3VLForConditionalGeneration.from_pretrained(
                model_dir / "text_encoder",
                local_files_only=True,
                attn_implementation="sdpa",
                torch_dtype=torch.float32,
            )
            processor = Qwen3VLProcessor.from_pretrained(model_dir / "processor", local_files_only=True)
            cache[model_dir] = (encoder.eval(), processor)
        return cache[model_dir]

    return get


def _count(ids: torch.Tensor, processor, token: str) -> int:
    return int((ids == processor.tokenizer.convert_tokens_to_ids(token)).sum())


# --- parity ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_prompt_conditioning_matches_reference(case, fixtures_root, encoders):
    cfg = case.spec
    expected = case.expected()
    tokens = cfg["tokens"]
    encoder, processor = encoders(case.model_dir)

    image = None
    if cfg["mode"] == "ti2v":
        source = load_image(case.path / cfg["image"])
        pixels = prepare_image_pixels(source, cfg["height"], cfg["width"])
        image = vision_image(pixels, vision_patch_size(encoder, processor))
    # refine: text-only conditioning even when the base was TI2V

    # The fixture prompt is what the reference CLI produced from prompt.json; it must survive our caption step.
    text = caption_to_text(cfg["prompt"])
    assert text == cfg["prompt"]
    assert crop_start(processor) == tokens["crop_start"]

    branches = [("prompt", "prompt", text)]
    if cfg["negative_prompt_used"]:
        branches.append(("negative", "negative_prompt", cfg["negative_prompt"]))  # verbatim, never compacted

    for ids_key, key, string in branches:
        result = encode_text(encoder, processor, string, image=image, device=CPU)
        case.check(f"{ids_key}_input_ids", result.input_ids, expected)
        case.check(f"{key}_mask", result.mask, expected)
        case.check(f"{key}_embeds", result.embeds, expected)
        assert result.embeds.dtype == torch.float32

        short = "prompt" if ids_key == "prompt" else "negative"
        assert result.input_ids.shape[1] == tokens[f"{short}_tokens_total"]
        assert result.embeds.shape[1] == tokens[f"{short}_len"]
        assert result.mask.dtype == torch.int64 and bool((result.mask == 1).all())
        image_pads = _count(result.input_ids, processor, "<|image_pad|>")
        assert image_pads == tokens.get("image_tokens", 0)
        # the template prefix really is what gets cropped
        assert result.input_ids.shape[1] - tokens["crop_start"] >= result.embeds.shape[1]


def test_cases_were_found(fixtures_root):
    modes = {c.spec["mode"] for c in CASES}
    assert {"t2v", "t2i", "ti2v", "refine"} <= modes


# --- strings ---------------------------------------------------------------------------------------------


def _pipeline_configs() -> list[dict]:
    """The shared fixtures' pipeline case.json contents (not LINGBOT_PARITY_DIRS)."""
    return [c.spec for c in discover(PIPELINE_MODES, extra=False)]


def test_template_and_default_negatives_match_fixtures(fixtures_root):
    cfgs = _pipeline_configs()
    assert cfgs
    for cfg in cfgs:
        assert cfg["prompt_template"] == PROMPT_TEMPLATE
        assert cfg["image_prompt_prefix"] == IMAGE_PROMPT_PREFIX
    defaults = {"video": DEFAULT_NEGATIVE_PROMPT, "image": DEFAULT_NEGATIVE_PROMPT_IMAGE}
    seen = set()
    for cfg in cfgs:
        if cfg.get("negative_prompt_is_default"):
            kind = cfg["negative_prompt_default_kind"]
            assert cfg["negative_prompt"] == defaults[kind], cfg["name"]
            seen.add(kind)
    assert seen == {"video", "image"}
    assert PROMPT_TEMPLATE.count("{}") == 1


def test_default_negatives_are_not_compact_json():
    # Why negatives bypass caption_to_text: compaction would change the reference's negative string.
    for negative in (DEFAULT_NEGATIVE_PROMPT, DEFAULT_NEGATIVE_PROMPT_IMAGE):
        assert ", " in negative
        assert caption_to_text(negative) != negative
        assert json.loads(caption_to_text(negative)) == json.loads(negative)


def test_caption_to_text_fixture_prompts_roundtrip(fixtures_root):
    for cfg in _pipeline_configs():
        prompt = cfg["prompt"]
        parsed = json.loads(prompt)
        assert caption_to_text(parsed) == prompt
        assert caption_to_text([parsed, {"other": 1}]) == prompt
        assert caption_to_text({"caption": parsed, "duration": 5, "fps": 24}) == prompt
        assert caption_to_text(json.dumps(parsed, indent=2)) == prompt  # pretty-printed paste gets compacted


def test_caption_to_text_rules():
    sample = {
        "scene": "café at night",
        "duration": 5,
        "fps": 24,
        "height": 480,
        "width": 832,
        "num_frames": 121,
        "resolution": "480p",
        "ratio": "16:9",
        "tags": ["a", "b"],
    }
    assert caption_to_text(sample) == '{"scene":"café at night","tags":["a","b"]}'
    assert caption_to_text({"caption": {"x": 1, "duration": 2}, "duration": 5}) == '{"x":1,"duration":2}'
    assert caption_to_text({"caption": "plain caption", "fps": 24}) == "plain caption"
    assert caption_to_text([{"caption": {"a": [1, 2]}}]) == '{"a":[1,2]}'
    assert caption_to_text('  {"a": {"b": "ü"}}') == '{"a":{"b":"ü"}}'
    prose = "A cat sits on a {red} mat, looking left."
    assert caption_to_text(prose) == prose
    assert caption_to_text("") == ""
    with pytest.raises(ValueError, match="empty list"):
        caption_to_text([])
    with pytest.raises(ValueError, match="JSON object"):
        caption_to_text("[1, 2]")


def test_caption_to_text_broken_json_names_position_and_character():
    with pytest.raises(ValueError) as err:
        caption_to_text('{"a": 1,, "b": 2}')
    assert str(err.value) == (
        "prompt is not valid JSON at line 1 column 9 (char 8, ','): "
        "Expecting property name enclosed in double quotes"
    )
    with pytest.raises(ValueError, match=re.escape("line 3 column 9 (char 20, '}')")):
        caption_to_text('{\n  "a": 1,\n  "b": [}]\n}')
    with pytest.raises(ValueError, match="end of text"):
        caption_to_text('{"a": ')


# --- crop_start / encoder hygiene ------------------------------------------------------------------------


class _CountingProcessor:
    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_crop_start_is_computed_once_per_processor(fixtures_root, encoders):
    _, processor = encoders(fixtures_root / "models" / "tiny-dense")
    first = _CountingProcessor(processor)
    assert crop_start(first) == 138
    assert crop_start(first) == 138
    assert first.calls == 1
    second = _CountingProcessor(processor)
    assert crop_start(second) == 138
    assert second.calls == 1 and first.calls == 1
    # the cache must not keep processors alive
    ref = weakref.ref(first)
    del first
    gc.collect()
    assert ref() is None


def test_encode_text_leaves_encoder_untouched(fixtures_root, encoders):
    encoder, processor = encoders(fixtures_root / "models" / "tiny-dense")
    head = encoder.lm_head
    result = encode_text(encoder, processor, "a short prose prompt", device=CPU)
    assert encoder.lm_head is head and isinstance(head, torch.nn.Linear)
    assert not encoder.training
    assert not result.embeds.requires_grad
    assert result.embeds.shape[0] == 1 and result.embeds.shape[1] == result.mask.shape[1] > 0
    assert result.input_ids.shape[1] == crop_start(processor) + result.embeds.shape[1]


def test_build_text_inputs_rejects_unaligned_image(fixtures_root, encoders):
    from PIL import Image

    _, processor = encoders(fixtures_root / "models" / "tiny-dense")
    with pytest.raises(ValueError, match="vision_image"):
        build_text_inputs(processor, "x", Image.new("RGB", (70, 50)))
