"""Speed options chosen from the memory estimate: the FFN/MoE chunk a budget needs (`ffn_chunk`
"auto"), batched CFG when it fits (`cfg_batch` "auto"), and the headless API passing both through."""

from __future__ import annotations

import pytest
import torch

from lingbot_core import stage_inputs, stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.placement import estimate, plan
from lingbot_core.placement.door import memory_report
from lingbot_core.placement.estimate import RESERVE_BYTES, Geometry, estimate_peak

# the published MoE 30B-A3B in bf16: two 60 GB DiTs of 48 blocks
MOE_SIZES = estimate.ModelSizes(text_encoder=int(8.9e9), transformer=int(60.2e9), vae=int(0.51e9),
                                refiner=int(60.2e9), hidden=2048, depth=48, intermediate=768 * 8,
                                experts_per_token=8, largest_block=int(60.2e9 / 48),
                                text_largest_layer=int(8.9e9 / 40))
GEOM = dict(height=32, width=32, num_frames=5, steps=3, guidance_scale=3.0, seed=5)
CHUNKS = (512, 64, 16)  # the tiny sequence is ~100 tokens: chunks the estimate can pick and the run feels


def _budget_for(handle, chunk: int, *, cfg_batch: bool = False) -> int:
    """A fake device whose memory fits the denoise call with `chunk`-token FFN passes, not unchunked."""
    sizes = plan.model_sizes(handle.shared)
    g = Geometry(GEOM["height"], GEOM["width"], GEOM["num_frames"], cfg_batch=cfg_batch, ffn_chunk=chunk)
    return estimate_peak("none", sizes, g, phases=("denoise",)) + RESERVE_BYTES


def _ffn_tokens(dit) -> tuple[list[int], list]:
    seen: list[int] = []
    hooks = [b.ffn.register_forward_pre_hook(lambda _m, args: seen.append(int(args[0].shape[1])))
             for b in dit.blocks]
    return seen, hooks


def test_auto_chunk_follows_a_small_budget_and_keeps_the_frames(fixtures_root, monkeypatch):
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")
    cond = stages.encode_prompt(handle, "a red boat", "")
    dit = handle.component("transformer")
    whole = stages.denoise(handle, cond, **GEOM)
    assert handle.shared.placement.ffn_chunks["transformer"][0] is None  # the machine's RAM: no chunks

    monkeypatch.setattr(estimate, "FFN_CHUNKS", CHUNKS)
    monkeypatch.setattr(plan, "device_capacity", lambda _d: _budget_for(handle, 64))
    seen, hooks = _ffn_tokens(dit)
    try:
        chunked = stages.denoise(handle, cond, **GEOM)
    finally:
        for h in hooks:
            h.remove()
    chunk, why = handle.shared.placement.ffn_chunks["transformer"]
    assert chunk == 64 and why.startswith("auto")  # 512 does not fit the fake budget, 64 does
    forwards = 2 * GEOM["steps"] * len(dit.blocks)  # CFG: two forwards per step
    assert max(seen) <= 64 and len(seen) > forwards  # every FFN pass held one chunk, and chunks were cut
    assert all(b.ffn_chunk is None for b in dit.blocks)  # the model's own setting is back
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    report = memory_report(handle)
    assert "transformer FFN/MoE: 64-token chunks (auto" in str(report)

    # an explicit chunk wins over auto, on the model or on the handle
    dit.set_ffn_chunk(16)
    try:
        stages.denoise(handle, cond, **GEOM)
        assert handle.shared.placement.ffn_chunks["transformer"] == (16, "set on the model")
    finally:
        dit.set_ffn_chunk(None)
    handle.shared.ffn_chunk = None
    stages.denoise(handle, cond, **GEOM)
    assert handle.shared.placement.ffn_chunks["transformer"] == (None, "chunking off")


def test_auto_offload_counts_the_chunk_it_will_use():
    """With `ffn_chunk` auto, the fit check (and so `auto`'s choice) counts the chunk a budget needs."""
    from lingbot_core.placement import fit

    plan = Geometry(480, 832, 121, refine=(1088, 1920), vae_tiling=True, release_base=True)
    budget = 24 * estimate.GiB
    unchunked = fit.check(MOE_SIZES, plan, "group", "disk", vram_free=budget, host_free=None)
    chunked = fit.check(MOE_SIZES, Geometry(**{**plan.__dict__, "ffn_chunk": "auto"}), "group", "disk",
                        vram_free=budget, host_free=None)
    assert not unchunked.vram_ok and unchunked.ffn_chunk is None
    assert chunked.vram_ok and chunked.ffn_chunk in estimate.FFN_CHUNKS
    assert chunked.vram_needed < unchunked.vram_needed and "token chunks" in chunked.line()


def test_ffn_chunk_setting_is_checked_when_the_handle_opens(fixtures_root):
    with pytest.raises(ValueError, match="ffn_chunk must be"):
        PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu", ffn_chunk=-4)
    assert PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu", ffn_chunk=0).shared.ffn_chunk is None


