"""The failure path of a parallel run on CUDA devices, tested on the CPU (issue 30, item 2): a one-rank
gloo world, the device only a label ("cuda"), so `StepStatus` takes its CUDA branch (abort the
communicators) with no GPU; and which `ValueError`s are refused inputs (exit code 2) and which are
failures of the run (exit code 1)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lingbot_core import exit_codes
from lingbot_core.distributed import abort
from lingbot_core.distributed.abort import Failure, GroupBroken, StepStatus, failure_key
from lingbot_core.errors import RefusedInput, is_refused_input


@pytest.fixture
def one_rank_world():
    """A gloo world of this process alone (an in-memory store); left afterwards whatever the test did."""
    if dist.is_initialized():
        pytest.skip("this process already belongs to a process group")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield store
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _whole_world_layout():
    return SimpleNamespace(group=None, world_size=1, leader_rank=0, mesh=None)


def test_a_cuda_rank_failing_inside_a_forward_gets_group_broken_naming_it(one_rank_world, tmp_path):
    """The reproduction: on a CUDA device `broken` aborted every group (clearing the default one) and then
    asked torch for the rank, which raised torch's own ValueError (exit code 2, the failure recorded as
    rank 0's, LingBot Parallel keeping the broken pool). Now: `GroupBroken` naming this rank, exit 1."""
    status = StepStatus(_whole_world_layout(), device="cuda")
    got = status.broken(3, RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert isinstance(got, GroupBroken), repr(got)
    assert got.failure == Failure(0, "cuda", "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB",
                                  "in the DiT forward of step 3")
    assert "rank 0 (cuda) failed in the DiT forward of step 3" in str(got)
    assert exit_codes.exit_code(got) == exit_codes.FAILED and got.stops_group
    assert dist.get_rank() == 0  # the process group is still this process's to destroy (the caller leaves it)

    # --jobs: the batch stops at the job that broke the group (it went on to the next job on the aborted group)
    from lingbot_core.workflow.errors import NodeExecutionError
    from lingbot_nodes.jobs import Job, Manifest, run_jobs

    ran = []

    def run_one(job):
        ran.append(job.id)
        if job.id == "j0":
            raise NodeExecutionError("4", "LingBotDenoise", str(got)) from got  # as the engine wraps it
        return []

    with pytest.raises(NodeExecutionError):
        run_jobs([Job("j0", 1), Job("j1", 2)], run_one, Manifest(tmp_path / "m.jsonl"))
    assert ran == ["j0"]


def test_group_broken_names_the_first_failing_rank_not_this_one(one_rank_world):
    """Another rank published its failure first (in the group's store): this rank's collective error is
    reported as that failure, with this rank's number as the one that stopped with it."""
    layout = _whole_world_layout()
    first = Failure(1, "cuda:1", "RuntimeError: out of memory", "in the DiT forward of step 2")
    abort.publish_failure(RuntimeError("out of memory"), where=first.where, device=first.device, rank=1,
                          key=failure_key(layout))
    status = StepStatus(layout, device="cuda")
    got = status.broken(2, RuntimeError("NCCL communicator was aborted on rank 0"))
    assert isinstance(got, GroupBroken) and got.failure == first, repr(got)
    assert "rank 1 (cuda:1) failed in the DiT forward of step 2" in str(got) and "rank 0 stopped with it" in str(got)


def test_only_the_layouts_own_groups_are_aborted(one_rank_world, monkeypatch):
    """The layout's video group (the default group for a whole-world layout) and its mesh's groups are
    aborted; a group of the same process that is not the layout's is left alone."""
    from torch.distributed import distributed_c10d
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("cfg", "ulysses"))
    layout = SimpleNamespace(group=None, world_size=1, leader_rank=0, mesh=mesh)
    other = dist.new_group([0])
    aborted = []
    monkeypatch.setattr(abort, "_abort_group", aborted.append)
    StepStatus(layout, device="cuda").broken(1, RuntimeError("boom"))
    own = {id(g) for g in mesh.get_all_groups()} | {id(distributed_c10d._get_default_group())}
    assert {id(g) for g in aborted} == own and id(other) not in {id(g) for g in aborted}
    StepStatus(layout, device="cpu").broken(1, RuntimeError("boom"))  # gloo: a rank that leaves ends them
    assert len(aborted) == len(own)


