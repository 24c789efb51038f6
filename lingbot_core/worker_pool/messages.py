"""What rank 0 and LingBot Parallel's workers send each other: a message is a JSON header and
tensors broadcast from rank 0 (`broadcast_message`); each stage a pool runs packs its inputs on
rank 0 and unpacks them on the workers (`HANDLERS`); `gather_status` brings every worker's status
row to rank 0."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..components import DITS
from ..errors import RefusedInput
from .spec import PoolError

__all__ = ["HANDLERS", "MAX_HEADER_BYTES", "broadcast_message", "drop_dits", "first_frame_drawn", "gather_status"]

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                        torch.int64, torch.int32, torch.uint8, torch.bool)}
_DTYPE_NAMES = {d: n for n, d in _DTYPES.items()}
MAX_HEADER_BYTES = 1 << 20


# -- messages: a JSON header and tensors, broadcast from rank 0 --------------------------------------------

def broadcast_message(device: torch.device, kind: str | None = None, fields: dict | None = None,
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


def first_frame_drawn(kwargs: dict[str, Any]) -> dict[str, Any]:
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
        raise RefusedInput("an image condition reaches the workers as its drawn latent (`first_frame_drawn`)")
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


def drop_dits(handle: Any, names: list[str]) -> None:
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


def gather_status(device: torch.device, status: dict | None) -> list[dict[str, Any]]:
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