# -- generate() and the command pass cfg_batch and step_cache; MagCache without calibration refused first --

PROMPT = "a red boat"
RUN = dict(height=32, width=32, num_frames=5, steps=10, guidance_scale=3.0, output="latent")


def _count_forwards(dit):
    calls = {"dit": 0, "blocks": 0}
    hooks = [dit.register_forward_pre_hook(lambda *_: calls.__setitem__("dit", calls["dit"] + 1))]
    hooks += [b.register_forward_pre_hook(lambda *_: calls.__setitem__("blocks", calls["blocks"] + 1))
              for b in dit.blocks]
    return calls, hooks


def test_generate_passes_cfg_batch_and_step_cache_through(fixtures_root, tmp_path):
    from lingbot_core.sampling.step_cache import StepCacheSettings

    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    dit = handle.component("transformer")
    calls, hooks = _count_forwards(dit)
    try:
        cache = StepCacheSettings("magcache_calibrate", calibration_dir=str(tmp_path))
        stages.generate(handle, PROMPT, cfg_batch="on", step_cache=cache, **RUN)
    finally:
        for h in hooks:
            h.remove()
    assert calls["dit"] == RUN["steps"]  # batched CFG: one forward per step, not two
    assert calls["blocks"] == RUN["steps"] * len(dit.blocks)
    assert len(list(tmp_path.glob("*.json"))) == 1  # the calibration was written...
    # ...under the key the request check looks for, so magcache now passes the early check
    stage_inputs.check_step_cache_ready(handle, StepCacheSettings("magcache", calibration_dir=str(tmp_path)),
                                        transformer="transformer", sampler=None, steps=RUN["steps"], shift=3.0,
                                        sigmas=None, guidance_scale=RUN["guidance_scale"])


@pytest.mark.parametrize("kw, match", [
    (dict(step_cache="magcache"), "magcache_calibrate"),
    (dict(step_cache="first_block", steps=8), "more than 8 steps"),
    (dict(step_cache="first_block", sampler="dmd_student", guidance_scale=1.0, steps=10), "dmd_student"),
    (dict(cfg_batch="sometimes"), "cfg_batch must be"),
])
def test_generate_refuses_a_cache_it_cannot_run_before_any_model_loads(fixtures_root, tmp_path, monkeypatch, kw, match):
    monkeypatch.setenv("LINGBOT_CACHE_DIR", str(tmp_path))  # an empty calibration folder
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    with pytest.raises(ValueError, match=match):
        stages.generate(handle, PROMPT, **{**RUN, **kw})
    assert not handle.shared.loaded  # not even the text encoder (nor the DiT, for the calibration's key)


def test_the_core_command_takes_the_speed_options(fixtures_root, tmp_path, monkeypatch, capsys):
    from lingbot_core.__main__ import main

    monkeypatch.setenv("LINGBOT_CACHE_DIR", str(tmp_path / "cache"))
    seen = {}

    def fake_generate(handle, prompt, **kw):
        seen.update(kw, ffn_chunk=handle.shared.ffn_chunk)
        raise KeyboardInterrupt

    monkeypatch.setattr(stages, "generate", fake_generate)
    base = ["--model", str(fixtures_root / "models" / "tiny-dense"), "--output", str(tmp_path), "-q", "--steps", "10"]
    assert main(base + ["--cfg-batch", "auto", "--step-cache", "first_block", "--cache-threshold", "0.1",
                        "--ffn-chunk", "256"]) == 130
    assert seen["cfg_batch"] == "auto" and seen["ffn_chunk"] == 256
    assert seen["step_cache"].method == "first_block" and seen["step_cache"].threshold == 0.1
    assert main(base + ["--step-cache", "sometimes"]) == 2
    assert "step_cache must be one of" in capsys.readouterr().err


def test_the_core_command_takes_the_decoder(fixtures_root, tmp_path, monkeypatch, capsys):
    """`--decoder`: the choices of weights.decode.DECODERS (default auto), handed to the handle;
    anything else refused by the parser."""
    from lingbot_core.__main__ import build_parser, main
    from lingbot_core.weights.decode import DECODERS

    action = next(a for a in build_parser()._actions if a.dest == "decoder")
    assert tuple(action.choices) == DECODERS and build_parser().parse_args([]).decoder == "auto"
    assert build_parser().parse_args(["--decoder", "eager"]).decoder == "eager"
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["--decoder", "fastest"])
    assert refused.value.code == 2 and "invalid choice: 'fastest'" in capsys.readouterr().err
    monkeypatch.setenv("LINGBOT_CACHE_DIR", str(tmp_path / "cache"))
    seen = {}

    def fake_generate(handle, prompt, **kw):
        seen["decoder"] = handle.shared.decoder
        raise KeyboardInterrupt

    monkeypatch.setattr(stages, "generate", fake_generate)
    assert main(["--model", str(fixtures_root / "models" / "tiny-dense"), "--output", str(tmp_path), "-q",
                 "--decoder", "eager"]) == 130
    assert seen == {"decoder": "eager"}
