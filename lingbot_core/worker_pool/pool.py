"""Persistent worker processes for one parallel layout, with the calling process as rank 0.

ComfyUI runs every node in one process, but torch.distributed needs one process per rank. A
`WorkerPool` therefore starts one process per extra device (torch.multiprocessing, spawn) that joins
a process group with the caller: the rendezvous is torch's TCP store, its server held by rank 0 on a
socket bound to 127.0.0.1 (`distributed.launch.loopback_store`: nothing listens on another address),
gloo on CPUs, NCCL on CUDA devices. Each worker opens its own lazy handle from
`describe_handle` (paths and settings, never pickled modules), so it loads its DiT on the first call
and keeps it across calls. A call (`WorkerPool.run`) sends the stage's inputs to every worker -- a
JSON header and tensors, both with `dist.broadcast`; nothing is pickled -- and then runs the stage
here too, on the pool's parallel view of the caller's handle: every rank runs the same stage with
the same inputs, and rank 0 keeps the result.

Interrupts: after every step every rank takes part in the sampling loop's status exchange
(`distributed.abort.StepStatus`); when rank 0's step callback raised (ComfyUI's interrupt, Ctrl-C), or
its step failed, the workers hear it there (`PeerFailed`) and drop the call within that step, in step
with rank 0, so the pool stays usable.

Failures: a worker that failed (inside a DiT forward too: an out-of-memory error on its GPU), a
worker that died, or a call that failed on rank 0 for any reason but an interrupt or a refused
input stops the whole pool with one clear `PoolError` naming the rank and device that failed and
its error; the caller's handle is untouched (its single-device stages work as before) and the next
call on the pool starts fresh workers. A failing worker publishes its error in the group's store and
ends its process, so the collectives rank 0 (and every other worker) waits in fail at once instead
of at the backend's timeout; rank 0 reads the error there (`distributed/abort.py` has the details, NCCL's
included). `release` stops the workers (they also stop when this process exits: they are daemons, an
atexit hook releases them, and a worker whose collectives fail because rank 0 is gone exits).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..components import DITS, TRANSFORMER
from ..distributed.abort import (
    Failure,
    PeerFailed,
    failure_in,
    failure_key,
    publish_failure,
    published_failure,
)
from ..distributed.launch import init_loopback_group, reserve_loopback_port
from ..distributed.layout import CFG_DEGREES, ParallelLayout, pooled_offload_refusal
from ..errors import RefusedInput, is_refused_input
from ..interrupt import interrupt_checker

log = logging.getLogger("lingbot_core.distributed")

__all__ = ["HANDLERS", "PoolError", "PoolSpec", "WorkerPool", "check_pooled", "describe_handle", "open_described",
           "parse_devices", "pool_for", "pool_of", "pooled_loras", "pooled_offload_refusal", "release_pool_of",
           "run_refine", "run_stage", "tag"]

#: how long rank 0 waits for the workers to come up (spawn, imports, handle check) before giving up
START_TIMEOUT_S = float(os.environ.get("LINGBOT_POOL_START_TIMEOUT", "600"))
#: the collectives' timeout (a first call loads the DiT on every rank: minutes for a real checkpoint)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
#: how workers start: "spawn" (safe with CUDA initialised in this process, as in ComfyUI); the CPU tests
#: use "fork" (an interpreter start with our imports costs a minute on a loaded machine)
START_METHOD = "spawn"
_STARTING, _READY, _FAILED = 0, 1, 2
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                        torch.int64, torch.int32, torch.uint8, torch.bool)}
_DTYPE_NAMES = {d: n for n, d in _DTYPES.items()}
MAX_HEADER_BYTES = 1 << 20


class PoolError(RuntimeError):
    """The pool cannot run this call (a worker died, a worker failed to start, rank 0 failed)."""


# -- what the workers need: devices, degrees and the checkpoint as plain data --------------------------------

MAX_CPU_RANKS = 8
"""CPU ranks LingBot Parallel starts at most (or one per core where there are more cores)."""


def parse_devices(text: str) -> tuple[str, ...]:
    """`"cuda:0, cuda:1"`, `"0,1"` (CUDA indices) or `"cpu,cpu"` -> one device name per rank."""
    names = []
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        name = f"cuda:{part}" if part.isdigit() else part
        try:
            device = torch.device(name)
        except (RuntimeError, ValueError):
            raise RefusedInput(f"devices: {part!r} is not a device (cpu, cuda:N or a GPU index N)") from None
        if device.type not in ("cpu", "cuda"):
            raise RefusedInput(f"devices: {part!r}; LingBot Parallel runs on cpu or cuda devices")
        if device.type == "cuda" and device.index is None:
            raise RefusedInput(f"devices: {part!r}: name the GPU (cuda:0, cuda:1, ... or 0, 1, ...)")
        names.append(str(device))
    if len({torch.device(n).type for n in names}) > 1:
        raise RefusedInput(f"devices: {text!r} mixes CPU and CUDA; one process group runs on one kind")
    cuda = [n for n in names if n.startswith("cuda")]
    if len(set(cuda)) != len(cuda):
        raise RefusedInput(f"devices: {text!r} names a GPU twice; each rank needs its own")
    # A GPU can be named once; 'cpu' repeats, so a workflow could ask for any number of processes, each
    # loading a DiT: a bound (CPU ranks are for trying the node out).
    limit = max(MAX_CPU_RANKS, os.cpu_count() or 1)
    if len(names) - len(cuda) > limit:
        raise RefusedInput(f"devices: {len(names) - len(cuda)} CPU processes asked for; at most {limit} here")
    return tuple(names)


def _check_gpus_here(names: tuple[str, ...]) -> None:
    """Refuse a GPU this machine does not have (before any worker starts and fails on it)."""
    indices = [torch.device(n).index for n in names if n.startswith("cuda")]
    if not indices:
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [i for i in indices if i is None or i >= count]
    if missing:
        here = ("no GPU" if not count else "1 GPU (cuda:0)" if count == 1
                else f"{count} GPUs (cuda:0 to cuda:{count - 1})")
        raise RefusedInput(f"devices: cuda:{missing[0]} is not on this machine, which has {here}; list the GPUs "
                           "it has, or cpu")


def describe_handle(handle: Any) -> dict[str, Any]:
    """How a worker opens the same DiTs as `handle`: folder, DiT files, dtypes and settings (JSON-able)."""
    shared = handle.shared
    info = shared.info
    if info is None:
        raise RefusedInput("LingBot Parallel needs a pipe opened from a checkpoint (a folder or files): the "
                         "workers load their own copy of the DiT from it")
    folder = shared.folder
    files = {}
    for name in ("transformer", "refiner"):
        source = info.sources.get(name)
        paths = [Path(p) for p in getattr(source, "files", ())] if source is not None else []
        inside = folder is not None and all(Path(folder) in p.parents for p in paths)
        if paths and not inside:
            if len(paths) != 1:
                raise RefusedInput(f"LingBot Parallel: the {name} comes from {len(paths)} files outside the checkpoint "
                                 "folder; give it as one file or a checkpoint folder")
            files[name] = str(paths[0])
    student = shared.transformer_source
    return {"folder": str(folder) if folder is not None else None, "files": files,
            "transformer_folder": str(student[0] / student[1]) if student is not None else None,
            **shared.settings.to_json()}  # every field of handle.HandleSettings, by its name


def open_described(description: dict[str, Any], device: str | torch.device) -> Any:
    """A lazy handle on `device` from `describe_handle`'s description (nothing loads until a stage runs)."""
    from ..components import ComponentFiles
    from ..handle import HandleSettings, PipelineHandle

    d = description
    files = ComponentFiles(**d["files"]) if d["files"] else None
    settings = HandleSettings.from_json({name: d[name] for name in HandleSettings.__dataclass_fields__})
    return PipelineHandle.open(d["folder"], files=files, device=device, transformer_folder=d["transformer_folder"],
                               settings=settings)