def _torch_value_error() -> ValueError:
    try:
        dist.get_rank(group=object())  # torch refuses this group: its ValueError, raised in its own code
    except ValueError as err:
        return err
    raise AssertionError("torch accepted a group it cannot know")


def test_a_librarys_value_error_is_a_failure_and_ours_is_a_refused_input():
    """Exit code 2 is for what the user passed; a ValueError raised inside a library while running
    (torch.distributed's, here) is a failure of the run: exit code 1."""
    from lingbot_core.worker_pool.spec import parse_devices

    library = _torch_value_error()
    assert not is_refused_input(library) and exit_codes.exit_code(library) == exit_codes.FAILED
    with pytest.raises(ValueError) as ours:
        parse_devices("tpu")  # a plain ValueError raised by our own code
    assert is_refused_input(ours.value) and exit_codes.exit_code(ours.value) == exit_codes.BAD_INPUT
    try:
        raise RefusedInput("steps: 0; give 1 or more")
    except RefusedInput as err:
        assert is_refused_input(err) and exit_codes.exit_code(err) == exit_codes.BAD_INPUT
    assert not is_refused_input(RuntimeError("x")) and exit_codes.exit_code(torch.cuda.OutOfMemoryError()) == 1


def _cond(handle):
    """Random prompt embeddings of the DiT's text width (the text encoder is not what is tested)."""
    from lingbot_core.prompt import PromptEmbeds
    from lingbot_core.stages import Conditioning

    g = torch.Generator().manual_seed(4)
    width = handle.info.transformer_config["text_dim"]
    embeds = PromptEmbeds(torch.randn(1, 7, width, generator=g), torch.ones(1, 7, dtype=torch.int64),
                          torch.zeros(1, 7, dtype=torch.int64))
    return Conditioning(embeds, embeds)


def test_a_pool_call_failing_on_rank_0_or_losing_a_worker_stops_the_pool_with_pool_error(fixtures_root, monkeypatch):
    """LingBot Parallel (this process rank 0, one forked worker, cfg=2): (1) a library's ValueError on
    rank 0 in the middle of a call (here json's, from a sampler step) is a failure, not a refused input:
    the pool stops with PoolError naming rank 0 and its error (it was kept, with its worker gone);
    (2) a worker killed in the middle of a call gives PoolError naming its rank and device (it was a
    raw TypeError: the worker list was emptied before the dead worker's rank was looked up)."""
    import json
    import os
    import signal

    from lingbot_core.handle import PipelineHandle
    from lingbot_core.sampling import guidance
    from lingbot_core.worker_pool import pool as pool_module
    from lingbot_core.worker_pool.pool import WorkerPool, stages_for, tag
    from lingbot_core.worker_pool.spec import PoolError, PoolSpec

    monkeypatch.setattr(pool_module, "START_METHOD", "fork")
    kw = dict(height=32, width=32, num_frames=5, steps=2, guidance_scale=3.0, shift=3.0, seed=7)
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    cond = _cond(handle)
    pool = WorkerPool(PoolSpec.make(handle, "cpu,cpu", 2))
    pipe = tag(handle, pool)
    pool.start()
    try:
        real_pin = guidance.pin_first_frames

        def pin_failing_here(latents, cond_latent):  # after the step, on rank 0 only (the worker is forked before)
            json.loads("{not json")
            return real_pin(latents, cond_latent)

        monkeypatch.setattr(guidance, "pin_first_frames", pin_failing_here)
        with pytest.raises(PoolError, match=r"denoise failed on rank 0 \(cpu\).*JSONDecodeError"):
            stages_for(pipe).denoise(pipe, cond, **kw)
        assert not pool.started
        monkeypatch.setattr(guidance, "pin_first_frames", real_pin)

        def kill_the_worker(step, total, latents):
            if step == 1:
                os.kill(pool.worker_pids()[0], signal.SIGKILL)

        with pytest.raises(PoolError, match=r"the worker for cpu \(rank 1\) died during denoise"):
            stages_for(pipe).denoise(pipe, cond, callback=kill_the_worker, **kw)
        assert not pool.started and pool.starts == 2
    finally:
        pool.release()


