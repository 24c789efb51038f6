"""The built-in tiny checkpoint: real layout, plain-library reloads, determinism and the build cache."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import fixture_set
from diffusers import AutoencoderKLWan
from PIL import Image
from safetensors import safe_open
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from lingbot_core import tiny
from lingbot_core.models.transformer import LingBotVideoTransformer3DModel
from lingbot_core.tiny import (
    TINY_MARKER,
    build_tiny_checkpoint,
    default_tiny_dir,
    ensure_tiny_checkpoint,
    is_tiny_checkpoint,
)

# The independent truth: the fixture models were written by the reference's tooling in the real
# checkpoint layout (tests/fixtures/lingbot/README.md). Ours must have the same files, configs,
# tensor names, shapes and dtypes, and the same tokenizer setup. Allowed differences, each for a
# stated reason:
VERSION_KEYS = {"_diffusers_version", "transformers_version"}  # the library versions that wrote them
ALLOWED = {
    # newer transformers serialise these defaults; the fixtures were written by 5.8
    "text_encoder/config.json": ("vision_config.rope_parameters.",
                                 # our own byte-level BPE has 1024 tokens, the fixture's 1117
                                 "text_config.vocab_size"),
    "processor/processor_config.json": ("video_processor.max_video_tokens",),
    "processor/video_preprocessor_config.json": ("max_video_tokens",),
}
EMBEDDINGS = "model.language_model.embed_tokens.weight"  # rows = vocab_size, so it differs with the vocabulary
FIXTURE_MODELS = fixture_set("lingbot") / "models"
SPECIAL_TOKENS = [t["content"] for t in
                  json.loads((FIXTURE_MODELS / "tiny-dense" / "processor" / "tokenizer.json").read_text())["added_tokens"]]

CAPTION = json.dumps(
    {"subject": "a red fox", "camera": {"shot": "wide shot", "movement": "slow pan"}, "colors": ["orange"]},
    separators=(",", ":"),
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {variant: build_tiny_checkpoint(root / variant, variant) for variant in ("dense", "moe")}


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def _digests(folder: Path, suffix: str = "") -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob(f"*{suffix}"))
        if p.is_file()
    }


def _read(folder: Path, rel: str) -> dict:
    return json.loads((folder / rel).read_text())


def _flat(data: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _tensor_meta(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with safe_open(str(path), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


# --- layout, against the fixture models ----------------------------------------------------------------


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_same_files_as_the_fixture_model(built: dict[str, Path], variant: str) -> None:
    folder = built[variant]
    assert _files(folder) == _files(FIXTURE_MODELS / f"tiny-{variant}") | {TINY_MARKER}
    assert not list(folder.parent.glob(".*")), "temporary build folders were left behind"
    marker = _read(folder, TINY_MARKER)
    assert (marker["variant"], marker["seed"], marker["format_version"]) == (variant, 0, tiny.TINY_FORMAT_VERSION)
    assert set(marker["files"]) == _files(folder) - {TINY_MARKER}


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_configs_match_the_fixture_model(built: dict[str, Path], variant: str) -> None:
    """Every config, the tokenizer config and the chat template as the fixture model has them."""
    folder, truth = built[variant], FIXTURE_MODELS / f"tiny-{variant}"
    texts = sorted(f for f in _files(truth) if f.endswith((".json", ".jinja")) and f != "processor/tokenizer.json")
    assert "transformer/config.json" in texts and "scheduler/scheduler_config.json" in texts
    for rel in texts:
        if rel.endswith(".jinja"):
            assert (folder / rel).read_text() == (truth / rel).read_text(), rel
            continue
        ours, theirs = _flat(_read(folder, rel)), _flat(_read(truth, rel))
        allowed = ALLOWED.get(rel, ())
        differ = sorted(k for k in ours.keys() | theirs.keys()
                        if ours.get(k, "<missing>") != theirs.get(k, "<missing>")
                        and k.rsplit(".", 1)[-1] not in VERSION_KEYS and not k.startswith(allowed))
        assert not differ, f"{rel}: " + ", ".join(
            f"{k}: ours {ours.get(k)!r}, fixture {theirs.get(k)!r}" for k in differ)


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_tensors_match_the_fixture_model(built: dict[str, Path], variant: str) -> None:
    """Same tensor names, shapes and dtypes in every weights file; only the vocabulary rows differ."""
    folder, truth = built[variant], FIXTURE_MODELS / f"tiny-{variant}"
    files = sorted(f for f in _files(truth) if f.endswith(".safetensors"))
    assert len(files) == (4 if variant == "moe" else 3)
    vocab = _read(folder, "text_encoder/config.json")["text_config"]["vocab_size"]
    for rel in files:
        ours, theirs = _tensor_meta(folder / rel), _tensor_meta(truth / rel)
        assert ours.keys() == theirs.keys(), rel
        for name, (shape, dtype) in theirs.items():
            if name == EMBEDDINGS:
                shape = (vocab, *shape[1:])
            assert ours[name] == (shape, dtype), f"{rel}: {name}"


def test_tokenizer_is_set_up_like_the_fixture_one(built: dict[str, Path]) -> None:
    """Same BPE settings, normaliser, pre-tokenizer, decoder, post-processor and special tokens (ids
    included); only the learned vocabulary and merges are our own."""
    ours = _read(built["dense"], "processor/tokenizer.json")
    theirs = _read(FIXTURE_MODELS / "tiny-dense", "processor/tokenizer.json")
    assert ours.keys() == theirs.keys()
    for key in ours.keys() - {"model"}:
        assert ours[key] == theirs[key], key
    settings = [{k: v for k, v in t["model"].items() if k not in ("vocab", "merges")} for t in (ours, theirs)]
    assert settings[0] == settings[1]
    assert ours["model"]["vocab"] and ours["model"]["merges"]


# --- reload with plain library calls -----------------------------------------------------------------


def _safetensors_keys(path: Path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_components_reload_without_missing_keys(built: dict[str, Path], variant: str) -> None:
    folder = built[variant]
    subfolders = ["transformer", "refiner"] if variant == "moe" else ["transformer"]
    state_dicts = []
    for sub in subfolders:
        dit, info = LingBotVideoTransformer3DModel.from_pretrained(folder, subfolder=sub, output_loading_info=True)
        assert not any(info.values()), info
        keys = set(dit.state_dict())
        assert keys == _safetensors_keys(folder / sub / "diffusion_pytorch_model.safetensors")
        fresh = LingBotVideoTransformer3DModel.from_config(dit.config)
        assert keys == set(fresh.state_dict())
        state_dicts.append(dit.state_dict())
        for name, tensor in dit.state_dict().items():
            assert torch.isfinite(tensor).all(), name
            if name.endswith(("scale_shift_table", "bias", "e_score_correction_bias")):
                assert tensor.abs().max() > 0, f"{name} should be random, not zero"
    if variant == "moe":  # the refiner has its own weights
        a, b = state_dicts
        assert a.keys() == b.keys() and not torch.equal(a["patch_embedder.weight"], b["patch_embedder.weight"])
        assert "blocks.0.ffn.router.e_score_correction_bias" in a

    vae, info = AutoencoderKLWan.from_pretrained(folder, subfolder="vae", output_loading_info=True)
    assert not any(info.values()), info
    assert set(vae.state_dict()) == set(AutoencoderKLWan.from_config(vae.config).state_dict())

    te, info = Qwen3VLForConditionalGeneration.from_pretrained(
        folder / "text_encoder", local_files_only=True, output_loading_info=True
    )
    assert not any(info.values()), info
    assert te.lm_head.weight.data_ptr() == te.model.language_model.embed_tokens.weight.data_ptr()
    saved = _safetensors_keys(folder / "text_encoder" / "model.safetensors")
    assert "lm_head.weight" not in saved  # tied, as in the real checkpoint
    assert saved == set(te.state_dict()) - {"lm_head.weight"}

    processor = Qwen3VLProcessor.from_pretrained(folder / "processor", local_files_only=True)
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert type(processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
    assert type(processor.tokenizer).__name__ == "TokenizersBackend"


# --- determinism -------------------------------------------------------------------------------------


def test_same_seed_gives_identical_bytes_and_other_seeds_differ(built: dict[str, Path], tmp_path: Path) -> None:
    reference = _digests(built["dense"])
    again = build_tiny_checkpoint(tmp_path / "again", "dense", seed=0)
    assert _digests(again) == reference

    other = _digests(build_tiny_checkpoint(tmp_path / "other", "dense", seed=1), ".safetensors")
    for rel, digest in _digests(built["dense"], ".safetensors").items():
        assert other[rel] != digest, rel
    # the tokenizer does not depend on the seed
    assert _digests(tmp_path / "other" / "processor") == _digests(built["dense"] / "processor")


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    build_tiny_checkpoint(tmp_path / "x", "dense", seed=5)
    assert torch.equal(torch.get_rng_state(), state)


# --- tokenizer, processor and text encoder ------------------------------------------------------------


def test_tokenizer_special_tokens_and_round_trip(built: dict[str, Path]) -> None:
    from lingbot_core.prompt import PROMPT_TEMPLATE

    folder = built["dense"]
    tokenizer = Qwen3VLProcessor.from_pretrained(folder / "processor", local_files_only=True).tokenizer
    te_config = _read(folder, "text_encoder/config.json")

    ids = {}
    for token in SPECIAL_TOKENS:
        encoded = tokenizer(token, add_special_tokens=False)["input_ids"]
        assert len(encoded) == 1, token
        ids[token] = encoded[0]
    assert len(set(ids.values())) == len(SPECIAL_TOKENS)
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == ids["<|endoftext|>"]
    assert te_config["image_token_id"] == ids["<|image_pad|>"]
    assert te_config["video_token_id"] == ids["<|video_pad|>"]
    assert te_config["vision_start_token_id"] == ids["<|vision_start|>"]
    assert te_config["vision_end_token_id"] == ids["<|vision_end|>"]
    assert te_config["text_config"]["pad_token_id"] == ids["<|endoftext|>"]
    assert te_config["text_config"]["eos_token_id"] == ids["<|im_end|>"]
    assert te_config["text_config"]["vocab_size"] >= len(tokenizer)

    for text in (PROMPT_TEMPLATE.format(CAPTION), CAPTION, "Ünïcödé ✓ 日本 \t\n  spaces"):
        encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert max(encoded) < te_config["text_config"]["vocab_size"]
        assert tokenizer.decode(encoded) == text
    prefix_tokens = len(tokenizer(PROMPT_TEMPLATE.split("{}")[0])["input_ids"])
    assert prefix_tokens < len(PROMPT_TEMPLATE) / 3, "the BPE should compress the system prompt"


def test_processor_and_text_encoder_with_image(built: dict[str, Path]) -> None:
    from lingbot_core.prompt import IMAGE_PROMPT_PREFIX, PROMPT_TEMPLATE

    folder = built["dense"]
    processor = Qwen3VLProcessor.from_pretrained(folder / "processor", local_files_only=True)
    te = Qwen3VLForConditionalGeneration.from_pretrained(folder / "text_encoder", local_files_only=True).eval()
    pixels = (np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8)
    inputs = processor(
        text=[PROMPT_TEMPLATE.format(IMAGE_PROMPT_PREFIX + CAPTION)],
        images=[Image.fromarray(pixels)],
        do_resize=False,
        padding="longest",
        truncation=True,
        max_length=37698,
        return_tensors="pt",
    )
    assert "mm_token_type_ids" in inputs
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    image_token_id = _read(folder, "text_encoder/config.json")["image_token_id"]
    n_image = int((inputs["input_ids"] == image_token_id).sum())
    assert n_image == 4 == int(inputs["mm_token_type_ids"].sum())

    with torch.no_grad():
        hidden = te.model(**inputs).last_hidden_state
    text_dim = _read(folder, "transformer/config.json")["text_dim"]
    assert hidden.shape == (1, inputs["input_ids"].shape[1], text_dim)
    assert torch.isfinite(hidden).all() and hidden.std() > 0.1


# --- DiT and VAE run ---------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_dit_forward_is_finite(built: dict[str, Path], variant: str) -> None:
    dit = LingBotVideoTransformer3DModel.from_pretrained(built[variant], subfolder="transformer").eval()
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 2, 4, 4, generator=g)
    text = torch.randn(1, 8, dit.config.text_dim, generator=g)
    with torch.no_grad():
        out = dit(latents, torch.tensor([700.0]), text).sample
        out_other_t = dit(latents, torch.tensor([100.0]), text).sample
    assert out.shape == latents.shape
    assert torch.isfinite(out).all() and out.std() > 0.1
    assert (out - out_other_t).abs().max() > 1e-3, "the timestep should change the output"


def test_vae_decode_shape(built: dict[str, Path]) -> None:
    vae = AutoencoderKLWan.from_pretrained(built["dense"], subfolder="vae").eval()
    latents = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        frames = vae.decode(latents).sample
    assert frames.shape == (1, 3, 5, 32, 32)
    assert torch.isfinite(frames).all() and frames.std() > 0.01


# --- cache and marker --------------------------------------------------------------------------------


@pytest.fixture
def build_counter(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = tiny._write_checkpoint

    def counting(root: Path, variant: str, seed: int) -> None:
        calls.append(variant)
        real(root, variant, seed)

    monkeypatch.setattr(tiny, "_write_checkpoint", counting)
    return calls


def test_cache_reuse_overwrite_and_repair(tmp_path: Path, build_counter: list[str]) -> None:
    folder = tmp_path / "ckpt"
    assert build_tiny_checkpoint(folder, "dense") == folder.absolute()
    assert len(build_counter) == 1 and is_tiny_checkpoint(folder, "dense", 0)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    mtime = weights.stat().st_mtime_ns

    build_tiny_checkpoint(folder, "dense")  # complete: returned as is
    assert len(build_counter) == 1 and weights.stat().st_mtime_ns == mtime

    build_tiny_checkpoint(folder, "dense", overwrite=True)
    assert len(build_counter) == 2

    (folder / "vae" / "diffusion_pytorch_model.safetensors").unlink()  # incomplete: rebuilt
    assert not is_tiny_checkpoint(folder)
    build_tiny_checkpoint(folder, "dense")
    assert len(build_counter) == 3 and is_tiny_checkpoint(folder, "dense", 0)

    with open(weights, "r+b") as f:  # truncated: rebuilt
        f.truncate(100)
    build_tiny_checkpoint(folder, "dense")
    assert len(build_counter) == 4 and is_tiny_checkpoint(folder, "dense", 0)

    build_tiny_checkpoint(folder, "dense", seed=3)  # other seed / variant: rebuilt in place
    assert len(build_counter) == 5 and is_tiny_checkpoint(folder, "dense", 3)
    assert not is_tiny_checkpoint(folder, "dense", 0) and not is_tiny_checkpoint(folder, "moe")
    build_tiny_checkpoint(folder, "moe", seed=3)
    assert len(build_counter) == 6 and (folder / "refiner").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_interrupted_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "_write_vae", broken)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_checkpoint(tmp_path / "ckpt", "dense")
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_replace_a_foreign_folder(tmp_path: Path, build_counter: list[str]) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError):
            build_tiny_checkpoint(foreign, "dense", overwrite=overwrite)
    assert (foreign / "notes.txt").read_text() == "keep me" and build_counter == []

    empty = tmp_path / "empty"
    empty.mkdir()
    assert is_tiny_checkpoint(build_tiny_checkpoint(empty, "dense"), "dense", 0)

    with pytest.raises(ValueError):
        build_tiny_checkpoint(tmp_path / "x", "huge")


def test_default_dir_and_ensure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, build_counter: list[str]) -> None:
    monkeypatch.delenv("LINGBOT_TINY_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_tiny_dir("moe") == tmp_path / "xdg" / "lingbot-nodes" / "tiny-moe"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_tiny_dir() == tmp_path / "home" / ".cache" / "lingbot-nodes" / "tiny-dense"

    monkeypatch.setenv("LINGBOT_TINY_DIR", str(tmp_path / "cache"))
    assert default_tiny_dir("dense") == tmp_path / "cache" / "tiny-dense"
    path = ensure_tiny_checkpoint("dense")
    assert path == tmp_path / "cache" / "tiny-dense" and is_tiny_checkpoint(path, "dense", 0)
    assert ensure_tiny_checkpoint("dense") == path
    assert build_counter == ["dense"]
