"""Speed levers of the DiT that must not change its math: fp8 table decode, packed experts on the
grouped path, token-chunked FFN/MoE, the fp8 matmul choice, regional compile without graph breaks."""

from __future__ import annotations

import math

import pytest
import torch

from bench._common import random_dit
from lingbot_core.models import moe as moe_module
from lingbot_core.models.transformer import LingBotVideoTransformer3DModel
from lingbot_core.weights.fp8 import dequantize_fp8, quantize_fp8
from lingbot_core.weights.modules import FP8, Packing, QuantizedExperts, pack_fp8

TINY = dict(hidden_size=32, num_attention_heads=2, depth=2, intermediate_size=64, text_dim=32, freq_dim=32,
            axes_dims=(4, 6, 6), axes_lens=(64, 32, 32))
TINY_MOE = dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                n_group=2, topk_group=1, routed_scaling_factor=2.5)


def _inputs(b: int = 1, frames: int = 2, side: int = 8, text: int = 8):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(b, 16, frames, side, side, generator=g), torch.tensor([700.0] * b),
            torch.randn(b, text, 32, generator=g))


def _pack_experts(model: LingBotVideoTransformer3DModel) -> None:
    for block in model.blocks:
        if isinstance(block.ffn, moe_module.SparseMoE):
            experts = block.ffn.experts
            packed = {}
            for name in QuantizedExperts.NAMES:
                weight = getattr(experts, name).data
                data, scale = pack_fp8(weight)
                packed[name] = (Packing(FP8, tuple(weight.shape)), data, scale)
            block.ffn.experts = QuantizedExperts(packed, torch.bfloat16)


# -- fp8 decode ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_table_decode_is_bit_identical_to_the_cast(dtype):
    every_byte = torch.arange(256, dtype=torch.uint8).repeat(3, 1).view(torch.float8_e4m3fn)  # NaNs included
    scale = torch.tensor([1.0, 3.7e-3, 2.5e4])
    got = dequantize_fp8(every_byte, scale, dtype)
    want = (every_byte.float() * scale[:, None]).to(dtype)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan], want[~nan])
    weight = torch.randn(3, 5, 64) * 0.02
    q, s = quantize_fp8(weight)
    assert torch.equal(dequantize_fp8(q, s, dtype), (q.float() * s[..., None]).to(dtype))


# -- MoE paths -----------------------------------------------------------------------------------------

def test_packed_experts_take_the_grouped_path_and_match_the_loop(monkeypatch):
    model = random_dit(TINY_MOE).to(torch.bfloat16)
    _pack_experts(model)
    x, t, text = _inputs()
    calls = []
    real = moe_module.SparseMoE._experts_grouped
    monkeypatch.setattr(moe_module.SparseMoE, "_experts_grouped", lambda self, *a: calls.append(1) or real(self, *a))
    with torch.no_grad():
        grouped = model(x, t, text).sample.float()
        assert calls, "packed bf16 experts should run on torch._grouped_mm"
        for m in model.modules():
            if isinstance(m, moe_module.SparseMoE):
                m.use_grouped_mm = False
        looped = model(x, t, text).sample.float()
    assert (grouped - looped).abs().max() < 2e-2 * looped.abs().max()


