"""LingBot Parallel's worker pool (issue 24, inside ComfyUI): this process is rank 0, one spawned worker
is rank 1 (gloo on the loopback), on the tiny MoE checkpoint (base DiT and refiner).

One lifecycle test spawns twice (each spawn costs an interpreter start): start, two runs on one load,
a TI2V run through a LingBot Offload view, a LoRA, a step cache, a Refine, an interrupt mid-denoise, LingBot Release; then a lazy restart, a killed worker (one clear error) and
the single-device path afterwards. The ComfyUI "Unload models" wiring is checked on a stand-in pool.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import types

import pytest
import torch
from parallel_fakes import fail_inside_forward

from lingbot_core import lora as lora_ops
from lingbot_core import stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.worker_pool import pool as pool_module
from lingbot_core.worker_pool import spec as spec_module
from lingbot_core.worker_pool.pool import pool_of, stages_for
from lingbot_core.worker_pool.spec import PoolError, PoolSpec, parse_devices
from lingbot_nodes import NODE_CLASS_MAPPINGS

KW = dict(height=32, width=32, num_frames=5, steps=3, guidance_scale=3.0, shift=3.0, seed=7)
TOLERANCE = 1e-5  # relative; CFG parallel is exact up to float rounding


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max() / b.abs().max()) <= TOLERANCE


def _denoise(pipe, cond, **kwargs) -> torch.Tensor:
    """What LingBot Denoise runs: the pipe's pool, or the stages in this process."""
    return stages_for(pipe).denoise(pipe, cond, **kwargs)


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_pool_start_reuse_interrupt_release_restart_and_a_dead_worker(fixtures_root, monkeypatch, tmp_path):
    from lingbot_core.worker_pool import pool as pool_module

    monkeypatch.setattr(pool_module, "START_METHOD", "fork")  # ComfyUI spawns; fork saves the interpreter start
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")  # it has a refiner
    cond = stages.encode_prompt(handle, "a red paper boat on a canal")
    expected = stages.denoise(handle, cond, **KW)

    pipe, = NODE_CLASS_MAPPINGS["LingBotParallel"].execute(handle, "cpu, cpu", "2", 0).args
    pool = pool_of(pipe)
    assert pool is not None and pool.started and pool.starts == 1 and pool.layout.cfg == 2
    assert stages_for(pipe) is pool and stages_for(handle) is stages  # the pipe carries where its sampling runs
    restarted = []
    pool.on_start.append(restarted.append)  # the node's own hook (ComfyUI's listing) is in there too
    first = _denoise(pipe, cond, **KW)
    second = _denoise(pipe, cond, **KW)
    assert _close(first, expected) and torch.equal(first, second)
    assert [w["loads"]["transformer"] for w in pool.ping()] == [1]  # the worker loaded its DiT once

    # a LingBot Offload view of the pipe ('auto' is 'none' on the workers) keeps the pool; TI2V crosses as
    # the drawn first-frame latent plus the generator after the draw (same noise as one process)
    view, = NODE_CLASS_MAPPINGS["LingBotOffload"].execute(pipe, "auto").args
    assert pool_of(view) is pool
    image_cond = stages.encode_image(handle, torch.rand(1, 40, 36, 3, generator=torch.Generator().manual_seed(3)),
                                     32, 32)
    i2v = stages.encode_prompt(handle, "a red paper boat on a canal", image=image_cond, mode="ti2v")
    alone = stages.denoise(handle, i2v, image_cond=image_cond, **KW)
    assert _close(_denoise(view, i2v, image_cond=image_cond, **KW), alone)
    # a LoRA on the pipe: the workers read the same file and merge it like rank 0 (equal to one process)
    path = _lora_file(tmp_path, handle)
    with_q = stages.denoise(lora_ops.with_lora(handle, path, 0.7), cond, **KW)
    assert not _close(with_q, expected)  # the LoRA changes the result
    assert _close(_denoise(lora_ops.with_lora(pipe, path, 0.7), cond, **KW), with_q)
    assert torch.equal(_denoise(pipe, cond, **KW), first)  # and comes off again, on every rank
    # a step cache crosses as its settings; each cfg row keeps its branch's state (as one process does)
    from lingbot_core.sampling.step_cache import StepCacheSettings

    cached = dict(KW, steps=10, step_cache=StepCacheSettings("first_block", threshold=1e9, warmup_steps=2, max_skips=3))
    alone_cached = stages.denoise(handle, cond, **cached)
    assert not _close(alone_cached, stages.denoise(handle, cond, **dict(KW, steps=10)))  # it skipped
    assert _close(_denoise(pipe, cond, **cached), alone_cached)
    # Refine on the pipe: the refiner's sampling on the workers (each loads the refiner once), exact vs one process
    frames = torch.rand(5, 24, 24, 3, generator=torch.Generator().manual_seed(4))
    refined = NODE_CLASS_MAPPINGS["LingBotRefine"].execute(pipe, cond, 32, 32, 2, 0.85, 3.0, 3.0, 1, images=frames,
                                                           release_base="off").args[0]["samples"]
    assert [w["loads"]["refiner"] for w in pool.ping()] == [1]
    from lingbot_core.latents import dit_to_vae

    alone = stages.refine(handle, frames, cond, height=32, width=32, steps=2, t_thresh=0.85, guidance_scale=3.0,
                          shift=3.0, seed=1, decode_output=False)
    assert _close(refined, dit_to_vae(alone, handle.vae_config()))

    seen = []

    def interrupt_at_two(step, total, latents):
        seen.append(step)
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _denoise(pipe, cond, callback=interrupt_at_two, **KW)
    # ComfyUI's interrupt check, raising as soon as it is asked: rank 0 must not ask it between the DiT's
    # blocks (the workers would be left inside the forward's collectives and the pool ended), only at a step
    from lingbot_core.interrupt import interrupt_checker

    def interrupted():
        raise KeyboardInterrupt

    with interrupt_checker(interrupted), pytest.raises(KeyboardInterrupt):
        _denoise(pipe, cond, callback=lambda step, total, latents: interrupted(), **KW)
    assert pool.started and pool.starts == 1
    assert seen == [1, 2] and pool.started  # the worker dropped the call at that step; the pool stays
    assert torch.equal(_denoise(pipe, cond, **KW), first)
    assert pool.starts == 1 and [w["loads"]["transformer"] for w in pool.ping()] == [1]

    pids = pool.worker_pids()
    NODE_CLASS_MAPPINGS["LingBotRelease"].execute(pipe, "v", "all")
    assert not pool.started and all(_gone(pid) for pid in pids)

    assert torch.equal(_denoise(pipe, cond, **KW), first)  # the cached pipe starts new workers
    assert pool.starts == 2 and restarted == [pool]
    victim = pool.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.5)  # a killed child stays a zombie until the pool looks at it (reaped then)
    with pytest.raises(PoolError, match=r"worker for cpu \(rank 1\) is gone .* without LingBot Parallel works"):
        _denoise(pipe, cond, **KW)
    assert not pool.started
    assert torch.equal(stages.denoise(handle, cond, **KW), expected)  # the single-device path is untouched