@dataclass(frozen=True)
class PoolSpec:
    """One pool: a device per rank (rank 0 is this process's), the degrees, the workers' checkpoint."""

    devices: tuple[str, ...]
    cfg: int
    ulysses: int
    checkpoint: dict[str, Any] = field(hash=False, compare=True)
    #: shard the DiTs' blocks over every rank (FSDP2, `distributed/fsdp.py`): each device holds 1/N of them.
    #: Rank 0 then runs on a handle of its own (the same checkpoint, opened lazily), since sharding is
    #: one-way and the Loader's handle must stay whole for the pipe without LingBot Parallel
    fsdp: bool = False

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def backend(self) -> str:
        return "nccl" if self.devices[0].startswith("cuda") else "gloo"

    @classmethod
    def make(cls, handle: Any, devices: str | tuple[str, ...], cfg: int, ulysses: int = 0, *,
             fsdp: bool = False) -> PoolSpec:
        """Checked against `handle` before any process starts: device 0 is the handle's, degrees fit."""
        names = parse_devices(devices) if isinstance(devices, str) else tuple(devices)
        _check_gpus_here(names)
        if len(names) < 2:
            raise RefusedInput(f"LingBot Parallel needs two or more devices (got {len(names)}); with one, use the "
                             "pipe directly")
        if not _same_device(names[0], handle.device):
            raise RefusedInput(f"devices: the first device is this process's (rank 0), which runs the pipe on "
                             f"{handle.device}; list {handle.device} first, then the workers' devices")
        if cfg not in CFG_DEGREES:
            raise RefusedInput(f"cfg degree {cfg}: choose one of {CFG_DEGREES}")
        world = len(names)
        ulysses = ulysses or world // cfg
        if cfg * ulysses != world:
            raise RefusedInput(f"cfg={cfg} x ulysses={ulysses} must equal the {world} devices given")
        heads = (handle.info.transformer_config or {}).get("num_attention_heads") if handle.info else None
        if heads:
            ParallelLayout(cfg=cfg, ulysses=ulysses).check_heads(int(heads))
        pooled_loras(handle)  # LoRAs from files cross (the workers read them); other view states do not
        mode = handle.offload.mode
        if mode not in ("none", None):
            raise RefusedInput(f"LingBot Parallel: offload mode {mode!r} does not combine with several processes; "
                             "connect a pipe with offload 'none' (each GPU holds its own DiT)")
        if fsdp and handle.shared.weights != "auto":
            raise RefusedInput(f"LingBot Parallel: fsdp shards plain (bf16) DiT weights; this pipe loads them as "
                             f"{handle.shared.weights!r}: load with weights 'auto' from a bf16 checkpoint, or turn fsdp off")
        return cls(names, cfg, ulysses, describe_handle(handle), bool(fsdp))