def test_the_pool_sets_nccl_error_handling_before_its_workers_start(monkeypatch):
    """The workers inherit the environment as it is when they start: TORCH_NCCL_ASYNC_ERROR_HANDLING=2
    (abort the communicators on an error, never end the process) must be set by then (it was set only
    after the workers started). A value the user set is kept. No process starts here."""
    import torch.multiprocessing as mp

    from lingbot_core.worker_pool import pool as pool_module
    from lingbot_core.worker_pool.pool import WorkerPool
    from lingbot_core.worker_pool.spec import PoolSpec

    seen = []

    class Started(Exception):
        pass

    class Process:
        def __init__(self, **kwargs):
            pass

        def start(self):
            seen.append(pool_module.os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))
            raise Started

    ctx = SimpleNamespace(Array=lambda kind, values: list(values), Process=Process)
    monkeypatch.setattr(mp, "get_context", lambda method: ctx)
    spec = PoolSpec(("cuda:0", "cuda:1"), 2, 1, {})
    for preset, expected in ((None, "2"), ("1", "1")):
        environ = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
        if preset is not None:
            environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = preset
        monkeypatch.setattr(pool_module.os, "environ", environ)
        with pytest.raises(Started):
            WorkerPool(spec).start()
        assert seen[-1] == expected


def _listening(pids: list[int]) -> set[str]:
    """The local addresses ("ip:port") of the TCP sockets in LISTEN state that processes `pids` hold
    (/proc/net/tcp and tcp6, matched to the processes' socket inodes)."""
    import ipaddress

    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows = [line.split() for line in f.read().splitlines()[1:]]
        for row in rows:
            if row[3] != "0A" or row[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = row[1].split(":")
            raw = bytes.fromhex(hex_ip)
            # the kernel writes each 32-bit word of the address in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(f"{ipaddress.ip_address(raw)}:{int(hex_port, 16)}")
    return found


def _loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    ip = ip.ipv4_mapped or ip if ip.version == 6 else ip
    return ip.is_loopback


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or not os.path.exists("/proc/net/tcp"),
                    reason="reads the sockets from /proc (Linux)")
def test_nothing_the_pool_or_a_loopback_group_listens_on_is_beyond_loopback(fixtures_root, monkeypatch):
    """LingBot Parallel's rendezvous store and gloo's connections: every socket this process and its
    workers listen on after the pool started is on a loopback address (torch's own TCPStore server
    bound every address: reachable from the network for the pool's lifetime). The same for the
    groups `distributed.launch.init_loopback_group` starts (tests, benches)."""
    from lingbot_core.distributed.launch import free_loopback_port, init_loopback_group
    from lingbot_core.handle import PipelineHandle
    from lingbot_core.worker_pool import pool as pool_module
    from lingbot_core.worker_pool.pool import WorkerPool
    from lingbot_core.worker_pool.spec import PoolSpec

    monkeypatch.setattr(pool_module, "START_METHOD", "fork")
    before = _listening([os.getpid()])
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    pool = WorkerPool(PoolSpec.make(handle, "cpu,cpu", 2))
    pool.start()
    try:
        opened = _listening([os.getpid(), *pool.worker_pids()]) - before
    finally:
        pool.release()
    assert opened and all(_loopback(a) for a in opened), opened

    if dist.is_initialized():
        pytest.skip("this process already belongs to a process group")
    init_loopback_group(0, 1, free_loopback_port())
    try:
        opened = _listening([os.getpid()]) - before
    finally:
        dist.destroy_process_group()
    assert opened and all(_loopback(a) for a in opened), opened