@pytest.mark.parametrize("per_expert", [False, True], ids=["stacked", "per-expert"])
@pytest.mark.parametrize("span", [1, 3])
def test_packed_experts_in_spans_match_all_experts_at_once(monkeypatch, span, per_expert):
    """Eager packed experts decode `grouped_span` experts at a time; spans of 1 and 3 of the 4 experts
    (a short last span, spans no token routes to) give what decoding every expert at once gives."""
    model = random_dit(TINY_MOE).to(torch.bfloat16)
    _pack_experts(model)
    experts = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    if per_expert:  # held one tensor per expert, as a per-expert GGUF file stores them
        for m in experts:
            for name in m.NAMES:
                for field in ("qdata", "qscale"):
                    stacked = getattr(m, f"{name}_{field}")
                    delattr(m, f"{name}_{field}")
                    setattr(m, f"{name}_{field}", torch.nn.ParameterList(
                        [torch.nn.Parameter(one, requires_grad=False) for one in stacked]))
    x, t, text = _inputs()
    decoded: list[int] = []
    real_stack = QuantizedExperts.stack
    monkeypatch.setattr(QuantizedExperts, "stack",
                        lambda self, name, dtype=None, experts=None, out=None: decoded.append(
                            self.num_experts if experts is None else experts.stop - experts.start)
                        or real_stack(self, name, dtype, experts, out))
    with torch.no_grad():
        whole = model(x, t, text).sample
        assert decoded and set(decoded) == {4}
        decoded.clear()
        monkeypatch.setattr(QuantizedExperts, "grouped_span", lambda self, device: span)
        spans = model(x, t, text).sample
        for m in experts:
            m.decoder = "compiled"  # the same through the compiled kernels writing into the span scratch
        compiled = model(x, t, text).sample
    assert decoded and max(decoded) <= span and sum(decoded) <= 2 * 3 * len(experts) * 4
    assert torch.equal(spans, whole) and torch.equal(compiled, whole)


def test_grouped_spans_are_a_multiple_of_the_cpu_threads_and_bounded_elsewhere(monkeypatch):
    from lingbot_core.weights import modules

    model = random_dit(TINY_MOE).to(torch.bfloat16)
    _pack_experts(model)
    experts = next(m for m in model.modules() if isinstance(m, QuantizedExperts))
    per_expert = sum(math.prod(experts.packings[n].shape[1:]) for n in experts.NAMES)
    monkeypatch.setitem(modules.GROUPED_SPAN_VALUES, "cpu", 7 * per_expert)
    for threads, want in ((2, 6), (4, 4), (8, 7), (1, 7)):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
        assert experts.grouped_span(torch.device("cpu")) == want
    assert experts.grouped_span(torch.device("meta")) == modules.DEFAULT_GROUPED_SPAN_VALUES // per_expert


def test_packed_experts_with_a_runtime_delta_stay_on_the_loop(monkeypatch):
    model = random_dit(TINY_MOE).to(torch.bfloat16)
    _pack_experts(model)
    for m in model.modules():
        if isinstance(m, QuantizedExperts):
            m.add_delta("w2", lambda e, rows: torch.zeros(rows.shape[0], 32, dtype=rows.dtype))
    monkeypatch.setattr(moe_module.SparseMoE, "_experts_grouped", lambda *a: pytest.fail("delta lost on grouped path"))
    with torch.no_grad():
        model(*_inputs())


def test_grouped_routing_with_a_zero_gate_adds_nothing():
    """A slot whose gate is exactly 0 is computed on the fixed-shape path and weighted by 0."""
    model = random_dit(TINY_MOE).to(torch.bfloat16)
    moe = next(m for m in model.modules() if isinstance(m, moe_module.SparseMoE))
    tokens = torch.randn(6, 32).bfloat16()
    chosen, gates = moe.router(tokens)
    gates[0, 1] = 0
    gates[3, 0] = 0
    with torch.no_grad():
        grouped = moe._mix_grouped(tokens, chosen, gates)
        looped = moe._mix_loop(tokens, chosen, gates)
    assert (grouped - looped).abs().max() <= 1e-2 * looped.abs().max()


