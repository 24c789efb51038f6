"""TI2V image preparation parity: conditioning pixels, vision-tower picture, smart_resize and loading."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from parity_cases import discover
from PIL import Image

from lingbot_core.image import (
    load_image,
    prepare_image_pixels,
    smart_resize,
    vision_image,
    vision_patch_size,
)
from lingbot_core.prompt import build_text_inputs

TI2V_CASES = discover({"ti2v"})


@pytest.fixture(scope="module")
def processors():
    from transformers import Qwen3VLProcessor

    cache: dict[Path, object] = {}

    def get(model_dir: Path):
        if model_dir not in cache:
            cache[model_dir] = Qwen3VLProcessor.from_pretrained(
                model_dir / "processor", local_files_only=True
            )
        return cache[model_dir]

    return get


# --- parity ----------------------------------------------------------------------------------------------


def test_ti2v_cases_found(fixtures_root):
    assert TI2V_CASES


@pytest.mark.parametrize("case", TI2V_CASES, ids=lambda c: c.name)
def test_ti2v_image_matches_reference(case, fixtures_root, processors):
    cfg = case.spec
    expected = case.expected()
    processor = processors(case.model_dir)

    source = load_image(case.path / cfg["image"])
    assert list(source.size) == cfg["image_size_wh"]
    pixels = prepare_image_pixels(source, cfg["height"], cfg["width"])
    assert pixels.dtype == torch.float32
    case.check("image_pixels", pixels, expected)

    seen = vision_image(pixels)  # fixture encoder: patch 16, merge 2
    assert list(seen.size) == cfg["vlm_image_size_wh"]
    inputs = build_text_inputs(processor, cfg["prompt"], seen)
    case.check("vlm_pixel_values", inputs["pixel_values"], expected)
    assert torch.equal(inputs["image_grid_thw"], expected["vlm_image_grid_thw"])
    assert "mm_token_type_ids" in inputs  # transformers 5.x needs it next to pixel_values


@pytest.mark.parametrize("case", TI2V_CASES, ids=lambda c: c.name)
def test_comfy_tensor_input_gives_same_pixels(case, fixtures_root):
    cfg = case.spec
    expected = case.expected()["image_pixels"]
    with Image.open(case.path / cfg["image"]) as im:
        array = np.array(im.convert("RGB"))
    comfy = torch.from_numpy(array).float().div(255.0).unsqueeze(0)  # ComfyUI LoadImage layout [B,H,W,3]
    batch = torch.cat([comfy, torch.zeros_like(comfy)])
    for given in (comfy, comfy[0], batch, comfy.numpy()):
        loaded = load_image(given)
        assert loaded.mode == "RGB"
        assert np.array_equal(np.array(loaded), array)
    pixels = prepare_image_pixels(load_image(batch), cfg["height"], cfg["width"])
    assert torch.equal(pixels, expected)


# --- loading ---------------------------------------------------------------------------------------------


def test_load_image_float_rounds_to_nearest():
    frame = torch.full((2, 2, 3), 0.0)
    frame[0, 0] = torch.tensor([10.4, 10.6, 254.9]) / 255.0
    frame[1, 1] = torch.tensor([-0.2, 1.3, 0.5])
    out = np.array(load_image(frame))
    assert out[0, 0].tolist() == [10, 11, 255]
    assert out[1, 1].tolist() == [0, 255, 128]  # clamped; 127.5 rounds half to even


def test_load_image_other_layouts():
    rgba = Image.new("RGBA", (5, 4), (10, 20, 30, 0))
    assert load_image(rgba).mode == "RGB" and load_image(rgba).getpixel((0, 0)) == (10, 20, 30)
    gray = np.full((4, 5), 7, dtype=np.uint8)
    assert load_image(gray).getpixel((0, 0)) == (7, 7, 7)
    with pytest.raises(ValueError, match=r"\[H,W,3\]"):
        load_image(torch.zeros(1, 3, 4, 5))  # channels-first is not a ComfyUI IMAGE
    with pytest.raises(TypeError):
        load_image(42)


def test_load_image_missing_file(tmp_path):
    missing = tmp_path / "nope.png"
    with pytest.raises(ValueError, match=r"cannot read image '.*nope\.png': "):
        load_image(missing)


def test_load_image_unreadable_file(tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"this is not a png")
    with pytest.raises(ValueError, match=r"cannot read image '.*broken\.png': "):
        load_image(str(broken))
    truncated = tmp_path / "truncated.png"
    Image.new("RGB", (64, 64), (1, 2, 3)).save(tmp_path / "ok.png")
    truncated.write_bytes((tmp_path / "ok.png").read_bytes()[:40])
    with pytest.raises(ValueError, match="cannot read image"):
        load_image(truncated)


# --- geometry --------------------------------------------------------------------------------------------


def test_prepare_image_pixels_cover_and_centre_crop():
    # 40x20 (WxH) into 16x16: cover scale 0.8 -> 32x16, centre crop keeps resized columns 8..23.
    # Source columns: 0..17 black, 18 = 100, 19.. white. Resized columns 14/15 sample source x 17.625/18.875.
    array = np.zeros((20, 40, 3), dtype=np.uint8)
    array[:, 18] = 100
    array[:, 19:] = 255
    pixels = prepare_image_pixels(Image.fromarray(array), 16, 16)
    assert pixels.shape == (1, 3, 1, 16, 16)
    row = pixels[0, 0, 0, 0]
    assert torch.equal(row[:6], torch.zeros(6)) and torch.equal(row[8:], torch.ones(8))
    # 0.625*100 = 62.5 and 0.125*100 + 0.875*255 = 235.625, both rounded (half up) by the uint8 kernel
    assert (row[6:8] * 255).round().tolist() == [63.0, 236.0]
    # every value is an exact multiple of 1/255 (interpolation happens on uint8)
    assert torch.equal((pixels * 255).round() / 255, pixels)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ((32, 32), (64, 64)),  # tiny: enlarged to at least 4 tokens of 32x32
        ((10, 20), (64, 96)),  # tiny, 1:2 kept
        ((20000, 30000), (3328, 4992)),  # huge: shrunk below 16384 tokens, 2:3 kept
        ((480, 832), (480, 832)),  # in range and aligned: unchanged (30x52 patches -> 390 tokens)
        ((48, 80), (64, 64)),  # 1.5 and 2.5 multiples: Python round, ties to even
        ((50, 70), (64, 64)),
        ((4000, 3000), (4000, 3008)),
    ],
)
def test_smart_resize(size, expected):
    assert smart_resize(*size) == expected


def test_smart_resize_invariants():
    for height in (1, 7, 33, 100, 479, 1080, 4321, 9000):
        for width in (5, 32, 250, 831, 1920, 7777):
            if max(height, width) / min(height, width) > 200:
                continue
            h, w = smart_resize(height, width)
            assert h % 32 == 0 and w % 32 == 0 and h >= 32 and w >= 32
            assert 4 * 32 * 32 <= h * w <= 16384 * 32 * 32
    h, w = smart_resize(8000, 16000)
    assert h * w <= 16384 * 32 * 32 and abs(w / h - 2.0) < 0.05
    assert smart_resize(300, 300, factor=28) == (308, 308)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 500)
    with pytest.raises(ValueError):
        smart_resize(64, 64, min_pixels=10, max_pixels=5)


def test_vision_image_uses_patch_times_merge():
    pixels = torch.rand(1, 3, 1, 100, 150)
    assert vision_image(pixels).size == (160, 96)
    assert vision_image(pixels, patch_size=14).size == (140, 112)
    # truncating cast: 0.999 * 255 = 254.7 -> 254, as the reference
    flat = torch.full((1, 3, 1, 64, 64), 0.999)
    assert vision_image(flat).getpixel((0, 0)) == (254, 254, 254)


def test_vision_patch_size_lookup_order():
    encoder = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(patch_size=14)))
    processor = SimpleNamespace(image_processor=SimpleNamespace(patch_size=16, config=None))
    assert vision_patch_size(encoder, processor) == 14
    assert vision_patch_size(SimpleNamespace(config=SimpleNamespace()), processor) == 16
    nested = SimpleNamespace(
        image_processor=SimpleNamespace(config=SimpleNamespace(patch_size=8), patch_size=16)
    )
    assert vision_patch_size(None, nested) == 8
    assert vision_patch_size(None, None) == 16


def test_vision_patch_size_from_fixture_encoder(fixtures_root, processors):
    from transformers import AutoConfig

    model = fixtures_root / "models" / "tiny-dense"
    config = AutoConfig.from_pretrained(model / "text_encoder", local_files_only=True)
    assert vision_patch_size(SimpleNamespace(config=config), processors(model)) == 16
