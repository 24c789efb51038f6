"""Sequence and CFG parallel (issue 24): four gloo processes on the loopback against one process.

One spawned run of four processes, cfg=2 x ulysses=2 (interpreter starts are the cost), covers:
the DiT forward shared over a ulysses group on a tiny dense and a tiny MoE DiT (an odd joint sequence,
so the padding path runs, and a padded prompt batch, so the key mask is sharded too); the guided
prediction through `ParallelGuidance`; and a whole tiny T2V (text encode, `parallel_denoise`,
decode) against the same stages in one process. The workers write their largest differences to a
file; the asserts are here. Larger layouts and timings are in bench/parallel.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench._common import random_dit
from lingbot_core.distributed import (
    ParallelLayout,
    disable_sequence_parallel,
    enable_sequence_parallel,
    parse_degrees,
)
from lingbot_core.distributed.launch import free_loopback_port, init_loopback_group
from lingbot_core.models.transformer import LingBotVideoTransformer3DModel

#: float32 tolerance against the one-process output, relative to its largest magnitude
TOLERANCE = 1e-6  # measured: 0 dense, 1.3e-7 MoE with a padded prompt batch
#: the same for a whole tiny T2V (3 guided steps, then the VAE), latents and frames
T2V_TOLERANCE = 1e-5

DENSE = dict(hidden_size=64, num_attention_heads=4, depth=2, intermediate_size=96, text_dim=32, freq_dim=32,
             axes_dims=(4, 6, 6), axes_lens=(64, 32, 32))
MOE = dict(DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, n_group=2,
           topk_group=1, routed_scaling_factor=2.5)


def _cases():
    g = torch.Generator().manual_seed(1)
    # 3x2x3 = 18 video tokens + 7 text tokens = 25: odd, so ulysses=2 pads one token
    one = (torch.randn(1, 16, 3, 4, 6, generator=g), torch.tensor([700.0]), torch.randn(1, 7, 32, generator=g), None)
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    two = (torch.randn(2, 16, 3, 4, 6, generator=g), torch.tensor([300.0, 300.0]), torch.randn(2, 7, 32, generator=g),
           mask)
    return {"batch1": one, "batch2_masked": two}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _ulysses_checks(layout: ParallelLayout) -> dict:
    found = {}
    for name, cfg in (("dense", DENSE), ("moe", MOE)):
        model = random_dit(cfg, 0.05)
        for case, (x, t, text, mask) in _cases().items():
            with torch.no_grad():
                alone = model(x, t, text, mask, return_dict=False)[0]
                enable_sequence_parallel(model, layout)
                shared = model(x, t, text, mask, return_dict=False)[0]
                disable_sequence_parallel(model)
                again = model(x, t, text, mask, return_dict=False)[0]
            found[f"{name}/{case}"] = {"diff": _relative(shared, alone), "restored": bool(torch.equal(again, alone))}
    return found


def _cfg_checks(layout: ParallelLayout) -> dict:
    from lingbot_core.distributed import ParallelGuidance
    from lingbot_core.sampling.guidance import Guidance

    model = random_dit(MOE, 0.05)
    g = torch.Generator().manual_seed(2)
    latents = torch.randn(1, 16, 3, 4, 6, generator=g)
    positive = SimpleNamespace(embeds=torch.randn(1, 7, 32, generator=g), mask=torch.ones(1, 7, dtype=torch.int64))
    negative = SimpleNamespace(embeds=torch.randn(1, 4, 32, generator=g), mask=torch.ones(1, 4, dtype=torch.int64))
    common = dict(dtype=torch.float32, device=torch.device("cpu"))
    t = torch.tensor(650.0)
    alone = Guidance(model, positive, negative, 4.0, **common).predict(latents, t)
    enable_sequence_parallel(model, layout)  # each cfg row's forward is itself shared by its ulysses pair
    shared = ParallelGuidance(model, positive, negative, 4.0, layout=layout, **common).predict(latents, t)
    disable_sequence_parallel(model)
    return {"diff": _relative(shared, alone), "cfg_rank": layout.cfg_rank}


def _t2v_checks(layout: ParallelLayout, tiny: str) -> dict:
    """A whole tiny T2V: the stages in one process, then the same with the denoise on all four ranks."""
    from lingbot_core import stages
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.latents import latent_shape
    from lingbot_core.worker_pool.run import parallel_denoise

    handle = PipelineHandle.open(tiny, device="cpu")
    size = dict(height=32, width=32, num_frames=5)
    cond = stages.encode_prompt(handle, "a red paper boat on a canal", "")
    noise = stages.prepare_latents(latent_shape(**size), torch.Generator().manual_seed(7))
    shared = parallel_denoise(handle, layout, noise, cond, seed=7, steps=3, guidance_scale=3.0)
    every = [torch.empty_like(shared) for _ in range(layout.world_size)]
    torch.distributed.all_gather(every, shared)
    hooks_left = any("_diffusers_hook" in m.__dict__ and m._diffusers_hook.hooks
                     for m in handle.shared.loaded["transformer"].modules())
    found = {"same_on_every_rank": all(torch.equal(e, shared) for e in every), "hooks_left": hooks_left}
    # the TI2V first frame on a parallel view: rank 0 runs the VAE, the others receive the posterior
    from PIL import Image

    from lingbot_core.latents import vae_to_dit

    picture = Image.fromarray((torch.rand(40, 48, 3, generator=torch.Generator().manual_seed(6)) * 255).byte().numpy())
    image_cond = stages.encode_image(handle.with_parallel(layout), picture, 32, 32)
    found["vae_loaded"] = "vae" in handle.shared.loaded
    found["image_latent"] = vae_to_dit(image_cond.latent_mean, image_cond.vae_config).sum().item()
    if layout.rank == 0:  # the one-process run, once
        alone = stages.denoise(handle, cond, **size, steps=3, guidance_scale=3.0, seed=7)
        frames_alone, frames_shared = stages.decode(handle, alone), stages.decode(handle, shared)
        found.update(latents=_relative(shared, alone), frames=_relative(frames_shared, frames_alone),
                     shape=list(frames_shared.shape))
    return found


def _refine_checks(layout: ParallelLayout, tiny_moe: str) -> dict:
    """The MoE refiner on a parallel view of the handle: rank 0 encodes the prompt and the frames (the
    others are handed placeholder frames, which they must not need), every rank samples, rank 0 decodes."""
    from lingbot_core import stages
    from lingbot_core.distributed.stage import placeholder_frames
    from lingbot_core.handle import PipelineHandle

    handle = PipelineHandle.open(tiny_moe, device="cpu")
    view = handle.with_parallel(layout)
    frames = torch.rand(5, 32, 32, 3, generator=torch.Generator().manual_seed(3))
    given = frames if layout.rank == 0 else placeholder_frames(5, 32, 32)
    options = dict(height=32, width=32, steps=4, seed=5, tiling=False)
    cond = stages.encode_prompt(view, "a red paper boat on a canal", None)
    shared = stages.refine(view, given, cond, **options)
    found = {"text_encoder_loaded": "text_encoder" in handle.shared.loaded, "vae_loaded": "vae" in handle.shared.loaded}
    if layout.rank == 0:
        alone = stages.refine(handle, frames, stages.encode_prompt(handle, "a red paper boat on a canal", None),
                              **options)
        found["frames"] = _relative(shared, alone)
    return found


def _fsdp_checks(layout: ParallelLayout) -> dict:
    """FSDP2 on top of cfg=2 x ulysses=2: a tiny MoE DiT's blocks sharded over the four ranks, through
    `parallel_denoise` on a bare DiT, against the same DiT in one process."""
    import dataclasses

    from lingbot_core.distributed.fsdp import is_fsdp_sharded, shard_plan
    from lingbot_core.prompt import PromptEmbeds
    from lingbot_core.stages import Conditioning
    from lingbot_core.worker_pool.run import parallel_denoise

    g = torch.Generator().manual_seed(4)
    ids = torch.zeros(1, 1, dtype=torch.int64)
    cond = Conditioning(PromptEmbeds(torch.randn(1, 7, 32, generator=g), torch.ones(1, 7, dtype=torch.int64), ids),
                        PromptEmbeds(torch.randn(1, 3, 32, generator=g), torch.ones(1, 3, dtype=torch.int64), ids))
    latents = torch.randn(1, 16, 2, 4, 6, generator=g)
    model = random_dit(MOE, 0.05)
    full = sum(p.numel() for p in model.parameters())
    plan = shard_plan(model)
    alone = parallel_denoise(model, ParallelLayout.single(), latents, cond, steps=2, guidance_scale=3.0)
    fsdp = dataclasses.replace(layout, fsdp=True, _world=None)
    shared = parallel_denoise(model, fsdp, latents, cond, steps=2, guidance_scale=3.0)
    from torch.distributed.tensor import DTensor

    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    sharded_numel = sum(dict(model.named_parameters())[f"{b}.{n}"].numel() for b, names, _ in plan.blocks
                        for n in names)
    return {"diff": _relative(shared, alone), "sharded": is_fsdp_sharded(model), "local": local, "full": full,
            "expected_local": full - sharded_numel + sharded_numel // layout.world_size}


def write_lora(path: Path) -> None:
    """A small random LoRA on the tiny dense DiT's attention and FFN (block 0 and 1), as a file."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(9)
    tensors = {}
    for key, (rows, cols) in {"blocks.0.attn.to_q": (32, 32), "blocks.1.attn.to_out": (32, 32),
                              "blocks.0.ffn.up_proj": (64, 32)}.items():
        tensors[f"diffusion_model.{key}.lora_down.weight"] = torch.randn(4, cols, generator=g) * 0.3
        tensors[f"diffusion_model.{key}.lora_up.weight"] = torch.randn(rows, 4, generator=g) * 0.3
    save_file(tensors, str(path))