# -- token chunks --------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [TINY, TINY_MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_ffn_matches_the_whole_sequence(cfg, dtype):
    model = random_dit(cfg).to(dtype)
    x, t, text = _inputs(b=2)  # 2 x 4 x 4 = 32 video tokens + 8 text per sample
    seen = []
    for block in model.blocks:
        block.ffn.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    with torch.no_grad():
        whole = model(x, t, text).sample
        assert set(seen) == {40}
        seen.clear()
        model.set_ffn_chunk(7)  # does not divide 40: the last chunk is short
        chunked = model(x, t, text).sample
    assert max(seen) == 7 and sum(seen) == 40 * len(model.blocks)
    if dtype == torch.float32:
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    else:
        assert (chunked.float() - whole.float()).abs().max() <= 1e-2 * whole.float().abs().max()
    model.set_ffn_chunk(None)
    assert all(b.ffn_chunk is None for b in model.blocks)
    with pytest.raises(ValueError, match="FFN chunk"):
        model.set_ffn_chunk(-1)


# -- fp8 matmul choice ---------------------------------------------------------------------------------

def test_fp8_matmul_choice_follows_the_device():
    """Which path is *tried*: no capability table beyond "has fp8 tensor cores" for auto; whether the
    kernel runs is its trial's to say (tests/test_kernels.py). Nothing raises for a device or dtype."""
    from lingbot_core.weights.fp8 import FP8_CORES, FP8_MATMULS, choose_fp8_matmul, scaled_mm_problem

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert "auto" in FP8_MATMULS and "decode" in FP8_MATMULS
    assert choose_fp8_matmul("auto", torch.device("cpu"), bf16, 64, 64) == "decode"
    assert choose_fp8_matmul("decode", cuda, bf16, 64, 64, capability=(9, 0)) == "decode"
    if hasattr(torch, "_scaled_mm"):
        for newer in ((9, 0), FP8_CORES, (10, 0), (12, 0)):  # sm89, sm100, sm120: tried, not ruled out
            assert choose_fp8_matmul("auto", cuda, bf16, 64, 64, capability=newer) == "scaled_mm"
        assert choose_fp8_matmul("auto", cuda, bf16, 64, 64, capability=(8, 6)) == "decode"  # no fp8 cores
        assert choose_fp8_matmul("auto", cuda, torch.float32, 64, 64, capability=(9, 0)) == "decode"
        assert choose_fp8_matmul("auto", cuda, bf16, 64, 40, capability=(10, 0)) == "decode"
        assert scaled_mm_problem(cuda, bf16, 64, 64) is None
        assert "multiples of 16" in scaled_mm_problem(cuda, bf16, 64, 40)
        # asked for explicitly: tried on any GPU and dtype (the handle refused it at open if it cannot run)
        assert choose_fp8_matmul("scaled_mm", cuda, bf16, 64, 64, capability=(8, 0)) == "scaled_mm"
        assert choose_fp8_matmul("scaled_mm", cuda, torch.float16, 64, 64, capability=(9, 0)) == "scaled_mm"
        assert choose_fp8_matmul("scaled_mm", cuda, bf16, 64, 40, capability=(9, 0)) == "decode"
    assert choose_fp8_matmul("scaled_mm", torch.device("cpu"), bf16, 64, 64) == "decode"
    with pytest.raises(ValueError, match="unknown fp8 matmul"):
        choose_fp8_matmul("fast", cuda, bf16, 64, 64)


def test_fp8_linear_on_cpu_decodes_whatever_is_asked_short_of_scaled_mm():
    from lingbot_core.weights.modules import QuantizedLinear, set_fp8_matmul

    layer = QuantizedLinear(Packing(FP8, (32, 64)), *pack_fp8(torch.randn(32, 64) * 0.02), None, torch.bfloat16)
    x = torch.randn(3, 64).bfloat16()
    want = torch.nn.functional.linear(x, layer.dequantized_weight(torch.bfloat16))
    assert set_fp8_matmul(torch.nn.Sequential(layer), "auto") == 1
    assert layer.matmul_path(x) == "decode" and torch.equal(layer(x), want)
    with pytest.raises(ValueError, match="unknown fp8 matmul"):
        set_fp8_matmul(layer, "fastest")