def test_a_rank_failing_inside_a_forward_stops_the_call_at_once_and_is_named(fixtures_root, monkeypatch, tmp_path):
    """cfg=1 x ulysses=2 (all-to-alls inside every block): the worker raises inside its second forward,
    where rank 0 waits for it in a collective. Rank 0 gets a PoolError naming the worker's device,
    rank and error within seconds (the group's timeout is COLLECTIVE_TIMEOUT, 30 minutes), the handle
    denoises alone as before and the next call starts new workers. Then the same with rank 0 failing
    (the workers, left waiting in a collective, are ended at once), and with a worker failing before
    its forward, where rank 0 already waits."""
    monkeypatch.setattr(pool_module, "START_METHOD", "fork")
    assert spec_module.COLLECTIVE_TIMEOUT.total_seconds() >= 600
    from lingbot_core.worker_pool.pool import WorkerPool, tag

    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    cond = stages.encode_prompt(handle, "a red paper boat on a canal")
    expected = stages.denoise(handle, cond, **KW)
    armed = fail_inside_forward(monkeypatch, rank=1, call=4)
    pool = WorkerPool(PoolSpec.make(handle, "cpu,cpu", 1))
    pipe = tag(handle, pool)
    pool.start()
    started = time.monotonic()
    with pytest.raises(PoolError, match=r"the worker for cpu \(rank 1\) failed in the DiT forward of step 1 "
                                        r"\(RuntimeError: injected failure inside the forward on rank 1\)"):
        _denoise(pipe, cond, **KW)
    assert time.monotonic() - started < 60  # seconds, not the backend's timeout
    assert not pool.started
    assert torch.equal(stages.denoise(handle, cond, **KW), expected)  # the single-device path is untouched

    armed.clear()  # the next workers are forked without the failure
    assert _close(_denoise(pipe, cond, **KW), expected)
    assert pool.starts == 2 and pool.started

    armed.append(0)  # now rank 0 (this process) fails inside a forward; the worker waits in a collective
    workers = pool.worker_pids()
    started = time.monotonic()
    with pytest.raises(PoolError, match=r"failed on rank 0 \(cpu\) in the DiT forward of step \d \(RuntimeError: "
                                        "injected failure inside the forward on rank 0"):
        _denoise(pipe, cond, **KW)
    assert time.monotonic() - started < 60 and all(_gone(pid) for pid in workers)
    armed.clear()
    assert torch.equal(stages.denoise(handle, cond, **KW), expected)
    assert _close(_denoise(pipe, cond, **KW), expected) and pool.starts == 3

    # a failure in a worker's own preparation (it reads the LoRA file again; rank 0 keeps its copy and goes
    # on into the forward): named too, even as a ValueError, which a refused input on every rank would be
    view = lora_ops.with_lora(pipe, _lora_file(tmp_path, handle), 0.7)
    (tmp_path / "q.safetensors").write_bytes(b"no longer a LoRA")
    with pytest.raises(PoolError, match=r"the worker for cpu \(rank 1\) failed preparing denoise"):
        _denoise(view, cond, **KW)
    pool.release()


