"""Step caching: which blocks run, per CFG branch, under every offload mode, and what is refused.

A threshold of 1e9 makes every allowed skip happen, so the pattern is exact: with warm-up 2 and at
most 3 consecutive skips, a 10-step run computes steps 0, 1, 5 and 9 of each branch in full. The
tiny dense DiT has 2 blocks, so `first_block` runs 4*2 + 6*1 = 14 of 20 blocks per branch and
`magcache` (skipping the whole stack) 4*2 = 8.
"""

from __future__ import annotations

import pytest
import torch

from lingbot_core import stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.hooks import inventory as hook_inventory
from lingbot_core.placement.door import configure_offload
from lingbot_core.sampling.step_cache import MIN_STEPS, CalibrationMissing, StepCacheSettings

STEPS = 10
GEOM = dict(height=32, width=32, num_frames=5, steps=STEPS, guidance_scale=3.0, seed=5)
ALWAYS = dict(threshold=1e9, warmup_steps=2, max_skips=3)
COMPUTED_STEPS = 4  # steps 0, 1, 5, 9


def _handle(fixtures_root, variant="dense"):
    return PipelineHandle.open(fixtures_root / "models" / f"tiny-{variant}", device="cpu")


def _run(handle, cond, cache="off", **kw):
    dit = handle.component("transformer")
    calls = []
    hooks = [block.register_forward_pre_hook(lambda *_: calls.append(1)) for block in dit.blocks]
    try:
        out = stages.denoise(handle, cond, **{**GEOM, **kw}, step_cache=cache)
    finally:
        for h in hooks:
            h.remove()
    return out, len(calls)


@pytest.fixture(scope="module")
def dense(fixtures_root):
    handle = _handle(fixtures_root)
    return handle, stages.encode_prompt(handle, "a red boat", "")


def test_first_block_skips_per_branch(dense):
    handle, cond = dense
    off, blocks_off = _run(handle, cond)
    assert blocks_off == 2 * STEPS * 2
    out, blocks = _run(handle, cond, StepCacheSettings("first_block", **ALWAYS))
    assert blocks == 2 * (COMPUTED_STEPS * 2 + (STEPS - COMPUTED_STEPS) * 1)
    assert not torch.equal(out, off) and bool(torch.isfinite(out).all())
    # threshold 0: nothing is ever close enough, so every block runs and the result is exact
    exact, blocks = _run(handle, cond, StepCacheSettings("first_block", threshold=0.0))
    assert blocks == blocks_off and torch.equal(exact, off)
    assert hook_inventory(handle.component("transformer"))["diffusers"] == 0


def test_magcache_calibrates_then_skips(dense, tmp_path):
    handle, cond = dense
    with pytest.raises(CalibrationMissing, match="magcache_calibrate"):
        _run(handle, cond, StepCacheSettings("magcache", calibration_dir=str(tmp_path)))
    off, _ = _run(handle, cond)
    calibrated, blocks = _run(handle, cond, StepCacheSettings("magcache_calibrate", calibration_dir=str(tmp_path)))
    assert torch.equal(calibrated, off) and blocks == 2 * STEPS * 2
    (path,) = tmp_path.glob("*.json")
    out, blocks = _run(handle, cond, StepCacheSettings("magcache", **ALWAYS, calibration_dir=str(tmp_path)))
    assert blocks == 2 * COMPUTED_STEPS * 2
    assert not torch.equal(out, off)
    # another step count has no calibration
    with pytest.raises(CalibrationMissing):
        _run(handle, cond, StepCacheSettings("magcache", calibration_dir=str(tmp_path)), steps=STEPS + 1)
    # a file over the size limit is not read
    path.write_bytes(b" " * (2 << 20))
    with pytest.raises(ValueError, match="limit"):
        _run(handle, cond, StepCacheSettings("magcache", calibration_dir=str(tmp_path)))


def test_magcache_identity_is_computed_once_per_call(dense, tmp_path, monkeypatch):
    """The request check computes MagCache's calibration key and reads its file; the stage uses both as
    given (it used to compute the same key again inside the stage, and read the file a second time)."""
    from lingbot_core.placement import plan
    from lingbot_core.sampling import step_cache

    handle, cond = dense
    _run(handle, cond, StepCacheSettings("magcache_calibrate", calibration_dir=str(tmp_path)))
    computed, read = [], []
    real, real_read = plan.step_cache_identity, step_cache.read_calibration
    monkeypatch.setattr(plan, "step_cache_identity", lambda *a, **kw: computed.append(1) or real(*a, **kw))
    monkeypatch.setattr(step_cache, "read_calibration", lambda *a, **kw: read.append(1) or real_read(*a, **kw))
    _run(handle, cond, StepCacheSettings("magcache", **ALWAYS, calibration_dir=str(tmp_path)))
    assert len(computed) == 1 and len(read) == 1
    _run(handle, cond, StepCacheSettings("first_block", **ALWAYS))  # no calibration: no identity to compute
    assert len(computed) == 1


