"""Video-to-video and extension composed with the other run options, on the tiny dense model: every
offload mode, a LoRA view, quantized weights, the step cache and compiled blocks."""

from __future__ import annotations

import pytest
import torch

from lingbot_core import extend as ext
from lingbot_core import lora as lora_ops
from lingbot_core import stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.offload import configure_offload
from lingbot_core.placement.modes import MODE_ORDER
from lingbot_core.sampling.step_cache import MIN_STEPS, StepCacheSettings
from lingbot_core.video_to_video import video_to_video

MODES = list(MODE_ORDER)  # every registered offload mode
OPTS = {"group": {"use_stream": False}}
V2V = dict(height=32, width=32, num_frames=5, steps=4, shift=3.0, seed=7, guidance_scale=3.0, strength=0.5)
EXTEND = dict(segments=2, k=1, num_frames=5, steps=2, shift=3.0, guidance_scale=3.0, seed=5)


def _open(root, name: str = "tiny-dense") -> PipelineHandle:
    return PipelineHandle.open(root / "models" / name, device="cpu")


def _clip(frames: int = 5) -> torch.Tensor:
    return ext.to_8bit(torch.rand(frames, 32, 32, 3, generator=torch.Generator().manual_seed(3)))


def _lora() -> lora_ops.LoraFile:
    g = torch.Generator().manual_seed(1)
    return lora_ops.LoraFile.from_state_dict({
        "diffusion_model.blocks.1.attn.to_v.lora_down.weight": torch.randn(2, 32, generator=g) * 0.5,
        "diffusion_model.blocks.1.attn.to_v.lora_up.weight": torch.randn(32, 2, generator=g) * 0.5,
    }, name="compose")


def _both(handle, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """V2V latents and a 2-segment extension's frames on `handle` (a handle or a view)."""
    cond = stages.encode_prompt(handle, "a boat", "")
    v2v = video_to_video(handle, cond, video=_clip().float(), **{**V2V, **options})
    extended = ext.extend_video(handle, _clip(), cond, **{**EXTEND, **options})
    return v2v, extended


@pytest.fixture(scope="module")
def reference(fixtures_root):
    return _both(_open(fixtures_root))


@pytest.fixture(scope="module")
def lora_reference(fixtures_root):
    return _both(lora_ops.with_lora(_open(fixtures_root), _lora(), 1.0))


def test_the_lora_changes_both(reference, lora_reference):
    assert not torch.equal(reference[0], lora_reference[0])
    assert not torch.equal(reference[1], lora_reference[1])


@pytest.mark.parametrize("mode", MODES)
def test_every_offload_mode_equals_none(fixtures_root, reference, lora_reference, mode):
    handle = _open(fixtures_root)
    configure_offload(handle, mode, **OPTS.get(mode, {}))
    v2v, extended = _both(handle)
    assert torch.equal(v2v, reference[0]) and torch.equal(extended, reference[1])
    v2v, extended = _both(lora_ops.with_lora(handle, _lora(), 1.0))  # a LoRA view on the offloaded handle
    assert torch.equal(v2v, lora_reference[0]) and torch.equal(extended, lora_reference[1])


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, fixtures_root):
    from lingbot_core.quantize import quantize_checkpoint

    return quantize_checkpoint(fixtures_root / "models" / "tiny-dense", tmp_path_factory.mktemp("compose") / "fp8",
                               "fp8")


@pytest.mark.parametrize("mode", ["none", MODES[-1]])
def test_quantized_weights_under_offload(quantized, reference, mode):
    plain = _both(PipelineHandle.open(quantized, device="cpu"))
    assert not torch.equal(plain[0], reference[0])  # the fp8 weights are what ran
    handle = PipelineHandle.open(quantized, device="cpu")
    configure_offload(handle, mode, **OPTS.get(mode, {}))
    got = _both(handle)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


def test_step_cache(fixtures_root):
    """At enough steps the cache runs under both (a zero threshold skips nothing: the uncached result);
    too few steps are refused with the cache's one line."""
    handle = _open(fixtures_root)
    many = dict(steps=2 * (MIN_STEPS + 1))  # V2V at strength 0.5 runs half of them
    off = _both(handle, **many)
    exact = _both(handle, **many, step_cache=StepCacheSettings("first_block", threshold=0.0))
    assert torch.equal(exact[0], off[0]) and torch.equal(exact[1], off[1])
    skipping = _both(handle, **many, step_cache=StepCacheSettings("first_block", threshold=1e9, warmup_steps=2,
                                                                   max_skips=3))
    assert not torch.equal(skipping[0], off[0]) and not torch.equal(skipping[1], off[1])
    with pytest.raises(ValueError, match="step_cache to off"):
        _both(handle, step_cache="first_block")


def test_compiled_blocks_match_eager(fixtures_root, reference):
    """compile="blocks" (dynamo with the eager backend here) runs both through the compiled blocks."""
    from lingbot_core.models import compile as regional
    from lingbot_core.models.compile import compile_problem
    from lingbot_core.models.transformer import JointBlock

    if compile_problem("cpu") is not None:
        pytest.skip(compile_problem("cpu"))
    calls = [0]
    inner = torch.compile(JointBlock.compute, backend="eager", dynamic=True)

    def counted(*args):
        calls[0] += 1
        return inner(*args)

    torch._dynamo.reset()
    regional._COMPILED.clear()
    regional._COMPILED[("inductor", True)] = counted
    try:
        got = _both(PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu", compile="blocks"))
    finally:
        regional._COMPILED.clear()
    assert calls[0] > 0
    assert torch.allclose(got[0], reference[0], atol=1e-5)
    assert (got[1].float() - reference[1].float()).abs().max() <= 1 / 255 + 1e-6  # 8-bit frames
