"""The built-in tiny checkpoint: real layout, plain-library reloads, determinism and the build cache."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
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

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

COMMON_FILES = {
    TINY_MARKER,
    "model_index.json",
    "scheduler/scheduler_config.json",
    "transformer/config.json",
    "transformer/diffusion_pytorch_model.safetensors",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
    "text_encoder/config.json",
    "text_encoder/generation_config.json",
    "text_encoder/model.safetensors",
    "processor/processor_config.json",
    "processor/preprocessor_config.json",
    "processor/video_preprocessor_config.json",
    "processor/tokenizer.json",
    "processor/tokenizer_config.json",
    "processor/chat_template.jinja",
}
REFINER_FILES = {"refiner/config.json", "refiner/diffusion_pytorch_model.safetensors"}

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


# --- layout ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_layout_and_configs(built: dict[str, Path], variant: str) -> None:
    folder = built[variant]
    expected = COMMON_FILES | (REFINER_FILES if variant == "moe" else set())
    assert _files(folder) == expected
    assert not list(folder.parent.glob(".*")), "temporary build folders were left behind"

    index = _read(folder, "model_index.json")
    assert index["_class_name"] == "LingBotVideoPipeline"
    assert "_diffusers_version" in index
    assert {k: v for k, v in index.items() if not k.startswith("_")} == {
        "processor": ["transformers", "Qwen3VLProcessor"],
        "scheduler": ["lingbot_video.scheduling_flow_unipc", "FlowUniPCMultistepScheduler"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "transformer": ["lingbot_video.transformer_lingbot_video", "LingBotVideoTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }

    scheduler = _read(folder, "scheduler/scheduler_config.json")
    scheduler.pop("_diffusers_version")
    assert scheduler == {
        "_class_name": "FlowUniPCMultistepScheduler",
        "disable_corrector": [],
        "dynamic_thresholding_ratio": 0.995,
        "final_sigmas_type": "zero",
        "lower_order_final": True,
        "num_train_timesteps": 1000,
        "predict_x0": True,
        "prediction_type": "flow_prediction",
        "sample_max_value": 1.0,
        "shift": 1.0,
        "solver_order": 2,
        "solver_p": None,
        "solver_type": "bh2",
        "steps_offset": 0,
        "thresholding": False,
        "timestep_spacing": "linspace",
        "use_dynamic_shifting": False,
    }

    dit = _read(folder, "transformer/config.json")
    te = _read(folder, "text_encoder/config.json")
    assert dit["_class_name"] == "LingBotVideoTransformer3DModel"
    assert (dit["hidden_size"], dit["num_attention_heads"], dit["depth"], dit["freq_dim"]) == (32, 2, 2, 32)
    assert dit["axes_dims"] == [4, 6, 6] and dit["intermediate_size"] == 64
    assert dit["text_dim"] == te["text_config"]["hidden_size"] == te["vision_config"]["out_hidden_size"]
    if variant == "moe":
        assert _read(folder, "refiner/config.json") == dit
        moe = {k: dit[k] for k in ("num_experts", "num_experts_per_tok", "n_group", "topk_group")}
        assert moe == {"num_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1}
        assert (dit["n_shared_experts"], dit["moe_intermediate_size"], dit["routed_scaling_factor"]) == (1, 16, 2.5)
    else:
        assert dit["num_experts"] == 0

    vae = _read(folder, "vae/config.json")
    assert vae["_class_name"] == "AutoencoderKLWan"
    assert (vae["base_dim"], vae["z_dim"], vae["num_res_blocks"]) == (8, 16, 1)
    assert vae["dim_mult"] == [1, 2, 2, 2] and vae["temperal_downsample"] == [False, True, True]
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == 16
    assert vae["latents_mean"][0] == -0.7571 and vae["latents_std"][0] == 2.8184

    tok_cfg = _read(folder, "processor/tokenizer_config.json")
    assert tok_cfg["tokenizer_class"] == "TokenizersBackend" and tok_cfg["pad_token"] == "<|endoftext|>"
    assert "local_files_only" not in tok_cfg and "is_local" not in tok_cfg
    proc_cfg = _read(folder, "processor/processor_config.json")
    assert proc_cfg["processor_class"] == "Qwen3VLProcessor"
    for sub in ("image_processor", "video_processor"):
        cfg = proc_cfg[sub]
        assert (cfg["patch_size"], cfg["merge_size"], cfg["temporal_patch_size"]) == (16, 2, 2)
        assert cfg["image_mean"] == cfg["image_std"] == [0.5, 0.5, 0.5]

    marker = _read(folder, TINY_MARKER)
    assert (marker["variant"], marker["seed"], marker["format_version"]) == (variant, 0, tiny.TINY_FORMAT_VERSION)
    assert set(marker["files"]) == expected - {TINY_MARKER}


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
