"""Text conditioning parity: caption strings, template, crop and encoder output against the fixtures."""

from __future__ import annotations

import gc
import json
import os
import re
import weakref
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES
from safetensors.torch import load_file

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


# --- case discovery (collection time; the fixture root is the one conftest resolves) ----------------------


def _model_root(case_dir: Path) -> Path:
    """External cases name their model relative to the nearest ancestor that holds `models/`."""
    for parent in case_dir.parents:
        if (parent / "models").is_dir():
            return parent
    return FIXTURES


def _case_dirs(entry: Path) -> list[Path]:
    if (entry / "case.json").is_file():
        return [entry]
    if (entry / "cases").is_dir():
        entry = entry / "cases"
    return sorted(p for p in entry.iterdir() if (p / "case.json").is_file()) if entry.is_dir() else []


def discover_cases(modes: set[str]) -> list[tuple[Path, Path]]:
    """(case_dir, model_root) for the fixture cases plus any in LINGBOT_PARITY_DIRS."""
    found = [(d, FIXTURES) for d in _case_dirs(FIXTURES / "cases")]
    for raw in filter(None, os.environ.get("LINGBOT_PARITY_DIRS", "").split(os.pathsep)):
        found += [(d, _model_root(d)) for d in _case_dirs(Path(raw).resolve())]
    return [(d, root) for d, root in found if json.loads((d / "case.json").read_text())["mode"] in modes]


CASES = discover_cases(PIPELINE_MODES)


def _case_id(item: tuple[Path, Path]) -> str:
    return item[0].name


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


def _assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, spec: dict) -> float:
    assert tuple(actual.shape) == tuple(expected.shape) == tuple(spec["shape"]), name
    if not expected.is_floating_point():
        assert actual.dtype == expected.dtype, name
        assert torch.equal(actual.cpu(), expected), f"{name}: integer tensor differs"
        return 0.0
    actual = actual.detach().cpu().to(expected.dtype)
    diff = (actual - expected).abs()
    bound = spec["atol"] + spec["rtol"] * expected.abs()
    worst = float(diff.max())
    assert bool((diff <= bound).all()), f"{name}: max abs diff {worst:.3g} exceeds atol {spec['atol']}"
    return worst


def _count(ids: torch.Tensor, processor, token: str) -> int:
    return int((ids == processor.tokenizer.convert_tokens_to_ids(token)).sum())


# --- parity ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_prompt_conditioning_matches_reference(case, fixtures_root, encoders):
    case_dir, model_root = case
    cfg = json.loads((case_dir / "case.json").read_text())
    expected = load_file(case_dir / cfg["expected"])
    specs = cfg["tensors"]
    tokens = cfg["tokens"]
    encoder, processor = encoders(model_root / cfg["model"])

    image = None
    if cfg["mode"] == "ti2v":
        pixels = prepare_image_pixels(load_image(case_dir / cfg["image"]), cfg["height"], cfg["width"])
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
        _assert_close(
            f"{ids_key}_input_ids",
            result.input_ids,
            expected[f"{ids_key}_input_ids"],
            specs[f"{ids_key}_input_ids"],
        )
        _assert_close(f"{key}_mask", result.mask, expected[f"{key}_mask"], specs[f"{key}_mask"])
        _assert_close(f"{key}_embeds", result.embeds, expected[f"{key}_embeds"], specs[f"{key}_embeds"])
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
    modes = {json.loads((d / "case.json").read_text())["mode"] for d, _ in CASES}
    assert {"t2v", "t2i", "ti2v", "refine"} <= modes


# --- strings ---------------------------------------------------------------------------------------------


def _pipeline_configs(root: Path) -> list[dict]:
    cfgs = [json.loads((d / "case.json").read_text()) for d in _case_dirs(root / "cases")]
    return [c for c in cfgs if c["mode"] in PIPELINE_MODES]


def test_template_and_default_negatives_match_fixtures(fixtures_root):
    cfgs = _pipeline_configs(fixtures_root)
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
    for cfg in _pipeline_configs(fixtures_root):
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
