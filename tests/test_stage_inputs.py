"""Bad input to the stages: a clear ValueError before any model work."""

from __future__ import annotations

import pytest
import torch

from lingbot_core import stages
from lingbot_core.handle import PipelineHandle


@pytest.fixture
def handle(fixtures_root):
    return PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")


@pytest.fixture
def moe_handle(fixtures_root):
    return PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")


GOOD = dict(height=32, width=32, num_frames=5, steps=2)


@pytest.mark.parametrize(
    "overrides,pattern",
    [
        (dict(height=40), r"multiples of 16, got 40x32 \(nearest valid: 48x32\)"),
        (dict(width=30), r"multiples of 16"),
        (dict(num_frames=6), r"num_frames must be 1 or 4n\+1 .* got 6; try 5 or 9"),
        (dict(num_frames=0), r"num_frames must be a positive integer"),
        (dict(steps=0), r"steps must be an integer in \[1, "),
        (dict(guidance_scale=float("nan")), r"guidance_scale must be a finite number"),
        (dict(mode="ti2v"), r"TI2V needs a first-frame image"),
        (dict(mode="t2i", num_frames=1, refine_output=True), r"cannot refine T2I"),
        (dict(mode="t2i"), r"T2I makes one frame"),
        (dict(mode="i2v"), r"mode must be one of"),
        (dict(output="png"), r"output must be 'frames' or 'latent'"),
        (dict(refine_output=True), r"needs the MoE checkpoint"),
    ],
)
def test_generate_rejects_bad_requests_before_loading(handle, overrides, pattern):
    kwargs = {**GOOD, **overrides}
    with pytest.raises(ValueError, match=pattern):
        stages.generate(handle, "a boat", **kwargs)
    assert not handle.shared.loaded, "a component was loaded before the input was rejected"


def test_broken_json_prompt_names_the_character(handle):
    with pytest.raises(ValueError, match=r"not valid JSON at line 1 column \d+ .*'x'"):
        stages.generate(handle, '{"caption": {"scene": x}}', **GOOD)
    assert not handle.shared.loaded


def test_unreadable_image(handle, tmp_path):
    bad = tmp_path / "frame.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"cannot read image '.*frame.png'"):
        stages.generate(handle, "a boat", mode="ti2v", image=bad, **GOOD)
    with pytest.raises(ValueError, match=r"cannot read image '.*missing.png'"):
        stages.generate(handle, "a boat", mode="ti2v", image=tmp_path / "missing.png", **GOOD)
    assert not handle.shared.loaded


def test_image_given_outside_ti2v(handle, fixtures_root):
    with pytest.raises(ValueError, match=r"use mode='ti2v'"):
        stages.generate(handle, "a boat", image=fixtures_root / "cases" / "ti2v-dense" / "input.png", **GOOD)


def test_denoise_checks(handle):
    cond = stages.encode_prompt(handle, "a boat", None)
    with pytest.raises(ValueError, match="needs a negative prompt"):
        stages.denoise(handle, cond, height=32, width=32, num_frames=5, steps=1, guidance_scale=3.0, seed=0)
    with pytest.raises(ValueError, match=r"latents must have shape \(1, 16, 2, 4, 4\)"):
        stages.denoise(handle, cond, height=32, width=32, num_frames=5, steps=1, guidance_scale=1.0, seed=0,
                       latents=torch.zeros(1, 16, 1, 4, 4))
    with pytest.raises(ValueError, match="give a seed"):
        stages.denoise(handle, cond, height=32, width=32, num_frames=5, steps=1, guidance_scale=1.0)
    image_cond = stages.encode_image(handle, torch.rand(1, 48, 48, 3), 48, 48)
    with pytest.raises(ValueError, match=r"prepared for 48x48 but the video is 32x32"):
        stages.denoise(handle, cond, height=32, width=32, num_frames=5, steps=1, guidance_scale=1.0, seed=0,
                       image_cond=image_cond)