def test_an_fsdp_pool_shards_its_own_copy_and_matches_one_device(fixtures_root, monkeypatch, tmp_path):
    """LingBot Parallel with fsdp on: every rank (this process on a handle of the pool's own) shards the
    DiT's blocks; a denoise, a LoRA on the pipe and a Refine equal one device; the Loader's handle keeps
    its whole DiT (the pipe without LingBot Parallel runs as before); fp8 weights are refused up front."""
    from torch.distributed.tensor import DTensor

    from lingbot_core.distributed.fsdp import is_fsdp_sharded
    from lingbot_core.latents import dit_to_vae

    monkeypatch.setattr(pool_module, "START_METHOD", "fork")
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")
    cond = stages.encode_prompt(handle, "a red paper boat on a canal")
    expected = stages.denoise(handle, cond, **KW)
    pipe, = NODE_CLASS_MAPPINGS["LingBotParallel"].execute(handle, "cpu, cpu", "2", 0, "on").args
    pool = pool_of(pipe)
    assert pool.spec.fsdp and pool.layout.fsdp
    assert _close(_denoise(pipe, cond, **KW), expected)
    own = pool._own.component("transformer")
    assert is_fsdp_sharded(own) and not is_fsdp_sharded(handle.component("transformer"))
    assert not any(isinstance(p, DTensor) for p in handle.component("transformer").parameters())
    path = _lora_file(tmp_path, handle)
    assert _close(_denoise(lora_ops.with_lora(pipe, path, 0.7), cond, **KW),
                  stages.denoise(lora_ops.with_lora(handle, path, 0.7), cond, **KW))
    frames = torch.rand(5, 24, 24, 3, generator=torch.Generator().manual_seed(4))
    refined = NODE_CLASS_MAPPINGS["LingBotRefine"].execute(pipe, cond, 32, 32, 2, 0.85, 3.0, 3.0, 1, images=frames,
                                                           release_base="off").args[0]["samples"]
    alone = stages.refine(handle, frames, cond, height=32, width=32, steps=2, t_thresh=0.85, guidance_scale=3.0,
                          shift=3.0, seed=1, decode_output=False)
    assert _close(refined, dit_to_vae(alone, handle.vae_config()))
    assert is_fsdp_sharded(pool._own.component("refiner"))
    assert [w["resident"] for w in pool.ping()] == [["transformer", "refiner"]]
    # release_base on: the base DiT goes before the refiner samples, here and on every worker
    again = NODE_CLASS_MAPPINGS["LingBotRefine"].execute(pipe, cond, 32, 32, 2, 0.85, 3.0, 3.0, 1, images=frames,
                                                         release_base="on").args[0]["samples"]
    assert torch.equal(again, refined)
    assert [w["resident"] for w in pool.ping()] == [["refiner"]]
    assert "transformer" not in pool._own.shared.loaded and "transformer" not in handle.shared.loaded
    assert torch.equal(stages.denoise(handle, cond, **KW), expected)  # the plain pipe, whole, as before
    pool.release()
    assert pool._own is None
    fp8 = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu", weights="fp8_e4m3")
    with pytest.raises(ValueError, match="fsdp shards plain"):
        PoolSpec.make(fp8, "cpu,cpu", 2, fsdp=True)