def test_the_handle_refuses_an_unknown_decoder_before_anything_loads(tmp_path):
    """Checked first in open(): the folder does not even exist, yet the decoder is what is refused."""
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.weights.decode import DECODERS

    assert "fastest" not in DECODERS
    with pytest.raises(ValueError, match=f"unknown decoder 'fastest'; choose one of {', '.join(DECODERS)}"):
        PipelineHandle.open(tmp_path / "missing", device="cpu", decoder="fastest")


def test_a_handle_sets_its_decoder_on_every_packed_module_of_both_dits(fixtures_root):
    """decoder="eager" (not the modules' default) reaches every QuantizedLinear and QuantizedExperts of
    the base DiT and the refiner as they load (tiny MoE, quantized to fp8 on load)."""
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.weights.decode import DECODERS
    from lingbot_core.weights.modules import QuantizedExperts, QuantizedLinear

    assert "eager" in DECODERS
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu", weights="fp8_e4m3",
                                 decoder="eager")
    assert handle.shared.decoder == "eager" and not handle.shared.loaded
    for name in ("transformer", "refiner"):
        packed = [m for m in handle.component(name).modules() if isinstance(m, (QuantizedLinear, QuantizedExperts))]
        assert any(isinstance(m, QuantizedExperts) for m in packed), name
        assert packed and {m.decoder for m in packed} == {"eager"}, name
    default = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu", weights="fp8_e4m3")
    packed = [m for m in default.component("transformer").modules() if isinstance(m, QuantizedLinear)]
    assert default.shared.decoder == "auto" and packed and {m.decoder for m in packed} == {"auto"}


# -- regional compile ----------------------------------------------------------------------------------

def _block_call(model: LingBotVideoTransformer3DModel, index: int, inputs):
    captured = {}
    hook = model.blocks[index].register_forward_pre_hook(lambda mod, args: captured.setdefault("args", args))
    with torch.no_grad():
        model(*inputs)
    hook.remove()
    return captured["args"]


@pytest.mark.parametrize("cfg,index,dtype", [(TINY, 0, torch.float32), (TINY_MOE, 1, torch.bfloat16),
                                             (TINY_MOE, 1, torch.float32)], ids=["dense", "moe", "moe-fp32"])
def test_a_block_compiles_without_graph_breaks(cfg, index, dtype):
    model = random_dit(cfg).to(dtype)
    block = model.blocks[index]
    assert type(block.ffn).__name__ == ("SparseMoE" if cfg is TINY_MOE else "SwiGLU")
    args = _block_call(model, index, _inputs())
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(block.compute)(*args)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_compiled_blocks_share_one_graph_and_survive_merges_and_new_sizes():
    from lingbot_core.models import compile as regional

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = random_dit(TINY_MOE).to(torch.bfloat16)
    torch._dynamo.reset()
    regional._COMPILED.clear()
    regional._COMPILED[("counting", True)] = torch.compile(type(model.blocks[0]).compute, backend=counting_backend,
                                                           dynamic=True)
    with torch.no_grad():
        eager = model(*_inputs()).sample
        assert regional.compile_blocks(model, backend="counting") == len(model.blocks)
        compiled = model(*_inputs()).sample
        assert len(graphs) == 1  # one graph for every block
        assert (compiled.float() - eager.float()).abs().max() <= 1e-2 * eager.float().abs().max()
        model.blocks[0].attn.to_q.weight.data.add_(0.01)  # what a LoRA merge does
        model(*_inputs())
        model(*_inputs(side=12))  # a new latent size
        assert len(graphs) == 1
        hook = model.blocks[0].attn.to_q.register_forward_pre_hook(lambda *a: None)  # leaf-level offload
        model(*_inputs())
        hook.remove()
        assert len(graphs) == 1
    regional.uncompile_blocks(model)
    assert regional.compiled_blocks(model) == 0
    regional._COMPILED.clear()