def write_moe_lora(path: Path) -> None:
    """A small random LoRA on the tiny MoE DiT: per-expert factors on the routed experts' w1 (3-D) and
    the shared expert's down projection."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(10)
    save_file({"diffusion_model.blocks.1.ffn.experts.w1.lora_down.weight": torch.randn(4, 4, 32, generator=g) * 0.3,
               "diffusion_model.blocks.1.ffn.experts.w1.lora_up.weight": torch.randn(4, 16, 4, generator=g) * 0.3,
               "diffusion_model.blocks.0.ffn.shared_experts.down_proj.lora_down.weight":
                   torch.randn(4, 16, generator=g) * 0.3,
               "diffusion_model.blocks.0.ffn.shared_experts.down_proj.lora_up.weight":
                   torch.randn(32, 4, generator=g) * 0.3}, str(path))


def _lora_checks(layout: ParallelLayout, tiny: str, lora_path: str) -> dict:
    """A LoRA view through the parallel denoise (2 steps) against the same view in one process; the
    plain view before and after it, bit for bit (the merge is undone on every rank)."""
    from lingbot_core import stages
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.latents import latent_shape
    from lingbot_core.lora import with_lora
    from lingbot_core.worker_pool.run import parallel_denoise

    handle = PipelineHandle.open(tiny, device="cpu")
    size = dict(height=32, width=32, num_frames=5)
    cond = stages.encode_prompt(handle, "a red paper boat on a canal", "")
    noise = stages.prepare_latents(latent_shape(**size), torch.Generator().manual_seed(8))
    run = dict(seed=8, steps=2, guidance_scale=3.0)
    lora = with_lora(handle, lora_path, 0.8)
    plain = parallel_denoise(handle, layout, noise, cond, **run)
    weights = {n: p.detach().clone() for n, p in handle.component("transformer").named_parameters()}
    shared = parallel_denoise(lora, layout, noise, cond, **run)
    again = parallel_denoise(handle, layout, noise, cond, **run)
    found = {"plain_again": bool(torch.equal(again, plain)), "lora_differs": _relative(shared, plain),
             "weights_back": all(torch.equal(p, weights[n]) for n, p in
                                 handle.component("transformer").named_parameters())}
    if layout.rank == 0:
        alone = stages.denoise(lora, cond, **size, **run)
        found["lora"] = _relative(shared, alone)
    return found


def _lora_fsdp_checks(layout: ParallelLayout, tiny: str, lora_path: str) -> dict:
    """A LoRA view with an FSDP layout (a handle of its own: FSDP sharding is one-way), built in either
    order, against the same LoRA in one process; the plain view before and after, and every rank's
    shards, bit for bit (each rank merged its own rows of the delta and took them off again)."""
    import dataclasses

    from torch.distributed.tensor import DTensor

    from lingbot_core import stages
    from lingbot_core.distributed.fsdp import is_fsdp_sharded
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.latents import latent_shape
    from lingbot_core.lora import with_lora

    def local(p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if isinstance(p, DTensor) else p

    handle = PipelineHandle.open(tiny, device="cpu")
    fsdp = dataclasses.replace(layout, fsdp=True, _world=None)
    cond = stages.encode_prompt(handle, "a red paper boat on a canal", "")
    noise = stages.prepare_latents(latent_shape(height=32, width=32, num_frames=5), torch.Generator().manual_seed(8))
    run = dict(latents=noise, height=32, width=32, num_frames=5, seed=8, steps=1, guidance_scale=3.0)
    plain = stages.denoise(handle.with_parallel(fsdp), cond, **run)  # shards the DiT
    dit = handle.component("transformer")
    shards = {n: local(p).detach().clone() for n, p in dit.named_parameters()}
    found: dict = {"sharded": is_fsdp_sharded(dit)}
    outputs = {}
    for order, view in (("lora_then_fsdp", lambda: with_lora(handle, lora_path, 0.8).with_parallel(fsdp)),
                        ("fsdp_then_lora", lambda: with_lora(handle.with_parallel(fsdp), lora_path, 0.8))):
        outputs[order] = stages.denoise(view(), cond, **run)
        found[order] = _relative(outputs[order], plain)
    # the next view without the LoRA takes it off (the door restores the pristine rows on every rank)
    found["plain_again"] = bool(torch.equal(stages.denoise(handle.with_parallel(fsdp), cond, **run), plain))
    found["weights_back"] = all(torch.equal(local(p), shards[n]) for n, p in dit.named_parameters())
    if layout.rank == 0:
        alone = stages.denoise(with_lora(PipelineHandle.open(tiny, device="cpu"), lora_path, 0.8), cond, **run)
        found["vs_alone"] = max(_relative(got, alone) for got in outputs.values())
    return found


def _step_cache_checks(layout: ParallelLayout, tiny: str) -> dict:
    """First-block caching on the parallel view against one process: the figure each rank decides on
    is the whole sequence's (summed over its ulysses group), each cfg row keeps its own branch's, and
    the latents match."""
    from lingbot_core import stages
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.latents import latent_shape
    from lingbot_core.sampling import step_cache
    from lingbot_core.worker_pool.run import parallel_denoise

    figures: list[float] = []
    real = step_cache._rel_l1

    def recording(now, before, reduce=None):
        figures.append(real(now, before, reduce))
        return figures[-1]

    step_cache._rel_l1 = recording
    try:
        handle = PipelineHandle.open(tiny, device="cpu")
        cond = stages.encode_prompt(handle, "a red paper boat on a canal", "")
        noise = stages.prepare_latents(latent_shape(height=32, width=32, num_frames=5), torch.Generator().manual_seed(8))
        run = dict(seed=8, steps=10, guidance_scale=3.0)
        cache = step_cache.StepCacheSettings("first_block", threshold=1e9, warmup_steps=2, max_skips=3)
        shared = parallel_denoise(handle, layout, noise, cond, **run, step_cache=cache)
        found: dict = {"figures": list(figures), "cfg_rank": layout.cfg_rank}
        if layout.rank == 0:
            figures.clear()
            geometry = dict(latents=noise, height=32, width=32, num_frames=5, **run)
            alone = stages.denoise(handle, cond, **geometry, step_cache=cache)
            found["alone_figures"] = list(figures)
            found["latents"] = _relative(shared, alone)
            found["cache_changed"] = _relative(alone, stages.denoise(handle, cond, **geometry))
    finally:
        step_cache._rel_l1 = real
    return found


def _rewrite_checks(layout: ParallelLayout, tiny: str) -> dict:
    """A local rewrite (the pipe's text encoder writes) on the parallel view: what each rank got, and whether
    it loaded the text encoder."""
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.rewrite.local_backend import generate_text

    handle = PipelineHandle.open(tiny, device="cpu")
    got = generate_text(handle.with_parallel(layout), "You write captions.", "a red paper boat", max_new_tokens=6)
    return {"text": got.text, "tokens": got.tokens, "stopped": got.stopped,
            "encoder_loaded": "text_encoder" in handle.shared.loaded}


def _headless(rank: int, world: int, out: str) -> dict:
    """`lingbot-run t2i --parallel cfg=2,ulysses=2` on this rank, as torchrun would start it (its
    environment variables; the CLI finds the group already initialised and leaves it at the end)."""
    import contextlib
    import io
    import os

    from lingbot_nodes.cli import main

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["t2i", "--parallel", "cfg=2,ulysses=2", "--output", str(Path(out, "cli")), "-q"])
    return {"code": code, "printed": printed.getvalue().split()}


def _failure_checks(layout: ParallelLayout) -> dict:
    """Rank 1 raises from its step callback after step 2 (as an interrupt would); what reached each
    rank, and how long after its own step 2. Without the per-step status the other ranks would wait in
    their step-3 collectives until the group's timeout (30 minutes)."""
    import time

    from lingbot_core.prompt import PromptEmbeds
    from lingbot_core.stages import Conditioning
    from lingbot_core.worker_pool.run import parallel_denoise

    g = torch.Generator().manual_seed(4)
    embeds = PromptEmbeds(torch.randn(1, 7, 32, generator=g), torch.ones(1, 7, dtype=torch.int64),
                          torch.zeros(1, 1, dtype=torch.int64))
    marks: dict = {}

    def callback(step: int, total: int, latents: torch.Tensor) -> None:
        marks[step] = time.monotonic()
        if layout.rank == 1 and step == 2:
            raise RuntimeError("injected failure at step 2")

    try:
        parallel_denoise(random_dit(DENSE, 0.05), layout, torch.randn(1, 16, 2, 4, 6, generator=g),
                         Conditioning(embeds, embeds), steps=5, guidance_scale=3.0, callback=callback)
        return {"error": None}
    except Exception as err:  # what reached this rank is the result
        return {"error": type(err).__name__, "message": str(err), "steps": sorted(marks),
                "after_step2_s": time.monotonic() - marks.get(2, 0.0)}


def _forward_failure_checks(rank: int, world: int, store_port: int) -> dict:
    """Last (it breaks its group): a new group on a store the test process holds, as torchrun's agent
    holds it (it outlives every rank), with gloo's default 30-minute timeout; cfg=2 x ulysses=2 and
    rank 1 raising inside its first forward (the test-only patch, in this process). Ranks 0 and 3
    wait on rank 1 directly (its ulysses and cfg groups), rank 2 only on ranks 0 and 3: it stops
    when they leave. What reached each rank and how long it took; then the process ends (leaves)."""
    import time
    from datetime import timedelta

    from parallel_fakes import fail_inside_forward

    from lingbot_core.prompt import PromptEmbeds
    from lingbot_core.stages import Conditioning
    from lingbot_core.worker_pool.run import parallel_denoise

    store = torch.distributed.TCPStore("127.0.0.1", store_port, world, False, timedelta(seconds=60))
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world)
    layout = ParallelLayout.create(2, 2)
    patch = pytest.MonkeyPatch()
    fail_inside_forward(patch, rank=1, call=2)  # the tiny DiT's second block: after the first block's all-to-alls
    g = torch.Generator().manual_seed(4)
    embeds = PromptEmbeds(torch.randn(1, 7, 32, generator=g), torch.ones(1, 7, dtype=torch.int64),
                          torch.zeros(1, 1, dtype=torch.int64))
    started = time.monotonic()
    try:
        parallel_denoise(random_dit(DENSE, 0.05), layout, torch.randn(1, 16, 2, 4, 6, generator=g),
                         Conditioning(embeds, embeds), steps=3, guidance_scale=3.0)
        return {"error": None}
    except Exception as err:
        return {"error": type(err).__name__, "message": str(err), "seconds": time.monotonic() - started}
    finally:
        patch.undo()