def test_views_of_a_parallel_pipe_keep_the_pool_or_are_refused(fixtures_root, tmp_path):
    """No spawn: the pool is never started, every refusal comes before anything is sent."""
    from dataclasses import replace

    from lingbot_core.lora import LoraFile, with_lora
    from lingbot_core.placement.settings import OffloadSettings
    from lingbot_core.worker_pool.pool import WorkerPool, tag
    from lingbot_core.worker_pool.spec import pooled_loras

    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    pool = WorkerPool(PoolSpec.make(handle, "cpu,cpu", 1))
    pipe = tag(handle, pool)
    assert pool_of(handle) is None and pool_of(pipe) is pool
    assert pool_of(pipe.with_offload("none")) is pool and pool_of(pipe.with_offload("auto")) is pool
    with pytest.raises(ValueError, match="does not run on LingBot Parallel's workers"):
        pipe.with_offload("model")
    assert pool_of(handle.with_offload("model")) is None  # the plain pipe offloads as before
    path = _lora_file(tmp_path, handle)
    view = with_lora(pipe, path, 0.5, apply_to="transformer")
    assert pool_of(view) is pool  # a LoRA view keeps the pool; the workers get the file and its settings
    (row,) = pooled_loras(view)
    assert row[0] == str(path.resolve()) and row[1] == path.stat().st_size and row[3:] == [0.5, "transformer"]
    cond = stages.encode_prompt(handle, "a red paper boat on a canal")
    from safetensors.torch import load_file

    in_memory = LoraFile.from_state_dict(load_file(path), name="hand-made")
    refused = [(replace(pipe, offload=OffloadSettings.make("sequential")), "'sequential' does not run"),
               (pipe.with_view_state(_OtherState()), "carries other"),
               (with_lora(pipe, in_memory, 1.0, apply_to="transformer"), "not read from a file")]
    for bad, message in refused:
        with pytest.raises(ValueError, match=message):  # a view built past the checks: refused at the call
            _denoise(bad, cond, **KW)
    assert not pool.started and pool.starts == 0


class _OtherState:
    kind = "other"


def _lora_file(folder, handle):
    """A small LoRA on the base DiT's first attention query (its shape from the handle's DiT)."""
    from safetensors.torch import save_file

    rows, cols = dict(handle.component("transformer").named_parameters())["blocks.0.attn.to_q.weight"].shape
    g = torch.Generator().manual_seed(5)
    path = folder / "q.safetensors"
    save_file({"blocks.0.attn.to_q.lora_A.weight": torch.randn(2, cols, generator=g),
               "blocks.0.attn.to_q.lora_B.weight": torch.randn(rows, 2, generator=g)}, path)
    return path


def test_unload_models_stops_a_pool_and_a_memory_request_does_not(monkeypatch):
    from lingbot_nodes import runtime

    class Pool:
        releases = 0

        def release(self):
            Pool.releases += 1

    mm = types.ModuleType("comfy.model_management")
    mm.current_loaded_models = []
    mm.get_torch_device = lambda: torch.device("cpu")
    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    pool = Pool()
    runtime.track_pool(pool)
    runtime.track_pool(pool)
    entry, = mm.current_loaded_models  # listed once
    assert entry.device == torch.device("cpu") and entry.model_memory() == 0
    assert entry.model_unload(2 << 30) is False and Pool.releases == 0  # 2 GiB wanted here: workers stay
    assert entry.model_unload(1e30) is True and Pool.releases == 1  # unload_all_models