def test_group_offload_hooks_stay_outside_the_compiled_blocks():
    from diffusers.hooks import apply_group_offloading

    from lingbot_core.models import compile as regional

    graphs = []
    model = random_dit(TINY_MOE).to(torch.bfloat16)
    with torch.no_grad():
        eager = model(*_inputs()).sample
    cpu = torch.device("cpu")
    apply_group_offloading(model, onload_device=cpu, offload_device=cpu, offload_type="block_level",
                           num_blocks_per_group=1)
    torch._dynamo.reset()
    regional._COMPILED.clear()
    regional._COMPILED[("counting", True)] = torch.compile(
        type(model.blocks[0]).compute, backend=lambda gm, ex: graphs.append(gm) or gm.forward, dynamic=True)
    regional.compile_blocks(model, backend="counting")
    with torch.no_grad():
        compiled = model(*_inputs()).sample
    regional._COMPILED.clear()
    assert len(graphs) == 1 and torch.equal(compiled, eager)


def test_sequential_and_disk_offload_run_compiled_with_their_hooks_outside(fixtures_root):
    """`sequential` (accelerate's hook on every leaf) and disk streaming per layer: every block runs
    through the one compiled graph (never eagerly, no recompile at a new size), exactly as eager,
    and the weights go back where the mode keeps them. The float32 MoE compiles too."""
    from lingbot_core import hooks
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.models import compile as regional
    from lingbot_core.models.transformer import JointBlock
    from lingbot_core.placement.door import configure_offload, stage

    folder = fixtures_root / "models" / "tiny-moe"
    graphs, calls = [], [0]
    torch._dynamo.reset()
    regional._COMPILED.clear()
    inner = torch.compile(JointBlock.compute, backend=lambda gm, ex: graphs.append(gm) or gm.forward, dynamic=True)

    def counted(*args):
        calls[0] += 1
        return inner(*args)

    regional._COMPILED[("inductor", True)] = counted  # what compile="blocks" picks up, without inductor's time

    def inputs(dit, side=8):
        g = torch.Generator().manual_seed(1)
        return (torch.randn(1, dit.config.in_channels, 2, side, side, generator=g), torch.tensor([700.0]),
                torch.randn(1, 8, dit.config.text_dim, generator=g))

    dit = PipelineHandle.open(folder, device="cpu").component("transformer")
    with torch.no_grad():
        eager = dit(*inputs(dit)).sample
    try:
        for mode, to, hook in (("sequential", "ram", hooks.ACCELERATE), ("sequential", "disk", "lingbot.disk_stream")):
            view = configure_offload(PipelineHandle.open(folder, device="cpu", compile="blocks"), mode, offload_to=to)
            with stage(view, "transformer"):
                compiled_dit = view.component("transformer")
                assert any(name == hook for _p, name in hooks.listing(compiled_dit.blocks[0].attn))  # inside the block
                before = calls[0]
                with torch.no_grad():
                    out = compiled_dit(*inputs(compiled_dit)).sample
                    compiled_dit(*inputs(compiled_dit, side=12))
                assert calls[0] - before == 2 * len(compiled_dit.blocks), (mode, to)  # none ran eagerly
                assert torch.equal(out, eager), (mode, to)
                if to == "ram":
                    assert compiled_dit.blocks[0].attn.to_q.weight.device.type == "meta"  # back off the device
        assert len(graphs) == 1  # one graph for both modes, both sizes: no recompile, no break
    finally:
        regional._COMPILED.clear()


def test_rotary_tables_can_be_sized_before_compiling():
    model = random_dit(TINY)
    rope = model.rope
    rope.reserve((40, 20, 30), n_text=16)
    assert [a.capacity for a in rope.axes] == [max(64, 57), 32, 32]
    rope.reserve((2, 50, 3), n_text=4)
    assert rope.axes[1].capacity == 50


def test_compile_setting_is_checked_when_the_handle_opens(fixtures_root):
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.models.compile import compile_problem

    folder = fixtures_root / "models" / "tiny-dense"
    with pytest.raises(ValueError, match="unknown compile setting"):
        PipelineHandle.open(folder, device="cpu", compile="everything")
    if compile_problem("cpu") is None:
        handle = PipelineHandle.open(folder, device="cpu", compile="blocks")
        assert handle.shared.compile == "blocks"


