"""Batched CFG: both branches as one batch-2 forward, within float rounding of two forwards.

Tolerance (float32 on CPU): the batched denoise result is within 1e-5 relative L2 and 1e-4 max
|diff| of the two-forward result; the difference is only the reduction order of the batched
matmuls and the masked softmax over the padded prompt. Under every offload mode the batched run
equals the batched run without offload exactly.
"""

from __future__ import annotations

import pytest
import torch

from lingbot_core import stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.placement import estimate, plan
from lingbot_core.placement.door import configure_offload
from lingbot_core.placement.modes import MODE_CLASSES
from lingbot_core.sampling.guidance import CFG_BATCH, pad_pair

GEOM = dict(height=32, width=32, num_frames=5, steps=3, guidance_scale=3.0, seed=11)
MODE_OPTIONS = {"group": {"use_stream": False}}


def _handle(fixtures_root, variant, mode="none"):
    handle = PipelineHandle.open(fixtures_root / "models" / f"tiny-{variant}", device="cpu")
    return configure_offload(handle, mode, **MODE_OPTIONS.get(mode, {})) if mode != "none" else handle


class ForwardCounter:
    def __init__(self, module):
        self.batches = []
        self._hook = module.register_forward_pre_hook(lambda _m, args: self.batches.append(args[0].shape[0]))

    def close(self):
        self._hook.remove()


def _denoise(handle, cond, **kw):
    counter = ForwardCounter(handle.component("transformer"))
    try:
        return stages.denoise(handle, cond, **GEOM, **kw), counter.batches
    finally:
        counter.close()


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_batched_cfg_matches_two_forwards(fixtures_root, variant):
    handle = _handle(fixtures_root, variant)
    cond = stages.encode_prompt(handle, "a red boat on a lake", "")
    assert cond.positive.length != cond.negative.length  # the padded path is what runs
    two, calls_two = _denoise(handle, cond, cfg_batch="off")
    one, calls_one = _denoise(handle, cond, cfg_batch="on")
    assert calls_two == [1] * (2 * GEOM["steps"]) and calls_one == [2] * GEOM["steps"]
    rel = float((one - two).norm() / two.norm())
    assert rel < 1e-5 and float((one - two).abs().max()) < 1e-4, rel
    assert not torch.equal(one, torch.zeros_like(one))


@pytest.mark.parametrize("mode", [m for m in MODE_CLASSES if m != "none"])
def test_batched_cfg_under_every_offload_mode(fixtures_root, mode):
    reference = _handle(fixtures_root, "dense")
    cond = stages.encode_prompt(reference, "a red boat on a lake", "")
    expected, _ = _denoise(reference, cond, cfg_batch="on")
    handle = _handle(fixtures_root, "dense", mode)
    got, calls = _denoise(handle, cond, cfg_batch="on")
    assert calls == [2] * GEOM["steps"]
    assert torch.equal(got, expected)


def test_auto_runs_two_forwards_on_a_cpu_with_plain_weights(fixtures_root):
    """Measured 1.14-1.16x slower batched at real width on a CPU (dense bf16), so auto does not batch."""
    handle = _handle(fixtures_root, "dense")
    cond = stages.encode_prompt(handle, "a red boat", "")
    _, calls = _denoise(handle, cond, cfg_batch="auto")
    assert calls == [1] * (2 * GEOM["steps"])


def test_auto_batches_quantized_weights_on_a_cpu_only_when_the_estimate_fits(fixtures_root, monkeypatch):
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu", weights="fp8_e4m3")
    cond = stages.encode_prompt(handle, "a red boat", "")
    counter = ForwardCounter(handle.component("transformer"))
    try:
        stages.denoise(handle, cond, **GEOM, cfg_batch="auto")
        assert counter.batches == [2] * GEOM["steps"]  # a tiny model fits any host
        counter.batches.clear()
        monkeypatch.setattr(estimate, "RESERVE_BYTES", plan.device_capacity(torch.device("cpu")))
        stages.denoise(handle, cond, **GEOM, cfg_batch="auto")  # nothing batched fits now
        assert counter.batches == [1] * (2 * GEOM["steps"])
    finally:
        counter.close()