def _worker(rank: int, world: int, port: int, out: str, tiny: str, tiny_moe: str, store_port: int) -> None:
    """One spawned run for every check (each interpreter start costs seconds on a loaded machine)."""
    torch.set_num_threads(1)
    init_loopback_group(rank, world, port)
    try:
        layout = ParallelLayout.create(2, 2)
        result = {"ulysses": _ulysses_checks(layout), "cfg": _cfg_checks(layout), "t2v": _t2v_checks(layout, tiny),
                  "refine": _refine_checks(layout, tiny_moe), "fsdp": _fsdp_checks(layout),
                  "lora": _lora_checks(layout, tiny, str(Path(out, "lora.safetensors"))),
                  "lora_fsdp": {"dense": _lora_fsdp_checks(layout, tiny, str(Path(out, "lora.safetensors"))),
                                "moe": _lora_fsdp_checks(layout, tiny_moe, str(Path(out, "moe_lora.safetensors")))},
                  "step_cache": _step_cache_checks(layout, tiny),
                  "failure": _failure_checks(layout), "rewrite": _rewrite_checks(layout, tiny),
                  "cli": _headless(rank, world, out)}
        result["forward_failure"] = _forward_failure_checks(rank, world, store_port)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    from lingbot_core.tiny import ensure_tiny_checkpoint

    tiny, tiny_moe = (str(ensure_tiny_checkpoint(v)) for v in ("dense", "moe"))  # built here, not raced by four
    out = tmp_path_factory.mktemp("parallel")
    write_lora(out / "lora.safetensors")
    write_moe_lora(out / "moe_lora.safetensors")
    # fork: the workers start without importing torch again (as DataLoader workers do; one thread each);
    # spawn where CUDA is initialised in this process (it does not survive a fork)
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    store = torch.distributed.TCPStore("127.0.0.1", 0, 4, True, wait_for_workers=False)  # torchrun's agent's part
    mp.start_processes(_worker, args=(4, free_loopback_port(), str(out), tiny, tiny_moe, store.port), nprocs=4,
                       join=True, start_method=method)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    results[0]["cli_files"] = sorted(str(p.relative_to(out / "cli")) for p in (out / "cli").rglob("*") if p.is_file())
    print("parallel vs one process, max relative diff per rank:", json.dumps(results))  # shown with -s
    return results