# -- messages: a JSON header and tensors, broadcast from rank 0 --------------------------------------------

def _broadcast_message(device: torch.device, kind: str | None = None, fields: dict | None = None,
                       tensors: dict[str, torch.Tensor] | None = None) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """Rank 0 passes kind/fields/tensors; every rank gets them back (tensors on the CPU)."""
    leader = dist.get_rank() == 0
    tensors = {k: v for k, v in (tensors or {}).items() if v is not None}
    if leader:
        header = {"kind": kind, "fields": fields or {},
                  "tensors": {k: [_DTYPE_NAMES[v.dtype], list(v.shape)] for k, v in tensors.items()}}
        data = json.dumps(header).encode("utf-8")
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    n = int(size.item())
    if not 0 < n <= MAX_HEADER_BYTES:
        raise PoolError(f"pool message header of {n} bytes")
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if leader
           else torch.empty(n, dtype=torch.uint8, device=device))
    dist.broadcast(buf, 0)
    if not leader:
        header = json.loads(bytes(buf.cpu().tolist()).decode("utf-8"))
    got = {}
    for name, (dtype, shape) in header["tensors"].items():
        t = tensors[name].detach().to(device).contiguous() if leader else torch.empty(
            shape, dtype=_DTYPES[dtype], device=device)
        dist.broadcast(t, 0)
        got[name] = tensors[name] if leader else t.cpu()
    return header["kind"], header["fields"], got


# -- the stages a pool runs: each packs its inputs on rank 0 and unpacks them on the workers ---------------

def _pack_prompt(prefix: str, embeds: Any, into: dict) -> None:
    if embeds is not None:
        into[f"{prefix}.embeds"], into[f"{prefix}.mask"] = embeds.embeds, embeds.mask
        into[f"{prefix}.ids"] = embeds.input_ids


def _unpack_prompt(prefix: str, tensors: dict) -> Any:
    from ..prompt import PromptEmbeds

    if f"{prefix}.embeds" not in tensors:
        return None
    return PromptEmbeds(tensors[f"{prefix}.embeds"], tensors[f"{prefix}.mask"], tensors[f"{prefix}.ids"])


def _first_frame_drawn(kwargs: dict[str, Any]) -> dict[str, Any]:
    """TI2V on rank 0: draw the image condition's posterior sample here, from the call's generator (first,
    as `stages.denoise` would), so the workers get the drawn latent and the generator after the draw,
    not the image (they have no VAE statistics to draw it with)."""
    image_cond = kwargs.get("image_cond")
    if image_cond is None:
        return kwargs
    from ..stages import _generator

    height, width = kwargs.get("height"), kwargs.get("width")
    if (image_cond.height, image_cond.width) != (height, width):
        raise RefusedInput(f"the image condition was prepared for {image_cond.height}x{image_cond.width} but the "
                         f"video is {height}x{width}; encode the image at the video size")
    if kwargs.get("cond_latent") is not None:
        return {**kwargs, "image_cond": None}  # the given latent wins, as in stages.denoise
    g = _generator(kwargs.get("seed"), kwargs.get("generator"))
    return {**kwargs, "image_cond": None, "cond_latent": image_cond.sample_latent(g), "generator": g}