def test_fewer_gpus_than_local_ranks_is_refused_in_one_line(monkeypatch):
    """torchrun started more processes on this node than it has GPUs: refused (it fell back to gloo with
    several ranks on cuda:0, or put several --jobs ranks on one GPU). No GPU at all: the CPU, as before.
    The GPUs are faked (count, set_device); no group starts."""
    from lingbot_core.distributed.launch import init_from_env
    from lingbot_nodes import cli

    picked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    for run in (lambda: init_from_env("cfg=2"), cli._pick_local_device):
        with pytest.raises(RefusedInput) as refused:
            run()
        message = str(refused.value)
        assert "\n" not in message and "2 processes" in message and "1 GPU" in message, message
        assert exit_codes.exit_code(refused.value) == exit_codes.BAD_INPUT
    assert picked == [] and not dist.is_initialized()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one process per GPU: it takes its own
    monkeypatch.setenv("LOCAL_RANK", "0")
    cli._pick_local_device()
    assert picked == [0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cli._pick_local_device()  # no GPU: every rank on the CPU
    assert picked == [0]


def test_a_local_rewrite_seeds_only_what_it_samples_on(fixtures_root, monkeypatch):
    """A sampled local Rewrite seeds the generator of its own device (and the CPU's, restored after):
    it used `torch.manual_seed`, which reseeds every GPU of the process (the other GPUs' random state,
    LingBot Parallel's rank 0 or another node's sampling, changed by a caption). The all-GPU seeding
    is recorded here (no GPU); the same seed still gives the same caption."""
    from lingbot_core import rewrite as rw
    from lingbot_core.handle import PipelineHandle

    every_gpu = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", every_gpu.append)
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    sampling = rw.Sampling(temperature=1.0, seed=11)
    state = torch.get_rng_state()
    first = rw.generate_text(handle, "system", "user", max_new_tokens=5, sampling=sampling)
    assert torch.equal(torch.get_rng_state(), state)  # the process's own CPU random state is untouched
    assert rw.generate_text(handle, "system", "user", max_new_tokens=5, sampling=sampling).text == first.text
    assert every_gpu == []
    from contextlib import contextmanager

    from lingbot_core.rewrite import local_backend

    seeded = []

    @contextmanager
    def on(device):
        seeded.append(str(device))
        yield

    monkeypatch.setattr(torch.cuda, "device", on)
    monkeypatch.setattr(torch.cuda, "manual_seed", seeded.append)
    local_backend._seed_here(5, torch.device("cuda:1"))  # the CUDA branch, on a device label
    assert seeded == ["cuda:1", 5] and every_gpu == []


def test_disable_smart_memory_does_not_stop_the_pools_workers_on_every_model_load(monkeypatch):
    """ComfyUI with --disable-smart-memory unloads every listed model at every model load, asking each
    for all its memory (None in older ComfyUI, 1e32 in newer): LingBot Parallel's workers, listed so that
    "Unload models" stops them, were stopped each time (a reload of every worker's DiT). Now only
    ComfyUI's unload_all_models stops them. A stand-in `comfy.model_management` speaks both protocols."""
    import sys
    import types

    from lingbot_nodes import runtime

    mm = types.ModuleType("comfy.model_management")
    mm.current_loaded_models, mm.DISABLE_SMART_MEMORY = [], True
    mm.get_torch_device = lambda: torch.device("cpu")
    # ComfyUI's functions, defined in the stand-in module (as ComfyUI's own are, in theirs)
    exec("def free_memory(memory_required, device, to_free=None):\n"
         "    return [m for m in list(current_loaded_models) if m.model_unload(to_free)]\n"
         "def load_models_gpu(to_free):\n"
         "    return free_memory(3 << 30, get_torch_device(), to_free)\n"
         "def unload_all_models(to_free):\n"
         "    return free_memory(1e30, get_torch_device(), to_free)\n", mm.__dict__)
    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    released = []

    class Pool:
        on_start: list = []

        def release(self):
            released.append(1)

    pool = Pool()
    runtime.track_pool(pool)
    for to_free in (None, 1e32):
        assert mm.load_models_gpu(to_free) == [] and released == []
    assert len(mm.unload_all_models(1e32)) == 1 and released == [1]
    mm.DISABLE_SMART_MEMORY = False  # smart memory: the amount asked for says it (as before)
    assert mm.load_models_gpu(2 << 30) == [] and len(mm.load_models_gpu(1e30)) == 1 and released == [1, 1]


def _job_ranks(rank: int, world: int, port: int, out: str) -> None:
    """Two gloo ranks: the same job passes; a seed given differently on rank 1 is refused on both, naming
    it; then a whole parallel denoise (cfg=2) whose steps and size differ on rank 1 is refused on both
    before its first forward (it mixed two schedules, or crashed in gloo)."""
    import json
    from pathlib import Path

    from bench._common import random_dit
    from lingbot_core.distributed.agree import check_same_job
    from lingbot_core.distributed.launch import init_loopback_group
    from lingbot_core.distributed.layout import ParallelLayout
    from lingbot_core.prompt import PromptEmbeds
    from lingbot_core.stages import Conditioning
    from lingbot_core.worker_pool.run import parallel_denoise

    torch.set_num_threads(1)
    init_loopback_group(rank, world, port)
    got: dict = {}
    try:
        job = {"seed": 7, "steps": 20, "sampler": "unipc", "latents": torch.ones(1, 16, 2, 4, 4)}
        check_same_job(job)
        got["same"] = "passed"
        try:
            check_same_job({**job, "seed": 7 + rank})
            got["seed"] = "passed"
        except RefusedInput as err:
            got["seed"] = str(err)
        layout = ParallelLayout.create(2, 1)
        g = torch.Generator().manual_seed(4)
        embeds = PromptEmbeds(torch.randn(1, 7, 32, generator=g), torch.ones(1, 7, dtype=torch.int64),
                              torch.zeros(1, 1, dtype=torch.int64))
        dit = random_dit(dict(hidden_size=32, num_attention_heads=2, depth=1, intermediate_size=48, text_dim=32,
                              freq_dim=32, axes_dims=(4, 6, 6), axes_lens=(64, 32, 32)), 0.05)
        latents = torch.randn(1, 16, 2, 4 + 2 * rank, 6, generator=g)
        try:
            parallel_denoise(dit, layout, latents, Conditioning(embeds, embeds), steps=2 + rank, guidance_scale=3.0)
            got["denoise"] = "passed"
        except RefusedInput as err:
            got["denoise"] = str(err)
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(got))
        dist.destroy_process_group()


