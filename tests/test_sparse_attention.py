"""Sparse attention (`attention: sparse`, lingbot_core/models/sparse_attention.py): the eager path pinned
to an independent dense reference at tiny sizes, its safeguards, its trial and fallback, and the
shipped T2V workflow running it on the tiny model."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from compile_fakes import counted_eager_blocks

from lingbot_core import kernels
from lingbot_core.models import sparse_attention as sa
from lingbot_core.models.sparse_attention import BLOCK, SparseSettings, eager_sparse_attention

ALWAYS = SparseSettings(min_tokens=0, dense_first=0.0, dense_blocks=())


def _qkv(tokens: int, heads: int = 2, dim: int = 16, seed: int = 0, batch: int = 1):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, tokens, heads, dim, generator=g) for _ in range(3))


def _naive_routing(q, k, density: float, n_video: int | None):
    """Which key blocks each query block computes exactly, by loops: the top `density` share of key
    blocks by (query block mean) . (key block mean - mean of key block means), the diagonal and its
    neighbours, and every text block (as keys and as queries)."""
    b, s, h, d = q.shape
    n = math.ceil(s / BLOCK)
    exact = torch.zeros(b, h, n, n, dtype=torch.bool)
    for bi in range(b):
        for hi in range(h):
            qm = [q[bi, i * BLOCK:(i + 1) * BLOCK, hi].mean(0) for i in range(n)]
            km = [k[bi, j * BLOCK:(j + 1) * BLOCK, hi].mean(0) for j in range(n)]
            centre = torch.stack(km).mean(0)
            keep = max(1, min(n, round(density * n)))
            for i in range(n):
                scores = torch.tensor([float(qm[i] @ (km[j] - centre)) for j in range(n)])
                for j in scores.argsort(descending=True)[:keep].tolist():
                    exact[bi, hi, i, j] = True
                for j in (i - 1, i, i + 1):
                    if 0 <= j < n:
                        exact[bi, hi, i, j] = True
            if n_video is not None and n_video < s:
                exact[bi, hi, n_video // BLOCK:, :] = True
                exact[bi, hi, :, n_video // BLOCK:] = True
    return exact


def _reference(q, k, v, exact):
    """Dense attention over the exact blocks' tokens plus one pooled column per other key block (its
    mean key's score against the query block's mean query, weighted by its size, carrying its mean
    value), all in one softmax; keys centred over the block means."""
    b, s, h, d = q.shape
    n = math.ceil(s / BLOCK)
    out = torch.empty(b, s, h, d, dtype=torch.float64)
    q, k, v = q.double(), k.double(), v.double()
    for bi in range(b):
        for hi in range(h):
            size = torch.tensor([min(BLOCK, s - j * BLOCK) for j in range(n)], dtype=torch.float64)
            km = torch.stack([k[bi, j * BLOCK:(j + 1) * BLOCK, hi].mean(0) for j in range(n)])
            vm = torch.stack([v[bi, j * BLOCK:(j + 1) * BLOCK, hi].mean(0) for j in range(n)])
            keys = k[bi, :, hi] - km.mean(0)
            kmc = km - km.mean(0)
            for t in range(s):
                i = t // BLOCK
                qi = q[bi, i * BLOCK:(i + 1) * BLOCK, hi].mean(0)
                token_mask = exact[bi, hi, i].repeat_interleave(BLOCK)[:s]
                tok = (keys @ q[bi, t, hi]) / math.sqrt(d)
                tok[~token_mask] = -math.inf
                pooled = (kmc @ qi) / math.sqrt(d) + size.log()
                pooled[exact[bi, hi, i]] = -math.inf
                weights = torch.softmax(torch.cat([tok, pooled]), dim=0)
                out[bi, t, hi] = weights @ torch.cat([v[bi, :, hi], vm])
    return out


@pytest.mark.parametrize("tokens, n_video", [(5 * BLOCK, None), (5 * BLOCK + 17, 4 * BLOCK + 30)])
def test_eager_path_matches_the_independent_reference(tokens, n_video):
    q, k, v = _qkv(tokens, seed=tokens)
    settings = SparseSettings(density=0.25, min_tokens=0)
    exact = _naive_routing(q, k, 0.25, n_video)
    assert not exact.all()  # something is pooled, or the test would only check dense attention
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)
    k_mean = torch.stack([kh[:, :, j * BLOCK:(j + 1) * BLOCK].mean(2) for j in range(exact.shape[-1])], 2).mean(2, True)
    routed, _ = sa.route(qh, kh - k_mean, settings, n_video)
    assert torch.equal(routed, exact)
    stats: dict[str, int] = {}
    got = eager_sparse_attention(q, k, v, settings, n_video, stats=stats)
    want = _reference(q, k, v, exact)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-4)
    assert stats == {"computed": int(exact.sum()), "dense": exact.numel()}


def test_tau_routing_is_the_spread_rule_and_the_output_follows_the_reference():
    q, k, v = _qkv(6 * BLOCK, seed=3)
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)
    n = 6
    qm = torch.stack([qh[:, :, j * BLOCK:(j + 1) * BLOCK].mean(2) for j in range(n)], 2)
    km = torch.stack([kh[:, :, j * BLOCK:(j + 1) * BLOCK].mean(2) for j in range(n)], 2)
    kmc = km - km.mean(2, keepdim=True)
    score = qm @ kmc.transpose(-1, -2)
    spread = ((qm ** 2) * kmc.pow(2).mean(2, keepdim=True)).sum(-1, keepdim=True).sqrt()
    want = score > 0.5 * spread
    want |= (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs() <= 1
    exact, _ = sa.route(qh, kh - km.mean(2, keepdim=True), SparseSettings(tau=0.5), None)
    assert torch.equal(exact, want) and not exact.all()
    got = eager_sparse_attention(q, k, v, SparseSettings(tau=0.5))
    assert torch.allclose(got.double(), _reference(q, k, v, exact), atol=1e-5, rtol=1e-4)


def test_every_block_exact_is_dense_attention():
    q, k, v = _qkv(3 * BLOCK + 5, batch=2)
    got = eager_sparse_attention(q, k, v, SparseSettings(density=1.0))
    dense = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert torch.allclose(got, dense, atol=1e-5)


def test_safeguards_send_calls_dense():
    s = SparseSettings()
    assert not sa.should_run_sparse(s, s.min_tokens - 1, 5, 100.0, False)  # too short
    assert not sa.should_run_sparse(s, s.min_tokens, 5, 900.0, False)  # first 20 % of the schedule
    assert not sa.should_run_sparse(s, s.min_tokens, s.dense_blocks[0], 100.0, False)  # a dense block
    assert not sa.should_run_sparse(s, s.min_tokens, 5, 100.0, True)  # a key mask
    assert sa.should_run_sparse(s, s.min_tokens, 5, 100.0, False)


@pytest.mark.parametrize("bad", [dict(tau=-1), dict(density=0), dict(density=1.5), dict(min_tokens=-1),
                                 dict(dense_first=2), dict(tau=float("nan"))])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="sparse attention's"):
        SparseSettings(**bad)


def _dense(q, k, v):
    return lambda: torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def test_a_broken_sparse_path_falls_back_to_dense_with_one_warning(monkeypatch, caplog):
    q, k, v = _qkv(4 * BLOCK)
    monkeypatch.setattr(sa, "eager_sparse_attention", lambda q, k, v, *a, **kw: torch.full_like(v, float("nan")))
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            out = sa.attend_sparse(q, k, v, None, None, _dense(q, k, v), ALWAYS)
    assert torch.allclose(out, _dense(q, k, v)())
    warned = [r for r in caplog.records if "sparse_attention" in r.getMessage()]
    assert len(warned) == 1 and "not finite" in warned[0].getMessage()
    assert kernels.verdict("sparse_attention/eager", "cpu", torch.float32) == kernels.MISMATCH


def test_a_masked_call_is_dense_and_a_good_one_is_trusted():
    q, k, v = _qkv(4 * BLOCK)
    mask = torch.ones(1, 1, 1, 4 * BLOCK, dtype=torch.bool)
    calls = []
    sa.attend_sparse(q, k, v, mask, None, lambda: calls.append("dense") or _dense(q, k, v)(), ALWAYS)
    assert calls == ["dense"] and kernels.verdict("sparse_attention/eager", "cpu", torch.float32) is None
    out = sa.attend_sparse(q, k, v, None, None, _dense(q, k, v), ALWAYS)
    assert torch.allclose(out, eager_sparse_attention(q, k, v, ALWAYS))
    assert kernels.verdict("sparse_attention/eager", "cpu", torch.float32) == kernels.FAST


def test_shipped_t2v_runs_sparse_on_the_tiny_model(monkeypatch, tmp_path):
    """The shipped T2V workflow with `attention: sparse` (threshold lowered through the defaults, at
    192x192 so the sequence has 8+ blocks): the sparse path runs, is trusted, and skips blocks."""
    from pathlib import Path

    from lingbot_core.workflow import Engine, apply_overrides, load_workflow
    from lingbot_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    monkeypatch.setenv("LINGBOT_OUTPUT_DIR", str(tmp_path / "out"))
    api = Path(__file__).resolve().parents[1] / "workflows" / "api" / "lingbot_t2v_dense.json"
    prompt = load_workflow(api, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS)
    prompt = apply_overrides(prompt, ["Denoise.width=192", "Denoise.height=192", "Denoise.steps=2"], NODE_CLASS_MAPPINGS)
    decode = next(nid for nid, n in prompt.nodes.items() if n["class_type"] == "LingBotDecode")
    dense = Engine(NODE_CLASS_MAPPINGS).run(prompt).output(decode)
    monkeypatch.setattr(sa, "DEFAULTS", SparseSettings(density=0.25, min_tokens=0, dense_first=0.0))
    counted: dict[str, int] = {}
    real = sa.eager_sparse_attention
    monkeypatch.setattr(sa, "eager_sparse_attention",
                        lambda q, k, v, s, n_video=None, stats=None: real(q, k, v, s, n_video, counted))
    sparse = apply_overrides(prompt, ['Loader.attention="sparse"'], NODE_CLASS_MAPPINGS)
    frames = Engine(NODE_CLASS_MAPPINGS).run(sparse).output(decode)
    assert kernels.verdict("sparse_attention/eager", "cpu", torch.float32) == kernels.FAST
    assert 0 < counted["computed"] < 0.9 * counted["dense"]
    assert frames.shape == dense.shape and torch.isfinite(frames).all() and not torch.equal(frames, dense)


def test_the_handle_and_the_core_command_take_sparse(tmp_path, capsys, monkeypatch):
    from lingbot_core.__main__ import main as core_main
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.tiny import build_tiny_checkpoint

    folder = build_tiny_checkpoint(tmp_path / "tiny", "dense", seed=0)
    settings = SparseSettings(density=0.5, min_tokens=0)
    handle = PipelineHandle.open(folder, device="cpu", attention_backend="sparse", sparse=settings)
    dit = handle.shared.get("transformer")
    assert dit.sparse_settings == settings and {m.backend for m in dit.modules() if hasattr(m, "backend")} == {"sparse"}
    with pytest.raises(ValueError, match="sparse= takes a SparseSettings"):
        PipelineHandle.open(folder, device="cpu", attention_backend="sparse", sparse={"tau": 2})
    with pytest.raises(ValueError, match="unknown attention backend 'sparce'.*sparse"):
        PipelineHandle.open(folder, device="cpu", attention_backend="sparce")

    calls = []
    real = sa.eager_sparse_attention
    monkeypatch.setattr(sa, "eager_sparse_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    args = ["--model", str(folder), "--mode", "t2i", "--steps", "2", "--width", "192", "--height", "192",
            "--output", str(tmp_path / "out"), "-q"]
    assert core_main([*args, "--attention", "sparse", "--sparse-min-tokens", "0", "--sparse-density", "0.5"]) == 0
    assert calls
    assert core_main([*args, "--sparse-tau", "2"]) == 2  # a sparse setting without --attention sparse
    assert "need --attention sparse" in capsys.readouterr().err


def test_sparse_composes_with_quantized_weights_offload_and_the_step_cache(monkeypatch, tmp_path):
    """fp8 weights quantized on load, sequential offload and the first-block step cache together with
    `attention: sparse`: the sparse path runs (its trial passes) and the video comes out."""
    from pathlib import Path

    from lingbot_core.workflow import Engine, apply_overrides, load_workflow
    from lingbot_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    monkeypatch.setenv("LINGBOT_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.setattr(sa, "DEFAULTS", SparseSettings(density=0.25, min_tokens=0, dense_first=0.0))
    calls = []
    real = sa.eager_sparse_attention
    monkeypatch.setattr(sa, "eager_sparse_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    api = Path(__file__).resolve().parents[1] / "workflows" / "api" / "lingbot_t2v_dense.json"
    prompt = load_workflow(api, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS)
    prompt = apply_overrides(prompt, ['Loader.attention="sparse"', 'Loader.weights="fp8_e4m3"',
                                      'Offload.mode="sequential"', 'Denoise.step_cache="first_block"',
                                      "Denoise.cache_threshold=0.5", "Denoise.width=128", "Denoise.height=128",
                                      "Denoise.steps=9"], NODE_CLASS_MAPPINGS)
    decode = next(nid for nid, n in prompt.nodes.items() if n["class_type"] == "LingBotDecode")
    frames = Engine(NODE_CLASS_MAPPINGS).run(prompt).output(decode)
    assert calls and torch.isfinite(frames).all()
    assert kernels.verdict("sparse_attention/eager", "cpu", torch.float32) == kernels.FAST


def test_the_bench_runs_and_counts_fewer_blocks(capsys):
    from bench import sparse_attention as bench

    assert bench.main(["--frames", "1", "--settings", "density 0.25", "--threads", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("2072")]
    assert len(rows) == 2 and float(rows[1][-1]) < 1.0 and 0 < float(rows[1][-2]) < 1.0


def test_a_gpu_without_comfy_kitchen_says_so_once_and_runs_eager(monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def no_kitchen(name, *args, **kwargs):
        if name == "comfy_kitchen":
            raise ImportError("no comfy_kitchen")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_kitchen)
    monkeypatch.setattr(sa, "_said", set())
    with caplog.at_level(logging.WARNING):
        assert sa._kitchen(torch.device("cuda", 0)) is None and sa._kitchen(torch.device("cuda", 0)) is None
        assert sa._kitchen(torch.device("cpu")) is None
    said = [r.getMessage() for r in caplog.records if "comfy-kitchen" in r.getMessage()]
    assert len(said) == 1 and "not installed" in said[0] and "eager path" in said[0]


def test_comfy_kitchen_is_used_on_a_gpu_where_it_says_it_runs(monkeypatch):
    """Through a fake comfy_kitchen module: its kernel is chosen on a CUDA device, and our settings and
    the text tokens reach it as its tau / topk_ratio / sink blocks."""
    import sys
    import types

    seen = {}
    fake = types.SimpleNamespace(sol_attn_is_available=lambda device: True,
                                 sol_attn=lambda q, k, v, **kw: seen.update(kw) or v)
    monkeypatch.setitem(sys.modules, "comfy_kitchen", fake)
    kernel = sa._kitchen(torch.device("cuda", 0))
    assert kernel is fake.sol_attn
    q, k, v = _qkv(5 * BLOCK)
    sa._kitchen_call(kernel, q, k, v, SparseSettings(tau=0.7, density=0.3), n_video=4 * BLOCK + 10)
    assert seen == {"tau": 0.7, "topk_ratio": 0.3, "sink_blocks": [4, 5], "sink_q": [4, 5]}
    sa._kitchen_call(kernel, q, k, v, SparseSettings(), n_video=None)
    assert seen["sink_blocks"] == [0, 0] and seen["topk_ratio"] == 0.0


def test_sparse_composes_with_a_lora_on_the_moe(fixtures_root, monkeypatch):
    """A LoRA view of a sparse-attention handle (tiny MoE): the sparse path runs under the merged
    weights, and the LoRA still changes the result as it does with dense attention."""
    from lingbot_core import lora as lora_ops
    from lingbot_core import stages
    from lingbot_core.handle import PipelineHandle

    g = torch.Generator().manual_seed(1)
    lora = lora_ops.LoraFile.from_state_dict({
        "diffusion_model.blocks.1.attn.to_v.lora_down.weight": torch.randn(2, 32, generator=g) * 0.3,
        "diffusion_model.blocks.1.attn.to_v.lora_up.weight": torch.randn(32, 2, generator=g) * 0.3,
    }, name="to_v")
    calls = []
    real = sa.eager_sparse_attention
    monkeypatch.setattr(sa, "eager_sparse_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu", attention_backend="sparse",
                                 sparse=SparseSettings(density=0.25, min_tokens=0, dense_first=0.0))
    cond = stages.encode_prompt(handle, "a red boat", None)
    calls.clear()  # the open's probe ran it once
    run = dict(height=192, width=192, num_frames=5, steps=2, guidance_scale=1.0, seed=5)
    plain = stages.denoise(handle, cond, **run)
    before = len(calls)
    merged = stages.denoise(lora_ops.with_lora(handle, lora, 1.0), cond, **run)
    assert before > 0 and len(calls) == 2 * before
    assert torch.isfinite(merged).all() and not torch.equal(merged, plain)


def test_extension_segments_know_the_sparse_settings(tmp_path):
    """Saved extension segments are reused only by the same model: sparse settings are part of it."""
    from lingbot_core import extend
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.tiny import build_tiny_checkpoint

    folder = build_tiny_checkpoint(tmp_path / "tiny", "dense", seed=0)
    ids = [extend.model_identity(PipelineHandle.open(folder, device="cpu", attention_backend=a, sparse=s))
           for a, s in (("sparse", SparseSettings(tau=1.0)), ("sparse", SparseSettings(tau=2.0)), (None, None))]
    assert len({repr(i) for i in ids}) == 3


UL_DIT = dict(hidden_size=64, num_attention_heads=4, depth=2, intermediate_size=96, text_dim=32, freq_dim=32,
              axes_dims=(4, 6, 6), axes_lens=(64, 32, 32))


def _ulysses_worker(rank: int, port: int, out: str) -> None:
    import json
    from pathlib import Path

    from bench._common import random_dit
    from lingbot_core.distributed import ParallelLayout, enable_sequence_parallel
    from lingbot_core.distributed.launch import init_loopback_group

    torch.set_num_threads(1)
    init_loopback_group(rank, 2, port)
    try:
        model = random_dit(UL_DIT, 0.05)
        model.set_attention_backend("sparse", SparseSettings(density=0.25, min_tokens=0, dense_first=0.0))
        g = torch.Generator().manual_seed(1)
        x, text = torch.randn(1, 16, 3, 16, 16, generator=g), torch.randn(1, 8, 32, generator=g)  # 192 + 8 tokens
        t = torch.tensor([500.0])
        calls = []
        real = sa.eager_sparse_attention
        sa.eager_sparse_attention = lambda *a, **kw: calls.append(a[0].shape[2]) or real(*a, **kw)
        with torch.no_grad():
            alone = model(x, t, text, None, return_dict=False)[0]
            enable_sequence_parallel(model, ParallelLayout.create(1, 2))
            shared = model(x, t, text, None, return_dict=False)[0]
        diff = float((shared - alone).norm() / alone.norm())
        Path(out, f"rank{rank}.json").write_text(json.dumps({"diff": diff, "heads": calls}))
    finally:
        torch.distributed.destroy_process_group()


def test_ulysses_routes_each_ranks_heads_as_one_process_does(tmp_path):
    """Two gloo processes sharing the sequence (Ulysses): each runs sparse attention over its half of
    the heads and the DiT's output equals the one-process sparse output."""
    import json

    import torch.multiprocessing as mp

    from lingbot_core.distributed.launch import free_loopback_port

    mp.start_processes(_ulysses_worker, args=(free_loopback_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["diff"] < 1e-5, (rank, got)
        assert got["heads"] == [4, 2], (rank, got)  # block 1 alone (4 heads), then under Ulysses (2 heads each)


def test_compiled_blocks_call_the_sparse_path_eagerly(tmp_path, monkeypatch):
    """compile="blocks" (dynamo with the eager backend here: the same graph capture without inductor's
    time) with sparse attention: the sparse call runs outside the graph, every block ran compiled, and
    the result equals the eager blocks'."""
    from lingbot_core import stages
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.models.compile import compile_problem
    from lingbot_core.tiny import build_tiny_checkpoint

    if compile_problem("cpu") is not None:
        pytest.skip(compile_problem("cpu"))
    folder = build_tiny_checkpoint(tmp_path / "tiny", "dense", seed=0)
    settings = SparseSettings(density=0.25, min_tokens=0, dense_first=0.0)
    run = dict(height=192, width=192, num_frames=5, steps=2, guidance_scale=1.0, seed=5)
    handle = PipelineHandle.open(folder, device="cpu", attention_backend="sparse", sparse=settings)
    cond = stages.encode_prompt(handle, "a red boat", None)
    eager = stages.denoise(handle, cond, **run)
    sparse_calls = []
    real = sa.eager_sparse_attention
    monkeypatch.setattr(sa, "eager_sparse_attention", lambda *a, **kw: sparse_calls.append(1) or real(*a, **kw))
    with counted_eager_blocks() as calls:
        compiled = PipelineHandle.open(folder, device="cpu", attention_backend="sparse", sparse=settings,
                                       compile="blocks")
        sparse_calls.clear()  # the open's probe
        frames = stages.denoise(compiled, cond, **run)
    depth = len(compiled.shared.get("transformer").blocks)
    assert calls[0] == run["steps"] * depth and len(sparse_calls) == run["steps"] * (depth - 1)  # block 0 dense
    assert torch.allclose(frames, eager, atol=1e-5)


def test_the_refiner_runs_sparse_too(fixtures_root, monkeypatch):
    """The MoE refiner (where the tokens are most) gets the same attention choice and settings."""
    from lingbot_core import stages
    from lingbot_core.handle import PipelineHandle

    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu", attention_backend="sparse",
                                 sparse=SparseSettings(density=0.25, min_tokens=0, dense_first=0.0))
    cond = stages.encode_prompt(handle, "a boat", None)
    calls = []
    real = sa.eager_sparse_attention
    monkeypatch.setattr(sa, "eager_sparse_attention", lambda *a, **kw: calls.append(a[0].shape[1]) or real(*a, **kw))
    frames = torch.rand(5, 96, 96, 3, generator=torch.Generator().manual_seed(0))
    out = stages.refine(handle, frames, cond, height=192, width=192, steps=2, seed=1)
    assert calls and torch.isfinite(out).all()
    assert handle.shared.get("refiner").sparse_settings == handle.shared.sparse