def test_batched_cfg_and_moe_have_their_own_branch(fixtures_root):
    handle = _handle(fixtures_root, "moe")
    cond = stages.encode_prompt(handle, "a red boat", "")
    depth = len(handle.component("transformer").blocks)
    _, blocks = _run(handle, cond, StepCacheSettings("first_block", **ALWAYS), cfg_batch="on")
    assert blocks == COMPUTED_STEPS * depth + (STEPS - COMPUTED_STEPS) * 1  # one "pair" branch


@pytest.mark.parametrize("sampler,steps", [("dmd_student", 10), ("flow_unipc", MIN_STEPS)])
def test_refused_where_it_cannot_help(dense, sampler, steps):
    handle, cond = dense
    with pytest.raises(ValueError, match="step_cache to off"):
        stages.denoise(handle, cond, **{**GEOM, "steps": steps, "guidance_scale": 1.0}, sampler=sampler,
                       step_cache="first_block")
    with pytest.raises(ValueError, match="step_cache must be one of"):
        stages.denoise(handle, cond, **GEOM, step_cache="teacache")


def test_an_interrupted_run_leaves_no_cache_behind(dense):
    handle, cond = dense
    off, _ = _run(handle, cond)

    def stop(step, total, latents):
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stages.denoise(handle, cond, **GEOM, step_cache=StepCacheSettings("first_block", **ALWAYS), callback=stop)
    assert hook_inventory(handle.component("transformer"))["diffusers"] == 0
    again, _ = _run(handle, cond)
    assert torch.equal(again, off)
    # a new run starts from fresh state: the same pattern as a first run
    _, blocks = _run(handle, cond, StepCacheSettings("first_block", **ALWAYS))
    assert blocks == 2 * (COMPUTED_STEPS * 2 + (STEPS - COMPUTED_STEPS))


def _transfer_counter(monkeypatch, handle, kind):
    """Counts weight transfers of the DiT's blocks under one offload mode."""
    dit = handle.component("transformer")
    block_modules = {id(m) for block in dit.blocks for m in block.modules()}
    count = [0]
    if kind == "group":
        from diffusers.hooks.group_offloading import ModuleGroup

        original = ModuleGroup.onload_

        def onload(group):
            if any(id(m) in block_modules for m in group.modules):
                count[0] += 1
            return original(group)

        monkeypatch.setattr(ModuleGroup, "onload_", onload)
    elif kind == "sequential":
        from accelerate.hooks import AlignDevicesHook

        original = AlignDevicesHook.pre_forward

        def pre_forward(hook, module, *args, **kwargs):
            if id(module) in block_modules:
                count[0] += 1
            return original(hook, module, *args, **kwargs)

        monkeypatch.setattr(AlignDevicesHook, "pre_forward", pre_forward)
    else:
        from lingbot_core.weights.disk import DiskStreaming

        original = DiskStreaming._fetch

        def fetch(streaming, full):
            if full.startswith("blocks."):
                count[0] += 1
            return original(streaming, full)

        monkeypatch.setattr(DiskStreaming, "_fetch", fetch)
    return count


@pytest.mark.parametrize("mode,offload_to", [("group", "ram"), ("sequential", "ram"), ("group", "disk"),
                                             ("sequential", "disk")])
def test_a_skipped_block_is_a_skipped_transfer(fixtures_root, monkeypatch, mode, offload_to):
    handle = _handle(fixtures_root)
    cond = stages.encode_prompt(handle, "a red boat", "")
    options = {"use_stream": False} if mode == "group" else {}
    view = configure_offload(handle, mode, offload_to=offload_to, **options)
    kind = "disk" if offload_to == "disk" else mode
    off_out, _ = _run(view, cond)  # installs the mode
    count = _transfer_counter(monkeypatch, view, kind)
    _, blocks_off = _run(view, cond)
    transfers_off, count[0] = count[0], 0
    _, blocks = _run(view, cond, StepCacheSettings("first_block", **ALWAYS))
    assert transfers_off > 0 and blocks < blocks_off
    assert count[0] * blocks_off == transfers_off * blocks  # transfers in proportion to blocks run


def test_the_nodes_offer_the_core_choices():
    from lingbot_core.sampling.step_cache import STEP_CACHE
    from lingbot_nodes.sampling import STEP_CACHE as NODE_CHOICES
    from lingbot_nodes.sampling import LingBotDenoise, LingBotRefine, cache_settings

    assert NODE_CHOICES == list(STEP_CACHE)
    for node in (LingBotDenoise, LingBotRefine):
        (combo,) = [i for i in node.define_schema().inputs if i.id == "step_cache"]
        assert list(combo.options) == list(STEP_CACHE) and combo.default == "off"
    assert cache_settings("first_block", 0.0, -1, -1).resolved(40) == (0.05, 4, 3)
    assert cache_settings("magcache", 0.1, 2, 5).resolved(40) == (0.1, 2, 5)
    assert cache_settings("magcache", 0.0, -1, -1).resolved(40) == (0.06, 8, 3)