def test_ulysses_matches_one_process_dense_and_moe(four_ranks):
    for rank, result in enumerate(four_ranks):
        found = result["ulysses"]
        assert set(found) == {f"{m}/{c}" for m in ("dense", "moe") for c in ("batch1", "batch2_masked")}
        for key, got in found.items():
            assert got["diff"] <= TOLERANCE, (rank, key, got)
            assert got["restored"], (rank, key)  # disabling gives the untouched one-process model back


def test_cfg_parallel_gives_the_guided_prediction(four_ranks):
    assert sorted(r["cfg"]["cfg_rank"] for r in four_ranks) == [0, 0, 1, 1]
    for result in four_ranks:
        assert result["cfg"]["diff"] <= TOLERANCE, result["cfg"]


def test_tiny_t2v_on_four_processes_matches_one_process(four_ranks):
    got = four_ranks[0]["t2v"]
    assert got["shape"] == [5, 32, 32, 3], got
    assert got["latents"] <= T2V_TOLERANCE and got["frames"] <= T2V_TOLERANCE, got
    for rank, result in enumerate(four_ranks):
        assert result["t2v"]["same_on_every_rank"], rank  # every rank steps the same latents
        # the first frame's posterior reached every rank; only rank 0 loaded the VAE for it
        assert result["t2v"]["image_latent"] == four_ranks[0]["t2v"]["image_latent"], rank
        assert result["t2v"]["vae_loaded"] is (rank == 0), rank
        assert not result["t2v"]["hooks_left"], rank  # the stage took its hooks off the shared DiT


def test_moe_refiner_on_four_processes_matches_one_process(four_ranks):
    assert four_ranks[0]["refine"]["frames"] <= T2V_TOLERANCE, four_ranks[0]["refine"]
    assert four_ranks[0]["refine"]["text_encoder_loaded"] and four_ranks[0]["refine"]["vae_loaded"]
    for rank, result in enumerate(four_ranks[1:], 1):  # only rank 0 ever loads the text encoder and the VAE
        assert not result["refine"]["text_encoder_loaded"] and not result["refine"]["vae_loaded"], rank


def test_a_local_rewrite_on_several_processes_runs_on_rank_0_only(four_ranks):
    """Every rank ran the Rewrite node's generation itself, so every rank loaded the text encoder and kept it on
    its GPU (offload 'none'), which the per-GPU plan does not count (only rank 0 loads the encoders); now rank 0
    writes and the others receive its text, as for the prompt's encoding."""
    rows = [r["rewrite"] for r in four_ranks]
    assert [r["encoder_loaded"] for r in rows] == [True, False, False, False]
    assert all((r["text"], r["tokens"], r["stopped"]) == (rows[0]["text"], rows[0]["tokens"], rows[0]["stopped"])
               for r in rows) and rows[0]["tokens"] > 0


def test_fsdp_shards_the_blocks_and_keeps_the_result(four_ranks):
    for rank, result in enumerate(four_ranks):
        got = result["fsdp"]
        assert got["sharded"] and got["diff"] <= TOLERANCE, (rank, got)
        # each rank holds a quarter of the blocks' bulk weights (the float32 set and the rest whole)
        assert got["local"] == got["expected_local"] < got["full"], (rank, got)


def test_headless_parallel_run_saves_once_what_one_process_saves(four_ranks, tmp_path, capsys):
    """Rank 0 encodes, decodes and saves; the other ranks print and write nothing; the picture equals
    the one-process run's (PNG: lossless) within one 8-bit level."""
    import numpy as np
    from PIL import Image

    from lingbot_nodes.cli import main

    for rank, result in enumerate(four_ranks):
        assert result["cli"]["code"] == 0, rank
        if rank:
            assert result["cli"]["printed"] == [], rank
    written = four_ranks[0]["cli"]["printed"]
    assert len(written) == 1 and written[0].endswith(".png"), written
    assert four_ranks[0]["cli_files"] == ["lingbot/t2i_00001_.png"]  # one file in the shared folder
    assert main(["t2i", "--output", str(tmp_path), "-q"]) == 0
    alone = capsys.readouterr().out.split()
    parallel_png = np.asarray(Image.open(written[0]), dtype=np.int16)
    alone_png = np.asarray(Image.open(alone[0]), dtype=np.int16)
    assert parallel_png.shape == alone_png.shape
    assert np.abs(parallel_png - alone_png).max() <= 1


