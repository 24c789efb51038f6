"""DiT properties the parity cases do not pin: real-size configs, dtype rules, backends, MoE paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import lingbot_core
from bench._common import random_dit
from lingbot_core.models import moe as moe_module
from lingbot_core.models.config import DiTConfig
from lingbot_core.models.precision import stays_float32
from lingbot_core.models.transformer import LingBotVideoTransformer3DModel

CONFIGS = Path(lingbot_core.__file__).parent / "configs"

TINY_MOE = dict(hidden_size=32, num_attention_heads=2, depth=2, intermediate_size=64, text_dim=32, freq_dim=32,
                axes_dims=(4, 6, 6), axes_lens=(64, 32, 32), num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5)


def _inputs(b=1, text=8):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(b, 16, 2, 4, 4, generator=g), torch.tensor([700.0] * b),
            torch.randn(b, text, 32, generator=g))


@pytest.mark.parametrize("name,count", [("dense-1.3b", 1_357_171_264), ("moe-30b-a3b", 30_084_506_176)])
def test_published_configs_build_on_meta_with_exact_parameter_count(name, count):
    config = json.loads((CONFIGS / f"{name}.transformer.json").read_text())
    with torch.device("meta"):
        model = LingBotVideoTransformer3DModel.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == count
    assert all(p.device.type == "meta" for p in model.parameters())


def test_half_cast_keeps_reference_fp32_modules():
    model = random_dit(TINY_MOE).to(torch.bfloat16)
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    assert params["blocks.0.ffn.router.e_score_correction_bias"].dtype == torch.float32
    assert params["text_embedder.norm.weight"].dtype == torch.float32
    assert params["blocks.1.attn.norm_q.weight"].dtype == torch.float32
    assert params["blocks.0.scale_shift_table"].dtype == torch.float32
    assert params["blocks.0.attn.to_q.weight"].dtype == torch.bfloat16
    assert params["blocks.0.ffn.experts.w1"].dtype == torch.bfloat16
    for name, p in params.items():
        assert p.dtype == (torch.float32 if stays_float32(name) else torch.bfloat16), name


def test_bf16_model_runs_without_autocast_and_tracks_fp32():
    model = random_dit(TINY_MOE)
    x, t, text = _inputs()
    with torch.no_grad():
        ref = model(x, t, text).sample
        half = model.to(torch.bfloat16)(x, t, text).sample.float()
    assert torch.isfinite(half).all()
    assert (half - ref).abs().max() < 0.05 * ref.abs().max()


def test_the_timestep_path_follows_the_callers_autocast_as_the_references_does():
    """On CUDA the reference runs its bf16 DiT under bf16 autocast and turns it off only for the MoE router's
    logits and the rotary multiply: the timestep path's float32 layers (embedding MLP, both modulation
    projections) keep float32 weights but compute in bf16 there. Ours do the same, for GPU parity (d7781f9 had
    turned autocast off for them; reverted). CPU autocast stands in for CUDA's (the same casting rule)."""
    model = random_dit(TINY_MOE).to(torch.bfloat16)
    seen = {}
    watched = {"time_embedder.linear_2": model.time_embedder.linear_2, "time_modulation": model.time_modulation[1],
               "norm_out_modulation": model.norm_out_modulation[1]}
    for name, layer in watched.items():
        layer.register_forward_hook(lambda _m, _i, out, name=name: seen.__setitem__(name, out.dtype))
    x, t, text = _inputs()
    with torch.no_grad():
        model(x, t, text)
        assert seen == dict.fromkeys(watched, torch.float32)  # no autocast: their own float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, t, text).sample
    assert seen == dict.fromkeys(watched, torch.bfloat16) and torch.isfinite(out).all()
    assert all(model.get_parameter(f"{name}.weight").dtype == torch.float32 for name in
               ("time_embedder.linear_2", "time_modulation.1", "norm_out_modulation.1"))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason=f"torch {torch.__version__} has no _grouped_mm "
                    "(added in 2.8): the loop is the only path")
def test_grouped_mm_path_matches_expert_loop_in_bf16(monkeypatch):
    model = random_dit(TINY_MOE).to(torch.bfloat16)
    x, t, text = _inputs()
    calls = []
    real = moe_module.SparseMoE._experts_grouped
    monkeypatch.setattr(moe_module.SparseMoE, "_experts_grouped",
                        lambda self, *a: calls.append(1) or real(self, *a))
    with torch.no_grad():
        grouped = model(x, t, text).sample.float()
        for m in model.modules():
            if isinstance(m, moe_module.SparseMoE):
                m.use_grouped_mm = False
        looped = model(x, t, text).sample.float()
    assert calls, "bf16 MoE should use torch._grouped_mm"
    assert (grouped - looped).abs().max() < 2e-2 * looped.abs().max()


