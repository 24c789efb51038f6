"""What LingBot Parallel's workers need, as plain data: the devices, the degrees, the checkpoint
(`PoolSpec`, `describe_handle` / `open_described`) and the view's LoRA stack (`pooled_loras`), each
checked on rank 0 before any process starts or any call is sent."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..distributed.launch import require_nccl
from ..distributed.layout import CFG_DEGREES, ParallelLayout, pooled_offload_refusal
from ..errors import RefusedInput
from ..placement.settings import same_device

log = logging.getLogger("lingbot_core.worker_pool")

__all__ = ["COLLECTIVE_TIMEOUT", "MAX_CPU_RANKS", "PoolError", "PoolSpec", "check_pooled", "describe_handle",
           "open_described", "parse_devices", "pooled_loras", "with_pooled_loras"]

#: the collectives' timeout (a first call loads the DiT on every rank: minutes for a real checkpoint)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


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
        if names and names[0].startswith("cuda"):
            require_nccl("LingBot Parallel")
        if len(names) < 2:
            raise RefusedInput(f"LingBot Parallel needs two or more devices (got {len(names)}); with one, use the "
                             "pipe directly")
        if not same_device(names[0], handle.device):
            raise RefusedInput(f"devices: the first device is this process's (rank 0), which runs the pipe on "
                             f"{handle.device}; list {handle.device} first, then the workers' devices")
        if cfg not in CFG_DEGREES:
            raise RefusedInput(f"cfg degree {cfg}: choose one of {CFG_DEGREES}")
        world = len(names)
        heads = (handle.info.transformer_config or {}).get("num_attention_heads") if handle.info else None
        if not ulysses:  # auto: say what it chose from what the user gave, not a degree they never set
            ulysses = auto_ulysses(world, cfg, int(heads) if heads else None)
        if cfg * ulysses != world:
            raise RefusedInput(f"cfg={cfg} x ulysses={ulysses} must equal the {world} devices given")
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


def auto_ulysses(world: int, cfg: int, heads: int | None) -> int:
    """LingBot Parallel's ulysses on auto (0): the device count / cfg. Refused, in terms of what the user
    set (devices and cfg branches), when that is no whole number or does not divide the DiT's heads."""
    if world % cfg:
        raise RefusedInput(f"{world} devices do not split into {cfg} CFG branches (ulysses on auto gives each "
                           f"branch the device count / cfg): list a multiple of {cfg} devices, or set cfg to 1")
    ulysses = world // cfg
    if heads and heads % ulysses:
        fits = [n * cfg for n in range(1, heads + 1) if heads % n == 0 and 2 <= n * cfg <= max(world, 8)]
        raise RefusedInput(f"ulysses on auto chose {ulysses} ({world} devices / cfg {cfg}), which does not divide "
                           f"the DiT's {heads} attention heads: list {' or '.join(map(str, fits))} devices")
    return ulysses


# -- the view's state that crosses to the workers ----------------------------------------------------------

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


def with_pooled_loras(view: Any, rows: list[list[Any]], files: dict[str, Any]) -> Any:
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