def test_degrees_parse_and_default_from_the_world():
    assert parse_degrees("", 4) == (1, 4)
    assert parse_degrees("cfg=2", 8) == (2, 4)
    assert parse_degrees("cfg=2,ulysses=2", 4) == (2, 2)
    for bad in ("cfg=3", "cfg=2,ulysses=3", "ring=2", "cfg=x"):
        with pytest.raises(ValueError):
            parse_degrees(bad, 4)


def test_ulysses_degree_must_divide_the_heads():
    with pytest.raises(ValueError, match="divide"):
        ParallelLayout(cfg=1, ulysses=3).check_heads(16)
    ParallelLayout(cfg=2, ulysses=4).check_heads(16)


def test_one_process_layout_installs_nothing():
    model = random_dit(DENSE, 0.05)
    enable_sequence_parallel(model, ParallelLayout.single())
    assert not any("_diffusers_hook" in m.__dict__ for m in model.modules())


def test_sequence_parallel_runs_a_step_cache_runner_on_its_share():
    """The sharding runner wraps a step cache's runner (attached after it, so it runs first); the
    cache's own hook refuses to replace a sharding runner (the other order would lose the sharding)."""
    from lingbot_core.distributed.ulysses import _ShardingHook
    from lingbot_core.sampling.step_cache import StepCache, StepCacheSettings, _RunnerHook

    hook = _ShardingHook(ParallelLayout(cfg=1, ulysses=2))
    _, kwargs = hook.pre_forward(None)
    assert kwargs["block_runner"] == hook.run
    inner = lambda *a: None  # noqa: E731
    _, kwargs = hook.pre_forward(None, block_runner=inner)
    assert kwargs["block_runner"].func == hook.run and kwargs["block_runner"].keywords == {"inner": inner}
    cache_hook = _RunnerHook(StepCache(StepCacheSettings("first_block"), steps=20))
    with pytest.raises(RuntimeError, match="attached after sequence parallel"):
        cache_hook.pre_forward(None, block_runner=hook.run)


def test_bench_script_parses_and_builds_valid_configs(capsys):
    """bench/parallel.py spawns processes, so only its cheap parts run here (the bench run is by hand)."""
    from bench import parallel as bench_parallel

    with pytest.raises(SystemExit) as exit_info:
        bench_parallel.main(["--help"])
    assert exit_info.value.code == 0 and "usage:" in capsys.readouterr().out
    for argv in ([], ["--quick"], ["--moe", "--hidden", "512", "--heads", "8"]):
        args = bench_parallel.parse_args(argv)
        with torch.device("meta"):  # the config checks run; no weights are allocated
            model = LingBotVideoTransformer3DModel(**bench_parallel.dit_config(args))
        assert model.spec.num_attention_heads % 2 == 0  # both timed layouts split it


def _fake_layout(cfg: int, ulysses: int, rank: int = 0, fsdp: bool = False) -> ParallelLayout:
    """A layout with the shape of a real one and no process groups behind it (checks only)."""
    return ParallelLayout(cfg=cfg, ulysses=ulysses, rank=rank, mesh=object(), fsdp=fsdp)


def test_the_denoise_stage_reaches_parallelism_through_one_entry():
    """`stages.denoise` and the helpers it builds its loop with touch `distributed.stage` through
    `sampling` alone: the checks, the job agreement, FSDP sharding, the cfg rows' guidance, the shared
    step cache, the Ulysses hooks and the step status hang off the object it returns."""
    import ast
    import inspect

    from lingbot_core import stages

    functions = {node.name: node for node in ast.parse(inspect.getsource(stages)).body
                 if isinstance(node, ast.FunctionDef)}
    used = {node.attr for name in ("denoise", "_guidance") for node in ast.walk(functions[name])
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "parallel_stage"}
    assert "sampling" in used and used <= {"sampling", "ParallelSampling"}, sorted(used)


def test_parallel_view_refuses_what_cannot_run_on_several_processes():
    from lingbot_core.distributed import stage as parallel_stage
    from lingbot_core.handle import PipelineHandle

    handle = PipelineHandle.from_components({"transformer": random_dit(DENSE, 0.05)})  # 4 heads
    with pytest.raises(ValueError, match="offload mode 'model' cannot run on several processes"):
        handle.with_offload("model").with_parallel(_fake_layout(2, 2))
    with pytest.raises(ValueError, match="divide the DiT's 4 attention heads"):
        handle.with_parallel(_fake_layout(1, 3))
    with pytest.raises(ValueError, match="no process groups"):
        handle.with_parallel(ParallelLayout(cfg=2, ulysses=1))
    view = handle.with_parallel(_fake_layout(2, 2))
    assert parallel_stage.active_layout(view) is view.parallel and parallel_stage.active_layout(handle) is None
    with pytest.raises(ValueError, match="MagCache calibration runs on one process"):
        parallel_stage.check_request(view, cfg_batch="off", step_cache="magcache_calibrate")
    with pytest.raises(ValueError, match="cfg_batch 'on'"):
        parallel_stage.check_request(view, cfg_batch="on")
    for method in ("off", "first_block", "magcache"):  # a step cache decides alike on every rank (share_step_cache)
        parallel_stage.check_request(view, cfg_batch="auto", step_cache=method)
    # ... but the two cfg rows each decide by their own branch, and FSDP gathers each block over every process
    # (seen on 2 gloo ranks whose rows decided apart: 'collective mismatch', the process aborted)
    sharded = handle.with_parallel(_fake_layout(2, 2, fsdp=True))
    for method in ("first_block", "magcache"):
        with pytest.raises(ValueError, match="a step cache and FSDP with CFG parallel"):
            parallel_stage.check_request(sharded, cfg_batch="auto", step_cache=method)
    parallel_stage.check_request(sharded, cfg_batch="auto", step_cache="off")
    parallel_stage.check_request(handle.with_parallel(_fake_layout(1, 4, fsdp=True)), cfg_batch="auto",
                                 step_cache="first_block")  # one row: its ulysses group decides alike
    parallel_stage.check_request(handle, cfg_batch="on", step_cache="magcache_calibrate")  # one process: fine


def test_process_layout_decides_who_writes():
    from lingbot_core.distributed import stage as parallel_stage

    assert parallel_stage.writes_outputs()
    try:
        parallel_stage.use_process_layout(_fake_layout(1, 2, rank=1))
        assert not parallel_stage.writes_outputs()
        assert not parallel_stage.is_leader(SimpleNamespace(parallel=None))
        parallel_stage.use_process_layout(_fake_layout(1, 2, rank=0))
        assert parallel_stage.writes_outputs() and parallel_stage.is_leader(SimpleNamespace(parallel=None))
    finally:
        parallel_stage.use_process_layout(None)
    frames = parallel_stage.placeholder_frames(5, 32, 48)
    assert frames.shape == (5, 32, 48, 3) and frames.untyped_storage().nbytes() == 4  # no memory behind it