def test_ranks_given_different_jobs_are_refused_on_every_rank_before_running(tmp_path):
    """Issue 34 item 6: two torchrun ranks with different seeds wrote a wrong video with exit code 0."""
    import json

    import torch.multiprocessing as mp

    from lingbot_core.distributed.launch import free_loopback_port

    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialised in this process: the ranks are forked")
    mp.start_processes(_job_ranks, args=(2, free_loopback_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for got in results:
        assert got["same"] == "passed", got
        assert "not given the same job: seed differs between rank 0 and rank 1" in got["seed"], got
        assert "\n" not in got["seed"]
        assert "steps" in got["denoise"] and "height" in got["denoise"] and "refused" in got["denoise"], got
    assert results[0]["denoise"] == results[1]["denoise"]


def test_lingbot_parallel_refuses_gpus_this_machine_does_not_have(monkeypatch):
    """`devices` naming a GPU that is not here is refused in one line before any process starts (the
    worker failed to start, its error only in the server log). The GPUs are faked (two)."""
    from lingbot_core.worker_pool.spec import PoolSpec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    handle = SimpleNamespace(device=torch.device("cuda:0"))
    with pytest.raises(RefusedInput, match=r"cuda:3.*2 GPUs \(cuda:0 to cuda:1\)") as refused:
        PoolSpec.make(handle, "cuda:0, cuda:3", 2)
    assert "\n" not in str(refused.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RefusedInput, match=r"cuda:0 is not on this machine, which has no GPU"):
        PoolSpec.make(handle, "0,1", 2)


def test_gpus_in_parallel_on_a_torch_without_nccl_are_refused_in_one_line(monkeypatch):
    """torch for Windows (and macOS) has no NCCL: LingBot Parallel on GPUs and a --parallel torchrun world on
    GPUs are refused before any process or group starts, saying where it runs. CPU devices still start; the
    GPUs and the build are faked."""
    from lingbot_core.distributed.launch import init_from_env
    from lingbot_core.worker_pool.spec import PoolSpec

    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    handle = SimpleNamespace(device=torch.device("cuda:0"))
    with pytest.raises(RefusedInput, match="LingBot Parallel on GPUs talks over NCCL.*Linux or in WSL 2") as refused:
        PoolSpec.make(handle, "cuda:0,cuda:1", 2)
    assert "\n" not in str(refused.value)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(RefusedInput, match="--parallel.*NCCL"):
        init_from_env("cfg=2")
    assert not dist.is_initialized()
    with pytest.raises(RefusedInput, match="two or more devices"):  # the CPU goes on to its own checks
        PoolSpec.make(SimpleNamespace(device=torch.device("cpu")), "cpu", 2)


def test_a_group_without_abort_is_aborted_through_its_nccl_backend():
    """Older torch: ProcessGroup has no `abort`; its NCCL backend has (faked here)."""
    calls = []

    class Backend:
        def abort(self):
            calls.append("backend")

    class OldGroup:
        def _get_backend(self, device):
            calls.append(str(device))
            return Backend()

    abort._abort_group(OldGroup())
    assert calls == ["cuda", "backend"]


def test_the_rendezvous_port_is_held_from_before_the_workers_start_until_the_store_listens():
    """The pool picks its port by binding it (not by probing a free port and closing it, which another
    process could take before rank 0's store listens); the store then listens on that very socket."""
    import socket

    from lingbot_core.distributed.launch import loopback_store, reserve_loopback_port

    reserved = reserve_loopback_port()
    port = reserved.getsockname()[1]
    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))  # taken: nobody else gets it in between
    store = loopback_store(port, 1, server=True, reserved=reserved)
    assert reserved.fileno() == -1  # the store's server owns the socket now
    assert f"127.0.0.1:{port}" in _listening([os.getpid()])
    store.set("k", "v")
    client = dist.TCPStore("127.0.0.1", port, 1, False)
    assert client.get("k") == b"v"


def test_the_rendezvous_store_takes_its_socket_on_a_torch_whose_libuv_store_refuses_one(monkeypatch):
    """torch 2.7's TCPStore server (libuv, its default) raises NotImplementedError for `master_listen_fd`,
    which every LingBot Parallel start and loopback group passed: the store falls back to torch's other
    server (`use_libuv=False`), which takes the same, still listening socket. The refusal is faked here
    as torch 2.7 raises it (checked against torch 2.7.0)."""
    from lingbot_core.distributed.launch import loopback_store, reserve_loopback_port

    real = dist.TCPStore
    tried = []

    def old_torch_store(*args, **kwargs):
        tried.append(kwargs.get("use_libuv", True))
        if kwargs.get("master_listen_fd") is not None and kwargs.get("use_libuv", True):
            raise NotImplementedError("The libuv TCPStore backend does not support initialization with an listen fd.")
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", old_torch_store)
    reserved = reserve_loopback_port()
    port = reserved.getsockname()[1]
    store = loopback_store(port, 1, server=True, reserved=reserved)
    assert tried == [True, False]
    assert reserved.fileno() == -1  # the fallback server owns the socket
    store.set("k", "v")
    assert real("127.0.0.1", port, 1, False).get("k") == b"v"