def test_auto_batches_a_dit_streamed_from_disk_on_a_cpu(fixtures_root):
    handle = configure_offload(_handle(fixtures_root, "dense"), "group", offload_to="disk", use_stream=False)
    cond = stages.encode_prompt(handle, "a red boat", "")
    _, calls = _denoise(handle, cond, cfg_batch="auto")
    assert calls == [2] * GEOM["steps"]


def test_auto_batches_on_a_gpu_where_it_fits(monkeypatch):
    """The GPU branch through facts whose device is `cuda:0` (plain weights, nothing installed)."""
    fits = []
    monkeypatch.setattr(plan, "cfg_batch_fits", lambda *_a, **_k: fits[-1])
    facts = plan.Facts(device=torch.device("cuda:0"), sizes=None, capacity=None, chunk_setting=None)
    geometry = dict(height=480, width=832, num_frames=121)
    fits.append(True)
    batch, why = plan.cfg_batch_auto(facts, "none", "transformer", packed=False, **geometry)
    assert batch and "cuda" in why
    fits.append(False)
    assert plan.cfg_batch_auto(facts, "none", "transformer", packed=False, **geometry)[0] is False
    fits.append(True)
    cpu = plan.Facts(device=torch.device("cpu"), sizes=None, capacity=None, chunk_setting=None)
    assert plan.cfg_batch_auto(cpu, "none", "transformer", packed=False, **geometry)[0] is False


def test_the_auto_rule_names_a_gain_for_each_measured_case():
    assert estimate.cfg_batch_gain("cpu", packed=False, streamed=False) is None
    for device, packed, streamed in (("cuda", False, False), ("mps", False, False), ("cpu", True, False),
                                     ("cpu", False, True)):
        assert estimate.cfg_batch_gain(device, packed=packed, streamed=streamed), (device, packed, streamed)


def test_no_cfg_has_nothing_to_batch(fixtures_root):
    handle = _handle(fixtures_root, "dense")
    cond = stages.encode_prompt(handle, "a red boat", None)
    counter = ForwardCounter(handle.component("transformer"))
    try:
        stages.denoise(handle, cond, **{**GEOM, "guidance_scale": 1.0}, cfg_batch="on")
    finally:
        counter.close()
    assert counter.batches == [1] * GEOM["steps"]


def test_bad_cfg_batch_is_refused_before_work(fixtures_root):
    handle = _handle(fixtures_root, "dense")
    cond = stages.encode_prompt(handle, "a red boat", "")
    with pytest.raises(ValueError, match="cfg_batch must be one of " + ", ".join(CFG_BATCH)):
        stages.denoise(handle, cond, **GEOM, cfg_batch="yes")


def test_pad_pair_pads_right_and_masks():
    class P:
        def __init__(self, n):
            self.embeds = torch.randn(1, n, 4)
            self.mask = torch.ones(1, n, dtype=torch.int64)

    a, b = P(3), P(5)
    embeds, mask = pad_pair(a, b)
    assert embeds.shape == (2, 5, 4) and mask.tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert torch.equal(embeds[0, :3], a.embeds[0]) and torch.equal(embeds[0, 3:], torch.zeros(2, 4))
    assert torch.equal(embeds[1], b.embeds[0])


def test_the_nodes_offer_the_core_choices():
    from lingbot_nodes.sampling import CFG_BATCH as NODE_CHOICES
    from lingbot_nodes.sampling import LingBotDenoise, LingBotRefine

    assert NODE_CHOICES == list(CFG_BATCH)
    for node in (LingBotDenoise, LingBotRefine):
        (combo,) = [i for i in node.define_schema().inputs if i.id == "cfg_batch"]
        assert list(combo.options) == list(CFG_BATCH) and combo.default == "off"
