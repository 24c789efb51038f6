"""What the stages do on a handle view that runs on several processes (`PipelineHandle.with_parallel`).

Every rank runs the same stages with the same arguments (the same graph, headless; the same call,
in a worker). Per stage:

- denoise / refine sampling: every rank samples; the DiT's forward is shared over the layout's
  ulysses group (`ulysses.py`) and, with cfg=2, the two guidance branches run on the two cfg rows
  (`cfg.py`). Every rank ends with the same latents (the collectives hand each rank the whole result).
- text encode, image encode, the refiner's VAE encode: rank 0 computes, the others receive its
  tensors (`broadcast_tensors`), so only rank 0 loads the text encoder and the VAE.
- decode: rank 0 decodes; the other ranks get a zero placeholder of the frames' shape (no memory
  behind it) and write nothing (`writes_outputs`).

A denoise reaches all of its parallel side through one object, `sampling(...)`: it refuses what the
layout cannot run and makes the ranks agree on the job before any model work, shards an FSDP
layout's DiT before the door moves it, builds the guidance (the cfg rows' or the plain one), and
around the sampling loop (`ParallelSampling.loop`) shares the step cache's figures, installs the
Ulysses hooks and yields the per-step status exchange. The hooks are removed after the loop
(success, error or interrupt), so the shared DiT is the one-process model between stages. On a
one-process view the same object gives the one-process behaviour.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..components import DITS
from ..errors import RefusedInput
from ..sampling.guidance import Guidance
from ..sampling.step_cache import StepCacheSettings
from .cfg import ParallelGuidance
from .layout import ParallelLayout
from .ulysses import disable_sequence_parallel, enable_sequence_parallel

__all__ = ["active_layout", "broadcast_tensors", "check_heads", "check_request", "check_view", "collective_device",
           "from_rank0", "is_leader", "offload_refusal", "ParallelSampling", "placeholder_frames", "process_layout",
           "sampling", "tensor_text", "text_tensor", "use_process_layout", "writes_outputs"]

T = TypeVar("T")
log = logging.getLogger(__name__)


_PROCESS: list[ParallelLayout | None] = [None]


def use_process_layout(layout: ParallelLayout | None) -> None:
    """Make `layout` the layout of every handle view in this process that sets none of its own
    (headless `--parallel`: the graph's Loader builds plain handles); None: no process layout."""
    _PROCESS[0] = layout if layout is not None and layout.world_size > 1 else None


def process_layout() -> ParallelLayout | None:
    return _PROCESS[0]


def active_layout(handle: Any) -> ParallelLayout | None:
    """The handle view's layout (else the process layout) when it spans more than one process, else None."""
    layout = handle.parallel
    if layout is None:
        layout = _PROCESS[0]
    return layout if layout is not None and layout.world_size > 1 else None


def is_leader(handle: Any) -> bool:
    """True on the rank that encodes, decodes and saves (rank 0), and in every one-process run."""
    layout = active_layout(handle)
    return layout is None or layout.rank == 0


def writes_outputs() -> bool:
    """Whether this process writes output files: False on every rank but 0 of the process layout."""
    layout = _PROCESS[0]
    return layout is None or layout.rank == 0


def check_view(handle: Any, layout: ParallelLayout | None) -> ParallelLayout | None:
    """Refuse a layout this handle cannot run with, before any model work; returns it."""
    if layout is None or layout.world_size == 1:
        return layout
    if not isinstance(layout, ParallelLayout):
        raise TypeError(f"with_parallel takes a ParallelLayout, got {type(layout).__name__}")
    if layout.mesh is None:
        raise RefusedInput(f"parallel layout {layout.describe()} has no process groups: build it with "
                         "ParallelLayout.create(cfg, ulysses) after init_process_group")
    mode = handle.offload.mode
    if mode not in ("none", "auto"):  # auto resolves to 'none' on several processes (placement.door)
        raise RefusedInput(offload_refusal(mode, layout))
    check_heads(handle, layout)
    return layout


def offload_refusal(mode: str, layout: ParallelLayout) -> str:
    """The one message that refuses an offload mode for a parallel layout (FSDP or not)."""
    if layout.fsdp:
        return (f"offload mode {mode!r} and FSDP do not combine: FSDP shards the DiT's blocks over the ranks and "
                f"an offload mode moves whole tensors; use offload 'none' with parallel {layout.describe()}")
    return (f"offload mode {mode!r} cannot run on several processes (each rank holds its own copy of the DiT): "
            f"use offload 'none' with parallel {layout.describe()}")


def shard_for_stage(handle: Any, name: str) -> None:
    """With an FSDP layout: shard DiT `name`'s blocks (once) before the stage door moves it onto the
    device, so a rank never holds the whole DiT on its device. It is loaded here, on the host, when
    it is not loaded yet (the one place a stage takes a component before its door: the door would
    move it whole)."""
    layout = active_layout(handle)
    if layout is None or not layout.fsdp:
        return
    from .fsdp import describe, is_fsdp_sharded, shard_dit

    mode = handle.offload.mode
    if mode not in ("none", "auto"):
        raise RefusedInput(offload_refusal(mode, layout))
    dit = handle.component(name)
    state = handle.shared.states.get(name)
    if state is not None and state.pristine and not is_fsdp_sharded(dit):
        # a LoRA merged into the whole weights and not taken off: put them back first, so its pristine
        # copies are never whole while the parameters are shards (the door merges it again, per rank)
        from ..lora.merging import restore

        restore(dit, state)
    if shard_dit(dit, layout):
        log.info("%s: FSDP over %d ranks, %s", name, layout.world_size, describe(dit))


def check_heads(handle: Any, layout: ParallelLayout) -> None:
    """Refuse a ulysses degree that does not divide the heads of the handle's DiTs (known from the
    checkpoint's config, or from a DiT in memory)."""
    info = handle.info
    heads = [(info.transformer_config or {}).get("num_attention_heads")] if info is not None else []
    heads += [m.spec.num_attention_heads for name, m in handle.shared.loaded.items()
              if name in DITS and hasattr(m, "spec")]
    for count in filter(None, heads):
        layout.check_heads(int(count))


def check_request(handle: Any, *, cfg_batch: str, step_cache: str = "off", guidance_scale: float | None = None) -> None:
    """Refuse denoise options that do not combine with the view's layout (before any model work).
    `step_cache`: the step cache method asked for; `guidance_scale`: the run's (None: not known)."""
    layout = active_layout(handle)
    if layout is None:
        return
    check_heads(handle, layout)
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.device(handle.device).type != "cuda":
        raise RefusedInput(f"the processes of this parallel run share each DiT forward over NCCL, on their GPUs, but "
                           f"the pipe runs on {handle.device}, whose tensors NCCL cannot send: set the Loader's device to "
                           "auto or cuda, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run every process on the CPU")
    if layout.cfg == 2 and guidance_scale is not None and guidance_scale <= 1.0:
        raise RefusedInput(f"CFG parallel (cfg=2) splits the two guidance branches over the processes, and at cfg "
                         f"{guidance_scale:g} there is only one (a DMD student runs cfg 1): use ulysses over all "
                         "of them instead (--parallel ulysses=N, LingBot Parallel's cfg 1)")
    if layout.fsdp and layout.cfg == 2 and step_cache != "off":
        raise RefusedInput("a step cache and FSDP with CFG parallel (cfg=2) do not combine: each cfg row decides "
                         "from its own guidance branch which blocks to skip, and FSDP gathers every block's "
                         "weights from all processes, so the rows' collectives would no longer match; turn the "
                         "step cache off, or run cfg=1 (ulysses over all processes), or without FSDP")
    if step_cache == "magcache_calibrate":
        raise RefusedInput(f"MagCache calibration runs on one process (each cfg row would record only its own "
                         f"branch); calibrate without parallel {layout.describe()}, then use 'magcache' with it")
    if layout.cfg == 2 and cfg_batch == "on":
        raise RefusedInput("cfg_batch 'on' and CFG parallel (cfg=2) are two ways of running both guidance "
                         "branches at once; turn cfg_batch off for a cfg=2 layout")


def agree_on_job(handle: Any, fields: dict[str, Any]) -> None:
    """On a parallel view: refuse, on every rank, a job whose `fields` differ between the ranks of the
    video (`agree.check_same_job`); nothing in a one-process run."""
    layout = active_layout(handle)
    if layout is None:
        return
    from .agree import check_same_job

    check_same_job(fields, group=layout.group, device=collective_device(handle), world_size=layout.world_size,
                   what=f"parallel run ({layout.describe().split(' (')[0]})")


def share_step_cache(cache: Any, layout: ParallelLayout | None) -> None:
    """Make a step cache decide alike on every rank of a ulysses group: its figures (the first
    block's change, MagCache's calibration norms) are summed over the group's shares of the sequence.
    CFG rows need nothing: each keeps its own branch's state, as one process keeps both."""
    if cache is None or layout is None or layout.ulysses == 1:
        return
    group = layout.ulysses_group

    def summed(partial: torch.Tensor) -> torch.Tensor:
        partial = partial.clone()
        dist.all_reduce(partial, group=group)
        return partial

    cache.reduce = summed


@contextmanager
def sequence_parallel(dit: torch.nn.Module, layout: ParallelLayout | None) -> Iterator[None]:
    """The DiT shares its forward over `layout`'s ulysses group inside the block, and is the
    one-process model again after it (whatever happens inside)."""
    if layout is None or layout.ulysses == 1:
        yield
        return
    enable_sequence_parallel(dit, layout)
    try:
        yield
    finally:
        disable_sequence_parallel(dit)


@dataclass(frozen=True)
class ParallelSampling:
    """The parallel side of one sampling loop on `handle` (`sampling`); `layout` is None on a
    one-process view, where every method gives the one-process behaviour."""

    handle: Any
    layout: ParallelLayout | None

    @property
    def splits_cfg(self) -> bool:
        """True when the two guidance branches run on the layout's two cfg rows (so never as one batch)."""
        return self.layout is not None and self.layout.cfg == 2

    def guidance(self, dit: torch.nn.Module, positive: Any, negative: Any | None, scale: float, *,
                 dtype: torch.dtype, device: torch.device, batch_cfg: bool = False) -> Guidance:
        """The DiT's guided prediction: on a cfg=2 layout cond on cfg row 0 and uncond on row 1."""
        if self.splits_cfg:
            return ParallelGuidance(dit, positive, negative, scale, layout=self.layout, dtype=dtype, device=device)
        return Guidance(dit, positive, negative, scale, dtype=dtype, device=device, batch_cfg=batch_cfg)

    @contextmanager
    def loop(self, guidance: Guidance) -> Iterator[Any]:
        """Around the sampling loop: the guidance's step cache decides alike on every rank
        (`share_step_cache`), the DiT shares its sequence over the ulysses group (`sequence_parallel`,
        removed afterwards), and the per-step status exchange is yielded (`step_status`; None on one
        process) for the loop to hear a rank that stopped."""
        share_step_cache(guidance.cache, self.layout)
        with sequence_parallel(guidance.dit, self.layout):
            yield step_status(self.handle)


def sampling(handle: Any, transformer: str, cond: Any, *, cfg_batch: str, step_cache: Any, guidance_scale: float,
             job: dict[str, Any]) -> ParallelSampling:
    """A denoise's parallel side, before any model work: refuse options the view's layout cannot run
    (`check_request`), make every rank of the video agree on the job (`cond`, the options and `job`, the
    denoise's other arguments: `job_fields`, `agree_on_job`), and with FSDP shard DiT `transformer`
    before the stage door moves it (`shard_for_stage`). `step_cache`: a method name or settings."""
    check_request(handle, cfg_batch=cfg_batch, step_cache=StepCacheSettings.of(step_cache).method,
                  guidance_scale=guidance_scale)
    layout = active_layout(handle)
    if layout is not None:  # every rank runs the same job, or none does
        agree_on_job(handle, job_fields(cond, transformer=transformer, cfg_batch=cfg_batch, step_cache=step_cache,
                                        guidance_scale=guidance_scale, **job))
        shard_for_stage(handle, transformer)
    return ParallelSampling(handle, layout)


def job_fields(cond: Any, *, seed: int | None, generator: torch.Generator | None, sigmas: Any, sampler: Any,
               step_cache: Any, image_cond: Any, **plain: Any) -> dict[str, Any]:
    """What a denoise runs, as the ranks of a parallel run compare it before they start
    (`agree_on_job`): the geometry, schedule and sampler, the seed (or the generator's state), the
    prompts and the starting and first-frame latents."""
    fields = dict(plain)
    fields["seed"] = generator if generator is not None else seed
    fields["sigmas"] = None if sigmas is None else torch.as_tensor(sigmas, dtype=torch.float32)  # as a pool sends it
    fields["sampler"] = sampler if sampler is None or isinstance(sampler, str) else type(sampler).__name__
    fields["step_cache"] = repr(StepCacheSettings.of(step_cache))
    fields["prompt"] = [cond.prompt, cond.zero_negative, cond.with_image] + [
        (e.embeds, e.mask) if e is not None else None for e in (cond.positive, cond.negative)]
    fields["image"] = None if image_cond is None else (image_cond.latent_mean, image_cond.latent_std)
    return fields


# -- rank 0 computes, the others receive -------------------------------------------------------------

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.bool, torch.int8, torch.int16)