def test_with_a_lora(fixtures_root):
    from lingbot_core import lora as lora_ops

    handle = _handle(fixtures_root, "moe")
    lora = lora_ops.load_lora_file(fixtures_root.parent / "lingbot-lora" / "cases" / "lora-lightx2v-mixed-moe"
                                   / "lora.safetensors")
    view = lora_ops.with_lora(handle, lora, 1.0)
    cond = stages.encode_prompt(handle, "a red boat", "")
    depth = len(handle.component("transformer").blocks)
    plain, _ = _run(handle, cond, StepCacheSettings("first_block", **ALWAYS))
    cached, blocks = _run(view, cond, StepCacheSettings("first_block", **ALWAYS))
    assert blocks == 2 * (COMPUTED_STEPS * depth + (STEPS - COMPUTED_STEPS))
    assert not torch.equal(cached, plain)  # the LoRA is applied under caching
    off, _ = _run(view, cond)
    exact, _ = _run(view, cond, StepCacheSettings("first_block", threshold=0.0))
    assert torch.equal(exact, off)


# -- quantized weights, batched CFG and offload together ------------------------------------------------

@pytest.fixture(scope="module")
def quantized_moe(tmp_path_factory, fixtures_root):
    """The tiny MoE checkpoint as fp8 and as GGUF Q4_0 (packed experts), quantized once."""
    from lingbot_core.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("cache-quantized")
    return {t: quantize_checkpoint(fixtures_root / "models" / "tiny-moe", root / t, t) for t in ("fp8", "gguf-q4_0")}


@pytest.mark.parametrize("target", ["fp8", "gguf-q4_0"])
def test_cache_and_batched_cfg_with_quantized_weights(quantized_moe, target):
    handle = PipelineHandle.open(quantized_moe[target], device="cpu")
    cond = stages.encode_prompt(handle, "a red boat", "")
    dit = handle.component("transformer")
    assert type(dit.blocks[0].ffn.experts).__name__ == "QuantizedExperts"  # packed, decoded per call
    two, blocks_two = _run(handle, cond)
    batched, blocks_batched = _run(handle, cond, cfg_batch="on")
    assert blocks_batched * 2 == blocks_two
    torch.testing.assert_close(batched, two, rtol=1e-4, atol=1e-4)
    depth = len(dit.blocks)
    cached, blocks = _run(handle, cond, StepCacheSettings("first_block", **ALWAYS), cfg_batch="on")
    assert blocks == COMPUTED_STEPS * depth + (STEPS - COMPUTED_STEPS) * 1
    assert bool(torch.isfinite(cached).all()) and not torch.equal(cached, batched)


@pytest.mark.parametrize("mode,offload_to", [("group", "ram"), ("sequential", "ram"), ("group", "disk")])
def test_batched_cfg_halves_transfers_and_a_cache_skips_them_with_fp8(quantized_moe, monkeypatch, mode, offload_to):
    """Under offload, batched CFG moves each block once per step (not once per branch), and a skipped
    block is a skipped transfer on top, with packed fp8 weights."""
    handle = PipelineHandle.open(quantized_moe["fp8"], device="cpu")
    cond = stages.encode_prompt(handle, "a red boat", "")
    view = configure_offload(handle, mode, offload_to=offload_to, **({"use_stream": False} if mode == "group" else {}))
    count = _transfer_counter(monkeypatch, view, "disk" if offload_to == "disk" else mode)
    two, _ = _run(view, cond)
    transfers_two, count[0] = count[0], 0
    batched, blocks_batched = _run(view, cond, cfg_batch="on")
    transfers_batched, count[0] = count[0], 0
    _, blocks = _run(view, cond, StepCacheSettings("first_block", **ALWAYS), cfg_batch="on")
    assert transfers_two > 0 and transfers_batched * 2 == transfers_two
    assert blocks < blocks_batched and count[0] * blocks_batched == transfers_batched * blocks
    torch.testing.assert_close(batched, two, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["magcache", "magcache_calibrate"])
def test_a_calibrated_cache_is_built_from_the_request_checks_key(method, tmp_path):
    """The file a calibrated method reads or writes is the one the request check keyed: without that key
    the cache refuses (it once fell back to a file named by an empty identity)."""
    from lingbot_core.sampling.step_cache import StepCache, keyed

    settings = StepCacheSettings(method, calibration_dir=str(tmp_path))
    with pytest.raises(ValueError, match="request check"):
        StepCache(settings, steps=20)
    if method == "magcache_calibrate":
        key = keyed(settings, {"model": "tiny"})
        assert StepCache(settings, steps=20, key=key).calibration_path == key.path