def test_a_pool_restarted_after_unload_models_is_listed_again(monkeypatch):
    """ComfyUI serves a LingBot Parallel node from its cache after "Unload models" stopped its pool, and
    the next Denoise restarts the same pool: the restart lists it again, so the next unload stops it too."""
    from lingbot_core.worker_pool.pool import WorkerPool
    from lingbot_nodes import runtime

    mm = types.ModuleType("comfy.model_management")
    mm.current_loaded_models = []
    mm.get_torch_device = lambda: torch.device("cpu")
    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    pool = WorkerPool.__new__(WorkerPool)  # no spec, no processes: only its start hooks run here
    pool.on_start, released = [], []
    pool.release = lambda: released.append(1)
    runtime.track_pool(pool)
    entry, = mm.current_loaded_models
    assert entry.model_unload(1e30) is True and released == [1]
    mm.current_loaded_models.remove(entry)  # as free_memory does with an unloaded entry
    for hook in pool.on_start:  # what WorkerPool.start runs once the new workers are up
        hook(pool)
    entry, = mm.current_loaded_models
    assert entry.real_model() is pool and entry.model_unload(1e30) is True and released == [1, 1]


def test_devices_and_degrees_are_checked_before_any_process_starts(fixtures_root):
    assert parse_devices("0, 1") == ("cuda:0", "cuda:1") and parse_devices("cpu,cpu") == ("cpu", "cpu")
    for bad, message in (("cpu,cuda:1", "mixes"), ("cuda:1,1", "twice"), ("tpu", "not a device"),
                         ("cuda", "name the GPU")):
        with pytest.raises(ValueError, match=message):
            parse_devices(bad)
    with pytest.raises(ValueError, match="CPU processes asked for"):  # a workflow cannot fork the server away
        parse_devices(",".join(["cpu"] * (max(spec_module.MAX_CPU_RANKS, os.cpu_count() or 1) + 1)))
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    with pytest.raises(ValueError, match="two or more"):
        PoolSpec.make(handle, "cpu", 1)
    with pytest.raises(ValueError, match="must equal"):
        PoolSpec.make(handle, "cpu,cpu,cpu", 2, 1)
    # ulysses on auto: the message names what auto chose from the devices and cfg the user set, never a
    # "ulysses=3" they did not write
    with pytest.raises(ValueError, match=r"3 devices do not split into 2 CFG branches") as odd:
        PoolSpec.make(handle, "cpu,cpu,cpu", 2)
    with pytest.raises(ValueError, match=r"ulysses on auto chose 3 \(3 devices / cfg 1\).*divide") as heads:
        PoolSpec.make(handle, "cpu,cpu,cpu", 1)  # ulysses 3 and the tiny DiT's heads
    assert all("ulysses=" not in str(err.value) for err in (odd, heads))
    assert str(heads.value).endswith("2 attention heads: list 2 devices")  # the tiny DiT has 2 heads
    spec = PoolSpec.make(handle, "cpu,cpu", 1)
    assert (spec.cfg, spec.ulysses, spec.backend) == (1, 2, "gloo")
    assert spec.checkpoint["folder"] == str(handle.folder)  # paths and settings cross, not modules


def test_workers_open_their_handle_with_the_pipes_decoder_and_fp8_matmul(fixtures_root):
    """The description a worker opens its handle from carries the settings of the Loader's handle."""
    from lingbot_core.worker_pool.spec import describe_handle, open_described

    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu", decoder="eager",
                                 fp8_matmul="auto")
    description = describe_handle(handle)
    assert (description["decoder"], description["fp8_matmul"]) == ("eager", "auto")
    worker = open_described(description, "cpu")
    assert (worker.shared.decoder, worker.shared.fp8_matmul) == ("eager", "auto") and not worker.shared.loaded


def test_spawned_workers_do_not_rerun_the_main_script(monkeypatch):
    """ComfyUI's main.py works at import; a spawned child would import it again unless it is hidden."""
    from lingbot_core.worker_pool.pool import _main_module_hidden

    main = types.ModuleType("__main__")
    main.__file__, main.__spec__ = "comfy/main.py", object()
    monkeypatch.setitem(sys.modules, "__main__", main)
    spec = main.__spec__
    with _main_module_hidden():
        assert not hasattr(main, "__file__") and main.__spec__ is None
    assert main.__file__ == "comfy/main.py" and main.__spec__ is spec