def broadcast_tensors(tensors: dict[str, torch.Tensor | None] | None, names: tuple[str, ...], *, src: int = 0,
                      group: Any = None, device: torch.device | str = "cpu") -> dict[str, torch.Tensor | None]:
    """Rank `src`'s (a global rank) named tensors on every rank of `group` (None: the world) (`tensors` is read on `src` only; None entries stay None).

    Only tensors cross: a header (dtype index and shape per name) and then each tensor, with
    `dist.broadcast`; nothing is pickled. `device` is where the collective runs (cuda for NCCL).
    Returned tensors are on the CPU.
    """
    device = torch.device(device)
    leader = dist.get_rank() == src
    width = 1 + 1 + 8  # present flag, dtype index, up to 8 dims (a missing dim is -1)
    header = torch.full((len(names), width), -1, dtype=torch.int64)
    if leader:
        for i, name in enumerate(names):
            t = tensors.get(name) if tensors is not None else None
            if t is None:
                header[i, 0] = 0
                continue
            if t.dtype not in _DTYPES or t.ndim > 8:
                raise TypeError(f"broadcast_tensors: {name} has dtype {t.dtype} and {t.ndim} dims")
            header[i, 0], header[i, 1] = 1, _DTYPES.index(t.dtype)
            header[i, 2:2 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
    header = header.to(device)
    dist.broadcast(header, src, group=group)
    header = header.cpu()
    out: dict[str, torch.Tensor | None] = {}
    for i, name in enumerate(names):
        if header[i, 0] == 0:
            out[name] = None
            continue
        dtype = _DTYPES[int(header[i, 1])]
        shape = [int(d) for d in header[i, 2:] if d >= 0]
        if leader:
            buf = tensors[name].detach().to(device).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buf, src, group=group)
        out[name] = buf.cpu() if not leader else tensors[name]
    return out