def test_degrees_with_jobs_may_divide_the_world():
    """With --jobs the degrees' product may divide the world (one video per group); without, it must equal it."""
    assert parse_degrees("cfg=1,ulysses=2", 4, split=True) == (1, 2)
    assert parse_degrees("cfg=2", 4, split=True) == (2, 2)  # a missing degree still fills the world
    with pytest.raises(ValueError, match="divide"):
        parse_degrees("ulysses=3", 4, split=True)
    with pytest.raises(ValueError, match="equal"):
        parse_degrees("cfg=1,ulysses=2", 4)


def test_fsdp_plan_shards_bulk_weights_and_keeps_the_float32_set_whole():
    from lingbot_core.distributed.fsdp import shard_plan
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.models.precision import stays_float32

    model = random_dit(MOE, 0.05)
    plan = shard_plan(model)
    assert len(plan.blocks) == MOE["depth"]
    for _, sharded, whole in plan.blocks:
        assert sharded and whole and not any(stays_float32(n) for n in sharded) and all(stays_float32(n) for n in whole)
        assert any("experts" in n for n in sharded) and any("router" in n for n in whole)
    sharded_bytes, whole_bytes = plan.bytes(model)
    assert sharded_bytes + whole_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    handle = PipelineHandle.from_components({"transformer": model})
    with pytest.raises(ValueError, match="offload mode 'sequential' and FSDP do not combine"):
        handle.with_offload("sequential").with_parallel(_fake_layout(2, 2, fsdp=True))


def _moe_sizes():
    """The MoE 30B-A3B's sizes from the shipped transformer config (bf16 DiT; 60 GB, 48 blocks)."""
    import json
    from importlib import resources

    from lingbot_core.placement.estimate import ModelSizes

    cfg = json.loads(resources.files("lingbot_core").joinpath("configs/moe-30b-a3b.transformer.json").read_text())
    dit = int(60.2e9)
    return ModelSizes(text_encoder=int(8.9e9), transformer=dit, vae=int(0.51e9), refiner=dit, hidden=cfg["hidden_size"],
                      depth=cfg["depth"], intermediate=cfg["moe_intermediate_size"] * cfg["num_experts_per_tok"],
                      experts_per_token=cfg["num_experts_per_tok"], largest_block=dit // cfg["depth"],
                      text_largest_layer=int(8.9e9 / 40))