def _pack_denoise(kwargs: dict[str, Any]) -> tuple[dict, dict]:
    """Denoise's keyword arguments -> (JSON fields, tensors). A generator crosses as its state (the
    workers draw what rank 0 draws); a step cache as its settings (each rank keeps its own cache, which
    decides as its peers do: `distributed.stage.share_step_cache`)."""
    from ..sampling.step_cache import StepCacheSettings

    kwargs = dict(kwargs)
    cond = kwargs.pop("cond")
    if kwargs.get("image_cond") is not None:
        raise RefusedInput("an image condition reaches the workers as its drawn latent (`_first_frame_drawn`)")
    cache = StepCacheSettings.of(kwargs.pop("step_cache", "off"))
    if cache.enabled:
        kwargs["step_cache"] = dataclasses.asdict(cache)
    generator = kwargs.pop("generator", None)
    if generator is not None and generator.device.type != "cpu":
        raise RefusedInput("LingBot Parallel takes a CPU generator (the stages' own kind), or a seed")
    for unsupported in ("trace", "image_cond"):
        kwargs.pop(unsupported, None)
    tensors: dict[str, torch.Tensor] = {}
    _pack_prompt("positive", cond.positive, tensors)
    _pack_prompt("negative", cond.negative, tensors)
    if generator is not None:
        tensors["generator"] = generator.get_state()
    for name in ("latents", "sigmas", "cond_latent"):
        value = kwargs.pop(name, None)
        if value is not None:
            tensors[name] = torch.as_tensor(value, dtype=torch.float32) if name == "sigmas" else value
    sampler = kwargs.get("sampler")
    if sampler is not None and not isinstance(sampler, str):
        raise RefusedInput("LingBot Parallel takes a sampler by name")
    fields = {**kwargs, "cond": {"zero_negative": cond.zero_negative, "prompt": cond.prompt,
                                 "with_image": cond.with_image}}
    json.dumps(fields)  # only plain values cross (a TypeError here is a bug in the caller)
    return fields, tensors


def _unpack_denoise(fields: dict, tensors: dict) -> dict[str, Any]:
    from ..stages import Conditioning

    fields = dict(fields)
    c = fields.pop("cond")
    cond = Conditioning(_unpack_prompt("positive", tensors), _unpack_prompt("negative", tensors), **c)
    kwargs = {**fields, "cond": cond}
    if "step_cache" in fields:
        from ..sampling.step_cache import StepCacheSettings

        kwargs["step_cache"] = StepCacheSettings(**fields["step_cache"])
    for name in ("latents", "sigmas", "cond_latent"):
        if name in tensors:
            kwargs[name] = tensors[name]
    if "generator" in tensors:
        kwargs["generator"] = torch.Generator("cpu")
        kwargs["generator"].set_state(tensors["generator"])
    return kwargs


def _drop_dits(handle: Any, names: list[str]) -> None:
    """Release the named DiTs of `handle` where loaded (a worker following rank 0's Refine with
    `release_base`: the base DiT goes before the refiner loads, not both on one device)."""
    loaded = [name for name in names if name in DITS and name in handle.shared.loaded]
    if loaded:
        from ..placement.door import release

        release(handle, loaded)


def _run_denoise(view: Any, kwargs: dict[str, Any], callback: Callable | None) -> Any:
    from ..stages import denoise

    cond = kwargs.pop("cond")
    return denoise(view, cond, callback=callback, **kwargs)


#: stage name -> (pack on rank 0, unpack on a worker, run on a parallel view)
HANDLERS: dict[str, tuple[Callable, Callable, Callable]] = {
    "denoise": (_pack_denoise, _unpack_denoise, _run_denoise),
}


# -- the pool (rank 0) ---------------------------------------------------------------------------------

_LIVE: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


