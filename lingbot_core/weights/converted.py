"""The converted-weights cache of disk offload: tensors the loader had to convert, written once.

A DiT loaded for disk offload (`load_dit(streamed=True)`) keeps nothing in host memory, but a tensor
that was converted on load (a dtype change, fp8 quantized on load) has no bytes in the checkpoint
to stream from. Those tensors are converted once, written to one safetensors file in the user cache
(`tiny.cache_root()/converted/`, next to the tiny checkpoints), and streamed from there like the
checkpoint's own tensors.

The file is named after a digest of what it depends on: every source file's identity (resolved
path, size, modification time), the conversion (load dtype, weights mode, `FORMAT_VERSION`) and the
planned tensors (names, dtypes, shapes). A changed checkpoint therefore never maps to an old cache;
the file also records that digest, and a file whose header, digest, tensors or size disagree (a
torn write, a foreign file) is rebuilt. Writers go to a private temporary file renamed into place,
so concurrent loads of the same checkpoint are safe (the contents are identical; the last rename
wins), and older caches of the same checkpoint path are removed when a new one is written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .disk import FileSpan

log = logging.getLogger("lingbot_core.weights")

FORMAT_VERSION = 1
"""Bump when a conversion's output changes (fp8 rounding, say): older caches then stop matching."""
DIGEST_KEY = "lingbot_converted"
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.uint8: "U8",
           torch.int32: "I32"}


@dataclass(frozen=True)
class Planned:
    """One converted tensor: its model name, the dtype and shape it is held in."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


Producer = Callable[[], Sequence[torch.Tensor]]
"""Converts one group of planned tensors (fp8 values and their scales come from one quantization)."""


def cache_folder() -> Path:
    from ..tiny import cache_root

    return cache_root() / "converted"


def identity(files: Sequence[Path]) -> list[list]:
    """What a cache depends on in the source files: resolved path, size and mtime of each."""
    out = []
    for f in files:
        st = os.stat(f)
        out.append([str(Path(f).resolve()), st.st_size, st.st_mtime_ns])
    return out


def _digest(files: Sequence[Path], recipe: dict, plan: Sequence[Planned]) -> tuple[str, str]:
    key = {"version": FORMAT_VERSION, "files": identity(files), "recipe": recipe,
           "tensors": [[p.name, _DTYPES[p.dtype], list(p.shape)] for p in plan]}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    where = hashlib.sha256(json.dumps(key["files"][0][0]).encode()).hexdigest()[:12]
    return where, digest


def _header(plan: Sequence[Planned], digest: str) -> bytes:
    header: dict = {"__metadata__": {"format": "pt", DIGEST_KEY: digest}}
    offset = 0
    for p in plan:
        header[p.name] = {"dtype": _DTYPES[p.dtype], "shape": list(p.shape), "data_offsets": [offset, offset + p.nbytes]}
        offset += p.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return len(raw + b" " * (-len(raw) % 8)).to_bytes(8, "little") + raw + b" " * (-len(raw) % 8)


def _spans(path: Path, header: bytes, plan: Sequence[Planned]) -> dict[str, FileSpan]:
    base, spans, offset = len(header), {}, 0
    for p in plan:
        spans[p.name] = FileSpan(str(path), base + offset, p.nbytes, p.dtype, tuple(p.shape))
        offset += p.nbytes
    return spans


def _valid(path: Path, header: bytes, plan: Sequence[Planned]) -> bool:
    """Does `path` hold exactly this cache (same header, digest included, and every byte of data)?"""
    try:
        with open(path, "rb") as fh:
            found = fh.read(len(header))
        return found == header and path.stat().st_size == len(header) + sum(p.nbytes for p in plan)
    except OSError:
        return False


def cached(files: Sequence[Path], recipe: dict, groups: Sequence[tuple[Sequence[Planned], Producer]]
           ) -> dict[str, FileSpan]:
    """Disk homes of the converted tensors: the cache when it is valid, else written now (converting
    group by group, one at a time in memory) and then used. `recipe`: the conversion's parameters."""
    plan = [p for specs, _produce in groups for p in specs]
    if not plan:
        return {}
    where, digest = _digest(files, recipe, plan)
    folder = cache_folder()
    path = folder / f"{where}-{digest}.safetensors"
    header = _header(plan, digest)
    if _valid(path, header, plan):
        return _spans(path, header, plan)
    if path.exists():
        log.warning("converted-weights cache %s is incomplete or stale; rebuilding it", path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            fh.write(header)
            for specs, produce in groups:
                tensors = produce()
                for p, t in zip(specs, tensors):
                    if t.dtype != p.dtype or tuple(t.shape) != p.shape:
                        raise AssertionError(f"{p.name}: produced {t.dtype} {list(t.shape)}, planned "
                                             f"{p.dtype} {list(p.shape)}")
                    fh.write(t.contiguous().view(torch.uint8).numpy().data)
                del tensors
        os.replace(tmp, path)
    except OSError as err:
        raise OSError(f"disk offload could not write its converted-weights cache {path} ({err}); free disk "
                      "space (or point LINGBOT_TINY_DIR elsewhere), pre-quantize the checkpoint with "
                      "`python -m lingbot_core.quantize`, load it in its stored dtype, or use offload_to='ram'.") from err
    finally:
        tmp.unlink(missing_ok=True)
    for old in folder.glob(f"{where}-*.safetensors"):  # caches of older versions of this checkpoint
        if old != path:
            old.unlink(missing_ok=True)
    log.info("disk offload: wrote %d converted tensors to %s", len(plan), path)
    return _spans(path, header, plan)