def test_per_gpu_estimate_divides_activations_by_ulysses_and_weights_by_fsdp():
    from lingbot_core.placement.estimate import Geometry, ParallelShare, activation_bytes, estimate_peak

    sizes = _moe_sizes()
    big = Geometry(height=480, width=832, num_frames=121)
    one = activation_bytes(sizes, big)["denoise"]
    before = one
    for degree in (2, 4, 8):
        ranked_sizes, ranked = ParallelShare(ulysses=degree).per_rank(sizes, big)
        share = activation_bytes(ranked_sizes, ranked)["denoise"]
        # 1/degree of the per-token activations, plus the gathered output and the latents every rank holds
        assert one / degree < share < 1.3 * one / degree and share < 0.6 * before, degree
        before = share
    assert ParallelShare(ulysses=1).peak(sizes, big) == estimate_peak("none", sizes, big)  # one process: unchanged
    for world in (2, 4, 8):
        ranked_sizes, _ = ParallelShare(cfg=2, ulysses=world // 2, fsdp=True).per_rank(sizes, big)
        assert ranked_sizes.transformer == sizes.transformer // world + sizes.largest_block
    eight = ParallelShare(cfg=2, ulysses=4, fsdp=True)
    leader, other = eight.peak(sizes, big), eight.peak(sizes, big, leader=False)
    # only rank 0 holds the encoder and the VAE, and runs their phases
    assert leader - other >= sizes.text_encoder + sizes.vae
    alone = estimate_peak("none", sizes, big)
    assert other < alone / 6 and leader < alone / 2, (other / 2**30, leader / 2**30, alone / 2**30)
    # cfg=2 never runs a batch-2 forward: the same per-GPU figure whether cfg_batch was asked or not
    batched = Geometry(height=480, width=832, num_frames=121, cfg_batch=True)
    assert ParallelShare(cfg=2, ulysses=2).peak(sizes, batched) == ParallelShare(cfg=2, ulysses=2).peak(sizes, big)


def test_auto_on_a_parallel_view_is_none_with_the_per_gpu_estimate(monkeypatch):
    from lingbot_core.placement import door
    from lingbot_core.placement.estimate import GiB, ParallelShare
    from lingbot_core.placement.settings import OffloadSettings

    sizes = _moe_sizes()
    monkeypatch.setattr(door.estimate.ModelSizes, "from_checkpoint", classmethod(lambda cls, *a, **k: sizes))
    shared = SimpleNamespace(info=SimpleNamespace(variant="moe"), dtypes={}, loaded={}, weights="auto")
    request = OffloadSettings.make("auto", budget_bytes=80 * GiB, height=480, width=832, num_frames=121)
    for layout, fits in ((_fake_layout(2, 4, fsdp=True), True), (_fake_layout(2, 1), False)):
        settings, choice = door.resolve(shared, request, torch.device("cuda"), layout)
        assert settings.mode == choice.mode == "none" and choice.fits is fits, choice.reason
        assert choice.estimates["none"] == ParallelShare.of(layout).peak(
            sizes, door.estimate.geometry_from(dict(request.options), "moe", None))
        assert "per GPU" in choice.reason


def test_readme_per_gpu_figures_are_the_bench_estimates():
    """The per-GPU figures of docs/parallel.md are what `python bench/parallel.py --estimates` prints."""
    from bench import parallel as bench_parallel

    rows = {r["layout"]: r for r in bench_parallel.estimates()}
    readme = (Path(__file__).resolve().parents[1] / "docs" / "parallel.md").read_text()
    eight = rows["cfg=2,ulysses=4 --fsdp"]
    for quoted in (f"one process ~{rows['cfg=1,ulysses=1']['rank0_gib']:.1f} GiB",
                   f"~{eight['rank0_gib']:.1f} GiB on rank 0", f"~{eight['others_gib']:.1f} GiB on the others"):
        assert quoted in readme, quoted


def test_lora_view_on_four_processes_matches_one_process_and_comes_off(four_ranks):
    got = four_ranks[0]["lora"]
    assert got["lora"] <= T2V_TOLERANCE, got  # the LoRA view, parallel vs one process
    for rank, result in enumerate(four_ranks):
        found = result["lora"]
        assert found["lora_differs"] > 1e-3, (rank, found)  # the LoRA was merged on this rank
        assert found["plain_again"] and found["weights_back"], (rank, found)  # and taken off again, exactly


def test_lora_with_fsdp_matches_one_process_and_comes_off(four_ranks):
    """FSDP leaves each rank some rows of a weight: each rank merges its rows of the LoRA's delta, in
    either order of building the view; the result matches the LoRA in one process, and the shards and
    the plain view are exactly what they were before."""
    for kind in ("dense", "moe"):  # the MoE LoRA has per-expert factors: sharded over the expert dimension
        assert four_ranks[0]["lora_fsdp"][kind]["vs_alone"] <= T2V_TOLERANCE, (kind, four_ranks[0]["lora_fsdp"])
        for rank, result in enumerate(four_ranks):
            got = result["lora_fsdp"][kind]
            assert got["sharded"], (kind, rank)
            assert got["lora_then_fsdp"] > 1e-3 and got["fsdp_then_lora"] > 1e-3, (kind, rank, got)  # it did something
            assert got["weights_back"] and got["plain_again"], (kind, rank, got)


def test_step_cache_on_four_processes_decides_as_one_process(four_ranks):
    """cfg=2 x ulysses=2 with first-block caching: every rank's figures are the one process's for its
    branch (row 0 the conditional, row 1 the unconditional: one process alternates them), so the ranks
    of a ulysses group skip alike; the cached latents match the one-process cached run."""
    alone = four_ranks[0]["step_cache"]
    assert alone["latents"] <= T2V_TOLERANCE and alone["cache_changed"] > 1e-4, alone
    assert len(alone["alone_figures"]) >= 4, alone
    for rank, result in enumerate(four_ranks):
        got = result["step_cache"]
        want = alone["alone_figures"][got["cfg_rank"]::2]
        assert got["figures"] == pytest.approx(want, rel=1e-4), (rank, got, want)


def test_a_rank_failing_between_steps_stops_the_others_at_once(four_ranks):
    """Rank 1 raises after step 2; every other rank ends its denoise with PeerFailed naming rank 1 and
    its error, right after its own step 2 (no collective left waiting), and rank 1 keeps its own error."""
    one = four_ranks[1]["failure"]
    assert one["error"] == "RuntimeError" and "injected failure at step 2" in one["message"], one
    for rank in (0, 2, 3):
        got = four_ranks[rank]["failure"]
        assert got["error"] == "PeerFailed", (rank, got)
        assert "rank 1 failed (RuntimeError: injected failure at step 2)" in got["message"], (rank, got)
        assert "after step 2" in got["message"] and got["steps"] == [1, 2], (rank, got)
        assert got["after_step2_s"] < 5, (rank, got)  # at once: not the group's 30-minute timeout


def _failing_headless(rank: int, world: int, port: int, out: str, model: str) -> None:
    """`lingbot-run t2i --parallel cfg=1,ulysses=2` on this rank (torchrun's variables, a group already
    initialised with gloo's default 30-minute timeout), where rank 1's DiT raises inside a forward (the
    test's patch, inherited through the fork). Its exit code, what it printed on stderr and how long
    it ran go to `out`/rank<N>.json; then the process ends, as a torchrun rank would."""
    import contextlib
    import io
    import os
    import time

    from lingbot_nodes.cli import main

    torch.set_num_threads(1)
    init_loopback_group(rank, world, port)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    errors = io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
        code = main(["t2i", "--model", model, "--parallel", "cfg=1,ulysses=2", "-q", "--output", str(Path(out, "cli"))])
    Path(out, f"rank{rank}.json").write_text(json.dumps({"code": code, "stderr": errors.getvalue(),
                                                         "seconds": time.monotonic() - started}))


def test_a_rank_failing_inside_a_forward_ends_every_headless_rank_at_once(fixtures_root, tmp_path, monkeypatch):
    """Two headless ranks share each forward (ulysses=2); rank 1 raises inside its second forward, where
    rank 0 waits for it in an all-to-all. Both processes end within seconds (not at the group's
    30-minute timeout) with exit code 1, both naming rank 1, its device and its error."""
    from parallel_fakes import fail_inside_forward

    fail_inside_forward(monkeypatch, rank=1, call=4)
    model = str(fixtures_root / "models" / "tiny-dense")
    method = "spawn" if torch.cuda.is_initialized() else "fork"  # spawn would not inherit the patch
    if method == "spawn":
        pytest.skip("CUDA is initialised in this process: the failure is injected through a fork")
    mp.start_processes(_failing_headless, args=(2, free_loopback_port(), str(tmp_path), model), nprocs=2, join=True,
                       start_method=method)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    named = "rank 1 (cpu) failed in the DiT forward of step 1 (RuntimeError: injected failure inside the forward on rank 1)"
    for rank, got in enumerate(results):
        assert got["code"] == 1, (rank, got)
        assert named in " ".join(got["stderr"].split()), (rank, got)
        assert got["seconds"] < 60, (rank, got)
    assert "rank 0 stopped with it" in results[0]["stderr"] and "every rank of the group stops" in results[1]["stderr"]
    assert not list((tmp_path / "cli").rglob("*.png")), "a failed run saves nothing"


def test_a_rank_failing_inside_a_forward_stops_all_four_at_once(four_ranks):
    """Rank 1 raised inside its forward (cfg=2 x ulysses=2): every rank stopped within seconds, rank 2
    too (it never waits on rank 1 itself), each naming rank 1, its device and its error."""
    named = "rank 1 (cpu) failed in the DiT forward of step 1 (RuntimeError: injected failure inside the forward on rank 1)"
    for rank, result in enumerate(four_ranks):
        got = result["forward_failure"]
        assert got["error"] == "GroupBroken" and named in got["message"], (rank, got)
        assert got["seconds"] < 60, (rank, got)  # the group's timeout is 30 minutes


def test_failure_watch_acts_once_on_another_ranks_failure_only():
    """The CUDA ranks' watch (it aborts their NCCL communicators; no GPU here, so its action is recorded
    instead): a failure another rank published fires it once, within its polling interval; this rank's
    own failure does not. The first failure published stays the one every rank reads."""
    import time

    from lingbot_core.distributed.abort import FailureWatch, GroupBroken, publish_failure, published_failure

    store = torch.distributed.HashStore()
    seen: dict[int, list] = {0: [], 1: []}
    with FailureWatch("k", seen[0].append, store=store, interval=0.01, rank=0), \
            FailureWatch("k", seen[1].append, store=store, interval=0.01, rank=1) as other:
        first = publish_failure(RuntimeError("out of memory"), where="in the DiT forward of step 2", device="cuda:0",
                                key="k", store=store)  # no group here: this process is rank 0
        deadline = time.monotonic() + 30
        while other.fired is None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert first.rank == 0 and first.error == "RuntimeError: out of memory"
    assert seen[1] == [first] and seen[0] == []
    later = publish_failure(ValueError("second"), where="x", key="k", store=store)
    assert later == first == published_failure("k", store)
    broken = GroupBroken(first, 1)
    assert publish_failure(broken, where="y", key="k", store=store) is first  # a rank that stopped with it
    assert "rank 0 (cuda:0) failed in the DiT forward of step 2 (RuntimeError: out of memory); rank 1 stopped" in str(broken)


class _TwoBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_fsdp_blocks_are_sharded_again_after_each_forward_on_a_torch_that_keeps_roots_whole(monkeypatch):
    """Each block is sharded on its own, so each is a root to FSDP, and torch 2.7's FSDP does not reshard a
    root after its forward (it drops `reshard_after_forward` for roots; later torch keeps an explicit True):
    after one step every rank held the whole DiT, and the next denoise's `shard_dit` found no sharded
    weight and applied `fully_shard` again, which raises. Torch 2.7's root rule is faked here on this torch
    (one gloo rank; the layout says two so that `shard_dit` shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from lingbot_core.distributed.fsdp import is_fsdp_sharded, shard_dit

    if dist.is_initialized():
        pytest.skip("this process already belongs to a process group")
    real_init = FSDPState._lazy_init

    def roots_stay_whole(self):  # torch 2.7: the root's post-forward mesh is dropped at its lazy init
        fresh = self._is_root is None
        real_init(self)
        if fresh and self._is_root:
            groups = getattr(self, "_fsdp_param_groups", None) or [self._fsdp_param_group]  # 2.7: one group
            for group in filter(None, groups):
                group.post_forward_mesh_info = None

    monkeypatch.setattr(FSDPState, "_lazy_init", roots_stay_whole)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        layout = SimpleNamespace(world_size=2, world_mesh=lambda: mesh)
        model = _TwoBlocks()
        assert shard_dit(model, layout)
        with torch.no_grad():
            want = model(torch.ones(1, 8))
            assert is_fsdp_sharded(model)  # every block sharded again after the forward
            assert not shard_dit(model, layout)  # the next stage finds it sharded: no second fully_shard
            assert torch.equal(model(torch.ones(1, 8)), want)
    finally:
        dist.destroy_process_group()


def test_an_fsdp_dit_moves_under_inference_mode_on_a_torch_whose_dtensor_has_no_to_rule(monkeypatch):
    """ComfyUI and the workflow engine run under inference mode, where `Tensor.to` reaches a DTensor whole, as
    `aten.to.dtype_layout`; torch 2.7's DTensor has no sharding rule for it (later torch decomposes it), so
    the door's move of a sharded DiT (`none`'s acquire) raised NotImplementedError and every FSDP denoise
    failed (lingbot-run --fsdp, an FSDP pool). The DiT is sharded and moved outside inference mode. Torch
    2.7's missing rule is faked here on this torch (one gloo rank; the layout says two)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lingbot_core.distributed.fsdp import is_fsdp_sharded, shard_dit

    if dist.is_initialized():
        pytest.skip("this process already belongs to a process group")
    dispatcher = DTensor._op_dispatcher
    real = getattr(dispatcher, "_propagate_op_sharding_dispatch_slow_path", None)

    def without_to_rule(op_call, *args, **kwargs):  # torch 2.7: no rule, and no decomposition either
        if op_call is torch.ops.aten.to.dtype_layout:
            raise NotImplementedError("Operator aten.to.dtype_layout does not have a sharding strategy registered.")
        return real(op_call, *args, **kwargs)

    if real is not None:  # newer torch; torch 2.7 itself raises
        monkeypatch.setattr(dispatcher, "_propagate_op_sharding_dispatch_slow_path", without_to_rule)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        layout = SimpleNamespace(world_size=2, world_mesh=lambda: mesh)
        dit = random_dit(DENSE, 0.05)
        with torch.inference_mode():
            assert shard_dit(dit, layout)  # as distributed.stage.shard_for_stage does inside a stage
            assert dit.to("cpu") is dit  # as the door's `none` acquire does
        assert is_fsdp_sharded(dit)
    finally:
        dist.destroy_process_group()