class WorkerPool:
    """Workers for `spec`, started on the first call (or `start`), kept until `release`."""

    def __init__(self, spec: PoolSpec):
        self.spec = spec
        self.layout: ParallelLayout | None = None
        self._procs: list[Any] = []
        self._status: Any = None
        self.starts = 0  # how many times workers were started (tests, the node's status line)
        #: called with the pool after every start of its workers, including a restart by a later call after
        #: `release` (ComfyUI lists the pool again there, so its next "Unload models" stops the new workers)
        self.on_start: list[Callable[[WorkerPool], None]] = []
        self._own: Any = None  # FSDP: rank 0's own lazy handle of the checkpoint (`_rank0_view`)
        self._own_loras: dict[str, Any] = {}  # its LoRA files, as a worker keeps them

    # -- lifecycle ---------------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self.layout is not None

    @property
    def device(self) -> torch.device:
        return torch.device(self.spec.devices[0]) if self.spec.backend == "nccl" else torch.device("cpu")

    def start(self) -> None:
        """Spawn the workers and join their process group as rank 0 (a no-op when started)."""
        if self.started:
            return
        if dist.is_available() and dist.is_initialized():
            raise PoolError("this process already belongs to a torch.distributed group (another LingBot Parallel "
                            "pool, or a torchrun launch); release it first")
        import torch.multiprocessing as mp

        ctx = mp.get_context(START_METHOD)
        # the rendezvous port is held from now on (bound, listening once the workers are up): no other
        # process can take it in between
        reserved = reserve_loopback_port()
        world, port = self.spec.world_size, reserved.getsockname()[1]
        self._status = ctx.Array("i", [_STARTING] * world)
        self._procs = []
        # the workers inherit the environment as it is now
        if self.spec.backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        else:  # on an NCCL error or timeout: abort the communicators and raise, never end ComfyUI's process
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        try:
            with _main_module_hidden(), _fork_safe():
                for rank in range(1, world):
                    proc = ctx.Process(target=_worker_main, args=(rank, self.spec, port, self._status), daemon=True,
                                       name=f"lingbot-parallel-{rank}")
                    proc.start()
                    self._procs.append(proc)
            self._wait_ready()
            init_loopback_group(0, world, port, self.spec.backend, timeout=COLLECTIVE_TIMEOUT, reserved=reserved)
            self.layout = ParallelLayout.create(self.spec.cfg, self.spec.ulysses, fsdp=self.spec.fsdp,
                                                device_type="cuda" if self.spec.backend == "nccl" else "cpu")
        except BaseException:
            self._abandon()
            raise
        finally:
            reserved.close()  # nothing once the store took it
        self.starts += 1
        _LIVE.add(self)
        for hook in list(self.on_start):
            hook(self)
        log.info("LingBot Parallel: %d worker process(es) on %s (%s)", world - 1, ", ".join(self.spec.devices[1:]),
                 self.layout.describe())

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            states = list(self._status)
            if any(s == _FAILED for s in states):
                rank = states.index(_FAILED)
                raise PoolError(f"LingBot Parallel: the worker for {self.spec.devices[rank]} (rank {rank}) could not "
                                "start; its error is in the server log")
            self._check_processes("start")
            if all(s == _READY for s in states[1:]):
                return
            if time.monotonic() > deadline:
                raise PoolError(f"LingBot Parallel: the workers did not start within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def _check_processes(self, when: str) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            if not proc.is_alive():
                raise PoolError(f"LingBot Parallel: the worker for {self.spec.devices[rank]} (rank {rank}) is gone "
                                f"(exit code {proc.exitcode}) at {when}; the workers were stopped. The pipe without "
                                "LingBot Parallel works on this device; running again starts new workers")

    def release(self) -> None:
        """Stop the workers and leave the process group; the next call starts new ones."""
        if self.started:
            try:
                self._check_processes("release")
                _broadcast_message(self.device, "stop")
            except Exception:  # a worker already gone: the processes are ended below
                pass
        self._abandon()

    def _abandon(self, grace: float = 5.0) -> None:
        """End the workers (after `grace` seconds for them to stop by themselves) and leave the group."""
        for proc in self._procs:
            proc.join(timeout=grace if self.started else 0)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs = []
        if dist.is_available() and dist.is_initialized() and self.layout is not None:
            try:
                dist.destroy_process_group()
            except Exception:  # a group broken by a dead peer: its resources go with it
                pass
        self.layout = None
        self._own, self._own_loras = None, {}  # FSDP shards belong to the group just left
        _LIVE.discard(self)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def ping(self) -> list[dict[str, Any]]:
        """Every worker's status: its pid, how often it loaded each DiT and which are in memory (tests; the
        node's line)."""
        self._call_started("ping")
        _broadcast_message(self.device, "ping")
        return _gather_status(self.device, None)

    # -- calls -------------------------------------------------------------------------------------------
    def _call_started(self, what: str) -> None:
        self.start()
        try:
            self._check_processes(what)
        except PoolError:
            self._abandon()
            raise

    def run(self, stage: str, handle: Any, callback: Callable | None = None, **kwargs: Any) -> Any:
        """Run `stage` ("denoise") with `kwargs` on every rank; rank 0's result (this process's) is returned.

        `handle` is this process's pipe; it runs on the pool's parallel view of it. `callback(step,
        total, latents)` runs here after each step; what it raises (an interrupt) stops every rank
        within that step and propagates; the pool stays up. Any other failure stops the pool
        (`PoolError` when a worker is gone).
        """
        pack, _unpack, execute = HANDLERS[stage]
        check_pooled(handle)
        release = list(kwargs.pop("release_dits", ()))  # `_drop_dits` keeps the DiTs among them
        kwargs = _first_frame_drawn(kwargs)
        fields, tensors = pack({**kwargs})  # bad input is refused before anything is sent
        fields = {**fields, "loras": pooled_loras(handle), "release": release}
        self._call_started(stage)
        view = self._rank0_view(handle, fields["loras"])  # its refusals too, before the workers hear of the call
        if self._own is not None:
            _drop_dits(self._own, release)
        device = self.device
        flagged = []  # rank 0 stopped between two steps (the workers heard it in the status exchange)

        def on_step(step: int, total: int, latents: Any) -> None:
            try:
                if callback is not None:
                    callback(step, total, latents)
            except BaseException:
                flagged.append(step)
                raise

        try:
            _broadcast_message(device, stage, fields, tensors)
            # no cancellation points inside the DiT here: an interrupt between two blocks would leave the
            # workers inside that forward's collectives, and only ending them frees them (a reload of every
            # worker's DiT on the next run). The step callback, between two forwards, follows it instead.
            with interrupt_checker(None):
                return execute(view, {k: v for k, v in kwargs.items() if k != "trace"}, on_step)
        except BaseException as err:
            failure = failure_in(err)  # the group broke: the first rank that failed, as it published it
            refused = is_refused_input(err)
            if failure is None and not _is_interrupt(err) and not refused:
                failure = published_failure(failure_key(self.layout))  # a worker that failed outside the loop
            dead = [] if failure is not None and failure.rank != 0 else self._dead_after(err)
            in_step = flagged and (_is_interrupt(err) or refused)
            if failure is None and not dead and (in_step or refused):
                raise  # every rank stopped the same way (an interrupt between two steps, or the same refused input)
            self._abandon(grace=0)  # the workers left, or wait in a collective that will not complete
            error = self._failure_error(stage, err, failure, dead)
            if error is err:
                raise
            raise error from err

    def _rank0_view(self, handle: Any, loras: list[list[Any]]) -> Any:
        """The parallel view rank 0 runs a call on: the caller's handle, or with FSDP a handle of the pool's
        own (opened like a worker's, lazily; its DiT is sharded on first use, the caller's stays whole)
        carrying the caller's LoRA stack as the workers get it."""
        if not self.spec.fsdp:
            return handle.with_parallel(self.layout)
        if self._own is None:
            self._own = open_described(self.spec.checkpoint, handle.device)
        return _with_loras(self._own.with_parallel(self.layout), loras, self._own_loras)

    def _failure_error(self, stage: str, err: BaseException, failure: Failure | None,
                       dead: list[tuple[int, Any]]) -> BaseException:
        """What a failed call raises: the worker that failed (its device, rank and error), else a worker
        that died, else rank 0's own error (an interrupt as it is)."""
        after = ("; the workers were stopped. The pipe without LingBot Parallel works on this device; running "
                 "again starts new workers")
        if failure is not None and 0 < failure.rank < self.spec.world_size:
            device = self.spec.devices[failure.rank]
            what = "was interrupted" if failure.interrupted else f"failed {failure.where} ({failure.error})"
            return PoolError(f"LingBot Parallel: the worker for {device} (rank {failure.rank}) {what} during "
                             f"{stage}{after}")
        if dead:
            rank, proc = dead[0]
            return PoolError(f"LingBot Parallel: the worker for {self.spec.devices[rank]} (rank {rank}) died during "
                             f"{stage} (exit code {proc.exitcode}){after}")
        if isinstance(err, PoolError) or _is_interrupt(err):
            return err
        own = failure.error if failure is not None else f"{type(err).__name__}: {err}"
        where = f" {failure.where}" if failure is not None else ""
        return PoolError(f"LingBot Parallel: {stage} failed on rank 0 ({self.spec.devices[0]}){where} ({own}); the "
                         "workers were stopped and the next run starts new ones")

    def _dead_after(self, err: BaseException) -> list[tuple[int, Any]]:
        """(rank, process) of the workers found dead after `err` (a collective error can come a moment before
        the exit is seen), taken now: `_abandon` empties the list of workers. A worker that left by itself
        (exit code 0: it followed another rank's failure) is not one that died."""
        def dead() -> list[tuple[int, Any]]:
            return [(rank, p) for rank, p in enumerate(self._procs, start=1) if not p.is_alive() and p.exitcode != 0]

        found = dead()
        if not found and not _is_interrupt(err) and not is_refused_input(err):
            time.sleep(0.5)
            found = dead()
        return found


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """A spawned child imports the parent's `__main__` script again (as `__mp_main__`) unless it cannot
    find it; ComfyUI's main.py does work at import, and the workers need nothing from it, so its file
    and spec are hidden while the workers start."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    for key in saved:
        if key == "__spec__":
            main.__spec__ = None
        else:
            del main.__dict__[key]
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


@contextmanager
def _fork_safe() -> Iterator[None]:
    """With the fork start method (the CPU tests): a forked worker must never run the destructors of
    what this process still holds, such as the process groups of a pool that failed, kept alive by
    the traceback of the error the caller holds (a gloo group's destructor joins threads the child
    does not have: a crash or a hang). So garbage goes first and the garbage collector leaves
    everything older than the fork alone in the children (`gc.freeze`, Python's advice for fork)."""
    if START_METHOD != "fork":
        yield
        return
    import gc

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _same_device(name: str, device: torch.device | str) -> bool:
    a, b = torch.device(name), torch.device(device)
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


# -- which pipes run on a pool ------------------------------------------------------------------------------

_CURRENT: WorkerPool | None = None  # one process belongs to one process group: one pool at a time


def pool_for(spec: PoolSpec) -> WorkerPool:
    """The pool for `spec`: the current one when it has the same spec (kept warm), else a new one (the
    current pool is released first: this process can be rank 0 of one group only)."""
    global _CURRENT
    if _CURRENT is not None and _CURRENT.spec == spec:
        return _CURRENT
    if _CURRENT is not None:
        _CURRENT.release()
    _CURRENT = WorkerPool(spec)
    return _CURRENT


def tag(pipe: Any, pool: WorkerPool) -> Any:
    """A view of the pipe whose stages `run_stage` sends to `pool`. The pool is a field of the view, so
    every view made from it (LingBot Offload with 'none'/'auto', anything built with `dataclasses.replace`)
    runs on the pool too; what the workers cannot follow is refused (`check_pooled`), never run on rank 0
    alone."""
    from dataclasses import replace

    return replace(pipe, pool=pool)


def pool_of(pipe: Any) -> WorkerPool | None:
    """The pool a pipe from `tag` (or a view of it) runs on (None for every other pipe)."""
    pool = getattr(pipe, "pool", None)
    return pool if isinstance(pool, WorkerPool) else None


def check_pooled(handle: Any) -> None:
    """Refuse, before anything is sent, a view of a pool's pipe that the workers would not follow: an
    offload mode other than none/auto, or per-view states other than LoRAs read from files."""
    mode = handle.offload.mode
    if mode not in ("none", "auto", None):
        raise RefusedInput(pooled_offload_refusal(mode))
    pooled_loras(handle)


def pooled_loras(handle: Any) -> list[list[Any]]:
    """The view's LoRA stack as plain data the workers rebuild it from: [path, size, mtime_ns, strength,
    apply_to] per LoRA, in order. Other per-view states, and LoRAs not read from a file, are refused."""
    kinds = sorted({s.kind for s in handle.view_states} - {"lora"})
    if kinds:
        raise RefusedInput(f"LingBot Parallel: the pipe carries {', '.join(kinds)}, which the workers do not have; "
                         "connect LingBot Parallel's pipe (or a LingBot Offload or LoRA view of it) to the stage")
    from ..lora.stack import lora_stack

    rows = []
    for item in lora_stack(handle).items:
        fingerprint = item.lora.fingerprint
        if fingerprint[0] != "file":
            raise RefusedInput(f"LingBot Parallel: the LoRA {item.lora.name!r} was not read from a file, so the "
                             "workers cannot read it; load it with LingBot LoRA from the loras folder")
        rows.append([fingerprint[1], fingerprint[2], fingerprint[3], item.strength, item.apply_to])
    return rows


def _with_loras(view: Any, rows: list[list[Any]], files: dict[str, Any]) -> Any:
    """Worker side: `view` with rank 0's LoRA stack (each file read once and kept while rank 0 uses it)."""
    from ..lora import LoraStack
    from ..lora.files import load_lora_file
    from ..lora.stack import LoraItem

    items = []
    for path, size, mtime_ns, strength, apply_to in rows:
        lora = files.get(path)
        if lora is None or lora.fingerprint[2:] != (size, mtime_ns):
            lora = files[path] = load_lora_file(path)
            if lora.fingerprint[2:] != (size, mtime_ns):
                log.warning("LoRA %s changed on disk since rank 0 read it; the workers use the file as it is now",
                            path)
        items.append(LoraItem(lora, float(strength), apply_to))
    for path in set(files) - {row[0] for row in rows}:
        del files[path]  # no longer in the stack: its tensors go
    return view.with_view_state(LoraStack(tuple(items))) if items else view


def run_stage(stage: str, pipe: Any, cond: Any, *, callback: Callable | None = None, **kwargs: Any) -> Any:
    """`stages.<stage>(pipe, cond, ...)`, on the pipe's pool when it has one."""
    pool = pool_of(pipe)
    if pool is None:
        from .. import stages

        return getattr(stages, stage)(pipe, cond, callback=callback, **kwargs)
    return pool.run(stage, pipe, callback=callback, cond=cond, **kwargs)


def run_refine(pipe: Any, frames: Any, cond: Any, *, callback: Callable | None = None, **kwargs: Any) -> Any:
    """`stages.refine(pipe, frames, cond, ...)`; on the pipe's pool when it has one: the base frames'
    upscale and VAE encode (and any decode) run here, the refiner's sampling on every rank (each
    worker loads the refiner DiT on its first Refine and keeps it)."""
    from .. import stages

    pool = pool_of(pipe)
    if pool is None:
        return stages.refine(pipe, frames, cond, callback=callback, **kwargs)
    check_pooled(pipe)  # what pool.run would refuse, refused before the base DiT is released
    if kwargs.get("sampler") is not None and not isinstance(kwargs["sampler"], str):
        raise RefusedInput("LingBot Parallel takes a sampler by name")

    release = [TRANSFORMER] if kwargs.get("release_base") else []  # the workers drop it too, as rank 0 does

    def on_pool(handle: Any, refiner_cond: Any, **denoise_kwargs: Any) -> Any:
        return pool.run("denoise", handle, cond=refiner_cond, release_dits=release, **denoise_kwargs)

    return stages.refine(pipe, frames, cond, callback=callback, sample_with=on_pool, **kwargs)


def release_pool_of(pipe: Any) -> bool:
    """Stop the workers of the pipe's pool (True when it had one); the next call starts them again."""
    pool = pool_of(pipe)
    if pool is not None:
        pool.release()
    return pool is not None


def _is_interrupt(err: BaseException) -> bool:
    from ..exit_codes import INTERRUPTED, exit_code

    return exit_code(err) == INTERRUPTED


def _gather_status(device: torch.device, status: dict | None) -> list[dict[str, Any]]:
    """All ranks: a fixed-size int row (pid, then per DiT: loads, and 1 if it is in memory now) gathered
    on rank 0."""
    row = torch.zeros(1 + 2 * len(DITS), dtype=torch.int64, device=device)
    if status is not None:
        row[0] = status["pid"]
        for i, name in enumerate(DITS):
            row[1 + 2 * i], row[2 + 2 * i] = status["loads"].get(name, 0), int(name in status["resident"])
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather(row, rows, dst=0)
    if rows is None:
        return []
    return [{"rank": r, "pid": int(t[0]), "loads": {name: int(t[1 + 2 * i]) for i, name in enumerate(DITS)},
             "resident": [name for i, name in enumerate(DITS) if t[2 + 2 * i]]}
            for r, t in enumerate(rows) if r > 0]


@atexit.register
def _release_all() -> None:
    for pool in list(_LIVE):
        try:
            pool.release()
        except Exception:
            pass


# -- the worker process --------------------------------------------------------------------------------------

def _worker_main(rank: int, spec: PoolSpec, port: int, status: Any) -> None:
    """A worker: open the handle (lazily), join the group, then serve calls until told to stop."""
    try:
        if START_METHOD == "fork":  # OpenMP's pool does not survive a fork once the parent used it
            torch.set_num_threads(1)
        device = torch.device(spec.devices[rank])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        handle = open_described(spec.checkpoint, device)
    except BaseException:
        status[rank] = _FAILED
        raise
    status[rank] = _READY
    init_loopback_group(rank, spec.world_size, port, spec.backend, timeout=COLLECTIVE_TIMEOUT)
    try:
        layout = ParallelLayout.create(spec.cfg, spec.ulysses, device_type=device.type, fsdp=spec.fsdp)
        _serve(handle, layout, device if spec.backend == "nccl" else torch.device("cpu"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _serve(handle: Any, layout: ParallelLayout, device: torch.device) -> None:
    view = handle.with_parallel(layout)
    spec_device = str(handle.device)
    lora_files: dict[str, Any] = {}  # path -> LoraFile, the files of rank 0's current LoRA stack

    while True:
        try:
            kind, fields, tensors = _broadcast_message(device)
        except Exception:  # rank 0 is gone (its process ended): nothing left to serve
            return
        if kind == "stop":
            return
        if kind == "ping":
            _gather_status(device, {"pid": os.getpid(), "loads": dict(handle.shared.load_count),
                                    "resident": list(handle.shared.loaded)})
            continue
        _pack, unpack, execute = HANDLERS[kind]
        where = f"preparing {kind}"  # the worker's own steps (its LoRA files): rank 0 does not repeat them
        try:
            _drop_dits(handle, fields.pop("release", []))  # as rank 0 dropped them (Refine's release_base)
            call_view, call_kwargs = _with_loras(view, fields.pop("loras", []), lora_files), unpack(fields, tensors)
            where = f"in {kind}"
            execute(call_view, call_kwargs, None)
        except PeerFailed:  # rank 0 (or another worker) stopped between two steps: every rank stopped there
            continue
        except Exception as err:
            print(f"lingbot parallel worker rank {layout.rank}: {kind} failed: {type(err).__name__}: {err}",
                  file=sys.stderr, flush=True)
            if is_refused_input(err) and where == f"in {kind}":
                continue  # a refused input: rank 0 refuses the same (same inputs, same checks) and keeps the pool
            # anything else leaves this call out of step with the others: publish it for rank 0 (a failure
            # inside the forward already is) and leave, which ends every collective waiting on this process
            publish_failure(err, where=where, device=spec_device, key=failure_key(layout))
            return