def test_refine_checks(handle, moe_handle):
    cond = stages.encode_prompt(moe_handle, "a boat", None)
    frames = torch.rand(5, 32, 32, 3)
    with pytest.raises(ValueError, match="refiner/ folder"):
        stages.refine(handle, frames, cond, height=64, width=64)
    with pytest.raises(ValueError, match="single frame"):
        stages.refine(moe_handle, frames[:1], cond, height=64, width=64)
    with pytest.raises(ValueError, match=r"t_thresh must lie in \(0, 1\]"):
        stages.refine(moe_handle, frames, cond, height=64, width=64, t_thresh=1.5)
    with pytest.raises(ValueError, match="multiples of 16"):
        stages.refine(moe_handle, frames, cond, height=60, width=64)
    image_cond = stages.encode_image(moe_handle, torch.rand(1, 32, 32, 3), 32, 32)
    with pytest.raises(ValueError, match="text only"):
        stages.refine(moe_handle, frames, stages.encode_prompt(moe_handle, "a boat", None, image=image_cond, mode="ti2v"),
                      height=64, width=64)
    assert "refiner" not in moe_handle.shared.loaded


def test_vae_tiling_is_restored_after_a_stage(handle):
    vae = handle.component("vae")
    before = (vae.use_tiling, vae.tile_sample_min_height)
    latents = torch.randn(1, 16, 2, 4, 4)
    stages.decode(handle, latents, tiling=dict(tile_sample_min_height=16, tile_sample_min_width=16,
                                               tile_sample_stride_height=16, tile_sample_stride_width=16))
    assert (vae.use_tiling, vae.tile_sample_min_height) == before
    with pytest.raises(ValueError, match="stride 32 exceeds tile size 16"):
        stages.decode(handle, latents, tiling=dict(tile_sample_min_height=16, tile_sample_stride_height=32))
    assert (vae.use_tiling, vae.tile_sample_min_height) == before


def test_a_size_over_the_device_names_the_largest_that_fits(handle, monkeypatch):
    """`plan.request_fit` finds the largest size at the request's aspect whose estimate fits the device,
    and the refusal names it; one step (16 px) taller does not fit."""
    from lingbot_core import stage_inputs
    from lingbot_core.placement import plan

    request = dict(height=256, width=384, num_frames=5)
    capacity = plan.request_fit(plan.facts(handle), **request).needed - 1
    monkeypatch.setattr(plan, "device_capacity", lambda _device: capacity)
    fit = plan.request_fit(plan.facts(handle), **request)
    assert fit.needed > fit.capacity == capacity and fit.largest is not None
    h, w = fit.largest
    assert plan.request_fit(plan.facts(handle), height=h, width=w, num_frames=5).needed <= capacity
    taller = h + 16
    assert plan.request_fit(plan.facts(handle), height=taller, width=max(16, round(taller * 1.5 / 16) * 16), num_frames=5).needed > capacity
    with pytest.raises(ValueError, match=f"about {w}x{h} fits"):
        stage_inputs.check_request_fits(handle, **request, what="denoising")


def test_a_parallel_view_is_not_refused_by_one_process_against_its_own_device(handle, monkeypatch):
    """Each process of a parallel run would set the one-process estimate against its own device (GPUs of two
    sizes, rank 0 holding the encoders too): refused on some ranks only, the others waited in their first
    collective (seen on 2 gloo ranks, rank 0's device faked smaller: rank 1 sat until the collectives'
    timeout). A view of several processes is not refused here; a run too large fails on its OOM on every rank."""
    from lingbot_core import stage_inputs
    from lingbot_core.distributed.layout import ParallelLayout
    from lingbot_core.placement import plan

    request = dict(height=256, width=384, num_frames=5)
    capacity = plan.request_fit(plan.facts(handle), **request).needed - 1
    monkeypatch.setattr(plan, "device_capacity", lambda _device: capacity)
    with pytest.raises(ValueError, match="that is the limit"):
        stage_inputs.check_request_fits(handle, **request, what="denoising")
    view = handle.with_parallel(ParallelLayout(cfg=1, ulysses=2, mesh=object()))
    stage_inputs.check_request_fits(view, **request, what="denoising")
    stage_inputs.check_request_fits(view, **request, phase="decode", what="decoding")