def text_tensor(value: str) -> torch.Tensor:
    return torch.tensor(list(value.encode("utf-8")), dtype=torch.uint8)


def tensor_text(t: torch.Tensor | None) -> str:
    return "" if t is None else bytes(t.tolist()).decode("utf-8")


def from_rank0(handle: Any, compute: Callable[[], T], pack: Callable[[T], dict[str, torch.Tensor | None]],
               unpack: Callable[[dict[str, torch.Tensor | None]], T], names: tuple[str, ...]) -> T:
    """`compute()` on rank 0 of the view's layout, its result on every rank (through `pack` -> tensors
    -> `unpack`); in a one-process view just `compute()`. If rank 0 fails, every rank raises."""
    layout = active_layout(handle)
    if layout is None:
        return compute()
    device = collective_device(handle)
    failed = torch.zeros(1, dtype=torch.int64, device=device)
    result: T | None = None
    error: BaseException | None = None
    if layout.rank == 0:
        try:
            result = compute()
        except BaseException as err:  # the others must not wait for tensors that never come
            error = err
            failed += 1
    dist.broadcast(failed, layout.leader_rank, group=layout.group)
    if int(failed.item()):
        if error is not None:
            raise error
        raise RuntimeError("rank 0 failed in a stage it computes for every rank (see its error)")
    packed = pack(result) if layout.rank == 0 else None
    got = broadcast_tensors(packed, names, src=layout.leader_rank, group=layout.group, device=device)
    return result if layout.rank == 0 else unpack(got)


def collective_device(handle: Any) -> torch.device:
    """Where this view's collectives run: its CUDA device under NCCL, else the CPU."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    if backend == "nccl":
        device = torch.device(handle.device)
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def step_status(handle: Any) -> Any:
    """The per-step status exchange (`abort.StepStatus`) of a sampling loop on the view's layout, or
    None in a one-process run: a rank that fails between two steps stops the others at once."""
    if active_layout(handle) is None:
        return None
    from .abort import StepStatus

    return StepStatus(active_layout(handle), collective_device(handle))


def placeholder_frames(frames: int, height: int, width: int) -> torch.Tensor:
    """What decode returns on the ranks that do not decode: zeros of the frames' shape, one stored value."""
    return torch.zeros(1, 1, 1, 1, dtype=torch.float32).expand(frames, height, width, 3)