def test_cfg_batch_auto_batches_alike_on_every_process(monkeypatch):
    """`cfg_batch=auto` decides from the process's own memory (its GPU's size, what it holds: rank 0 also the
    encoders), but the processes of a parallel run share every forward: one rank's batch-2 forward met
    another's two forwards (2 gloo ranks where rank 1 alone expected batch 2 to fit: 'collective mismatch',
    the process aborted). On several processes `auto` runs two forwards; `on` batches on all of them."""
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.placement import door, plan
    from lingbot_core.placement.estimate import Geometry

    monkeypatch.setattr(plan, "cfg_batch_auto", lambda *a, **k: (True, "batch 2 fits this GPU"))
    handle = PipelineHandle.from_components({"transformer": random_dit(DENSE, 0.05)})
    for view, batched in ((handle, True), (handle.with_parallel(_fake_layout(1, 2)), False)):
        with door.stage(view, "transformer", geometry=Geometry(32, 32, 5, cfg=True)):
            auto = door.sampling_figures(view, "transformer", packed=False, cfg_batch="auto", splits_cfg=False,
                                         set_on_model=None)
            on = door.sampling_figures(view, "transformer", packed=False, cfg_batch="on", splits_cfg=False,
                                       set_on_model=None)
        assert (auto.cfg_batch, on.cfg_batch) == (batched, True)
        assert batched or "processes of a parallel run" in auto.cfg_batch_why


def test_a_cpu_pipe_in_an_nccl_run_is_refused_before_work(monkeypatch):
    """Under torchrun on a GPU machine the processes join over NCCL (`init_from_env`), whatever device the
    workflow's Loader names: a pipe on the CPU reached the first all-to-all with CPU tensors, which NCCL cannot
    send (a crash in the DiT's first forward). Refused in one line at the denoise; NCCL faked (a label)."""
    from lingbot_core.distributed import stage as parallel_stage
    from lingbot_core.handle import PipelineHandle

    view = PipelineHandle.from_components({"transformer": random_dit(DENSE, 0.05)}).with_parallel(_fake_layout(1, 2))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    parallel_stage.check_request(view, cfg_batch="auto")  # gloo: the CPU is its device
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="over NCCL, on their GPUs, but the pipe runs on cpu"):
        parallel_stage.check_request(view, cfg_batch="auto")
    parallel_stage.check_request(PipelineHandle.from_components({"transformer": random_dit(DENSE, 0.05)}),
                                 cfg_batch="auto")  # one process: nothing to refuse