def test_fp32_model_never_uses_grouped_mm(monkeypatch):
    model = random_dit(TINY_MOE)
    monkeypatch.setattr(moe_module.SparseMoE, "_experts_grouped", lambda *a: pytest.fail("fp32 used grouped_mm"))
    with torch.no_grad():
        model(*_inputs())


def test_time_modulation_is_per_sample_not_per_token():
    model = random_dit(TINY_MOE)
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda mod, args: seen.append(tuple(args[1].shape)))
    with torch.no_grad():
        model(*_inputs(b=2, text=5))
    assert seen == [(2, 1, 6 * 32)]


def test_attention_backend_choice_reaches_dispatch(monkeypatch):
    model = random_dit(TINY_MOE)
    import lingbot_core.models.transformer as tr

    used = []
    real = tr.dispatch_attention_fn
    monkeypatch.setattr(tr, "dispatch_attention_fn", lambda *a, backend=None, **k: used.append(backend) or
                        real(*a, backend=backend, **k))
    model.set_attention_backend("native")
    with torch.no_grad():
        native = model(*_inputs()).sample
    model.set_attention_backend("_native_math")
    with torch.no_grad():
        math = model(*_inputs()).sample
    assert used == ["native"] * 2 + ["_native_math"] * 2
    torch.testing.assert_close(native, math, atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        model.set_attention_backend("no-such-backend")


def test_rope_table_growth_does_not_change_outputs():
    model = random_dit(TINY_MOE)
    x, t, text = _inputs(text=40)  # text positions reach 40 on the frame axis
    with torch.no_grad():
        a = model(x, t, text).sample
        fresh = random_dit({**TINY_MOE, "axes_lens": (2, 2, 2)})  # same seed, same weights, tiny tables
        b = fresh(x, t, text).sample
    assert fresh.rope.axes[0].capacity > 40
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="axes_dims"):
        LingBotVideoTransformer3DModel(hidden_size=32, num_attention_heads=2, axes_dims=(4, 4, 4))


@pytest.mark.parametrize("name", ["dense-1.3b", "moe-30b-a3b"])
def test_config_round_trips_the_published_json(name):
    raw = json.loads((CONFIGS / f"{name}.transformer.json").read_text())
    spec = DiTConfig.from_mapping(raw)
    assert spec.to_mapping() == {k: v for k, v in raw.items() if not k.startswith("_")}
    assert spec.moe.num_experts == raw["num_experts"] and spec.head_dim * raw["num_attention_heads"] == raw["hidden_size"]
    with torch.device("meta"):
        model = LingBotVideoTransformer3DModel.from_config(raw)
    assert model.spec == spec
    assert {k: model.config[k] for k in DiTConfig.keys()} == spec.to_mapping()


def test_model_takes_a_typed_config_or_fields_alike(tmp_path):
    spec = DiTConfig.from_mapping(TINY_MOE)
    by_spec, by_fields = LingBotVideoTransformer3DModel(spec), LingBotVideoTransformer3DModel(**TINY_MOE)
    assert by_spec.spec == by_fields.spec
    assert {k: v.shape for k, v in by_spec.state_dict().items()} == {k: v.shape for k, v in by_fields.state_dict().items()}
    by_spec.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["_class_name"] == "LingBotVideoTransformer3DModel"
    assert DiTConfig.from_mapping(saved) == spec
    with pytest.raises(TypeError, match="not both"):
        LingBotVideoTransformer3DModel(spec, depth=3)


@pytest.mark.parametrize("change,message", [
    ({"hidden_sise": 32}, r"unknown keys \['hidden_sise'\]"),
    ({"depth": "2"}, "depth must be a whole number"),
    ({"qkv_bias": 1}, "qkv_bias must be true or false"),
    ({"patch_size": [1, 2]}, "patch_size needs three numbers"),
    ({"norm_eps": 0}, "norm_eps must be above 0"),
    ({"score_func": "relu"}, "score_func is 'relu'"),
    ({"num_attention_heads": 3}, "not a multiple of num_attention_heads=3"),
    ({"n_group": 3}, "does not split into n_group=3"),
    ({"topk_group": 5}, "topk_group must be between 1 and 2"),
    ({"num_experts_per_tok": 5}, "only num_experts=4"),
])
def test_config_errors_name_the_key(change, message):
    with pytest.raises(ValueError, match=message):
        DiTConfig.from_mapping({**TINY_MOE, **change})


def test_layer_sparsity_follows_step_and_dense_list():
    spec = DiTConfig.from_mapping({**TINY_MOE, "depth": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [spec.moe.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    model = LingBotVideoTransformer3DModel(spec)
    assert [type(b.ffn).__name__ for b in model.blocks] == ["SwiGLU", "SparseMoE", "SwiGLU", "SwiGLU", "SwiGLU", "SparseMoE"]