# -- the estimate --------------------------------------------------------------------------------------

def test_estimate_counts_ffn_chunks_and_picks_one_for_a_budget():
    from lingbot_core.placement import estimate

    sizes = estimate.ModelSizes(text_encoder=8 * 2**30, transformer=60 * 2**30, vae=2**28, refiner=60 * 2**30,
                                hidden=2048, depth=48, intermediate=6144, experts_per_token=8,
                                largest_block=2**30, text_largest_layer=2**27)
    whole = estimate.Geometry(height=480, width=832, num_frames=121, refine=(1088, 1920), vae_tiling=True)
    chunked = estimate.Geometry(height=480, width=832, num_frames=121, refine=(1088, 1920), vae_tiling=True,
                                ffn_chunk=16384)
    a, b = estimate.activation_bytes(sizes, whole), estimate.activation_bytes(sizes, chunked)
    assert b["refine"] < a["refine"] and b["text"] == a["text"]
    peak = estimate.estimate_peak("group", sizes, whole)
    assert estimate.ffn_chunk_tokens("group", sizes, whole, peak + estimate.RESERVE_BYTES) is None
    chunk = estimate.ffn_chunk_tokens("group", sizes, whole, 22 * estimate.GiB)
    assert chunk in estimate.FFN_CHUNKS
    from dataclasses import replace

    assert estimate.estimate_peak("group", sizes, replace(whole, ffn_chunk=chunk)) + estimate.RESERVE_BYTES \
        <= 22 * estimate.GiB


# -- the bench -----------------------------------------------------------------------------------------

def test_dit_speed_bench_runs_at_tiny_shapes():
    from bench import speed_dit

    args = speed_dit.parse_args(["--quick", "--kinds", "moe", "--formats", "bf16,fp8"])
    quantized = speed_dit.measure_quantized(args)
    [row] = quantized["rows"]
    assert row["format"] == "fp8" and row["after_ratio"] > 0 and 0 < row["rel_l2"] < 0.2
    assert row["before_ratio"] > 0
    [lean] = speed_dit.measure_quantized(speed_dit.parse_args(["--quick", "--kinds", "dense", "--formats", "fp8",
                                                               "--no-before"]))["rows"]
    assert lean["after_ratio"] > 0 and lean["before_s"] != lean["before_s"]  # NaN: the column was skipped
    [chunked] = speed_dit.measure_chunked(args)["rows"]
    assert chunked["max_abs_diff"] < 1e-2 and chunked["peak_chunked"] < chunked["peak_whole"]
    decode_rows = speed_dit.measure_decode(speed_dit.parse_args(["--quick", "--formats", "fp8,gguf-q4_0"]))["rows"]
    assert {(r["weight"], r["format"]) for r in decode_rows} == {(w, f) for w in ("linear", "experts")
                                                                  for f in ("fp8", "gguf-q4_0")}
    assert all(r["equal"] and r["before_ms"] > 0 and r["after_ms"] > 0 and r["compiled_ms"] > 0 for r in decode_rows)
    from lingbot_core.weights import modules

    spans = speed_dit.measure_spans(speed_dit.parse_args(["--quick", "--formats", "fp8", "--spans", "1,2",
                                                          "--repeats", "1"]))["rows"]
    assert [r["span"] for r in spans] == [1, 2] and all(r["ratio"] > 0 for r in spans)
    assert "cpu" in modules.GROUPED_SPAN_VALUES and modules.GROUPED_SPAN_VALUES["cpu"] > 2  # restored
    [matmul] = speed_dit.measure_fp8_matmul(args)["rows"]
    assert matmul["auto_picks"] == ("scaled_mm" if matmul["scaled_mm"] != "not run" else "decode")
