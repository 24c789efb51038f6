"""The converted-weights cache of disk offload: tensors the loader had to convert, written once.

A DiT loaded for disk offload (`load_dit(streamed=True)`) keeps nothing in host memory, but a tensor
that was converted on load (a dtype change, fp8 quantized on load) has no bytes in the checkpoint
to stream from. Those tensors are converted once, written to one safetensors file in the user cache
(`tiny.cache_root()/converted/`, next to the tiny checkpoints), and streamed from there like the
checkpoint's own tensors.

Key. The file is named after a digest of what it depends on: every source file's identity (resolved
path, device and inode, size, modification and change times) and a cheap content check (a hash of
the file's first `HEAD_BYTES`, which hold the header, and of `SAMPLES` blocks spread over the rest),
the conversion (load dtype, weights mode, `FORMAT_VERSION`) and the planned tensors (names, dtypes,
shapes). A checkpoint replaced by a same-size file with the same modification time (`cp -p`,
`rsync -a`, an archive with normalised times) therefore maps to a new cache: its change time and
inode, and almost always its sampled bytes, differ. (A `chmod`, a new hard link or a move also
changes the change time; the checkpoint is then converted once more, which is only slower.) The
file records its digest, and a file whose header, digest or size disagree (a torn write, a foreign
file) is rebuilt.

Files in use are never deleted. Every process streaming from a cache file holds a shared `flock` on
it for as long as any of its spans lives (`Lease`, carried by each `CachedSpan`; dropping the
model releases it). Writers go to a private temporary file (held the same way) that is published
under its final name only if no other writer got there first. Eviction is per checkpoint path:
when a new conversion of a checkpoint is written, its other cache files are deleted only if an
exclusive lock on them can be taken at once, i.e. no handle in any process streams from them; a
file still in use stays and goes at a later write once it is free. Temporary files of a writer that
died go the same way. Where `fcntl` does not exist (Windows) nothing is ever deleted automatically:
the folder can be emptied by hand while no run is active.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .disk import FileSpan
from .fileio import BINARY, read_at
from .safetensors_header import safetensors_dtype

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, so no automatic eviction either
    fcntl = None

log = logging.getLogger("lingbot_core.weights")

FORMAT_VERSION = 1
"""Bump when a conversion's output changes (fp8 rounding, say): older caches then stop matching."""
DIGEST_KEY = "lingbot_converted"
HEAD_BYTES = 1 << 20
"""The content check hashes this many leading bytes of each source file (a safetensors header and
the first tensors; a GGUF header and its metadata)..."""
SAMPLES, SAMPLE_BYTES = 32, 1 << 14
"""...and this many blocks of this size spread evenly over the rest (0.5 MiB per file)."""


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


class Lease:
    """A shared lock on one cache file, held by an open descriptor until the last span using it goes.

    While it is held, no eviction (in this process or another) deletes the file."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._close = weakref.finalize(self, os.close, fd)

    def __deepcopy__(self, memo: dict) -> Lease:  # a copied model shares its spans' lease
        return self

    def __copy__(self) -> Lease:
        return self


@dataclass(frozen=True)
class CachedSpan(FileSpan):
    """A span in a converted-weights cache file; it keeps the file's `Lease` alive."""

    lease: Lease | None = field(default=None, compare=False, repr=False)


def cache_folder() -> Path:
    from ..tiny import cache_root, check_cache_folder

    folder = cache_root() / "converted"
    check_cache_folder(folder)
    return folder


def _content(path: Path, size: int) -> str:
    """Hash of the first HEAD_BYTES of the file and of SAMPLES blocks spread over the rest."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb", buffering=0) as fh:
        h.update(fh.read(HEAD_BYTES))
        rest = size - HEAD_BYTES
        if rest > 0:
            step = max(rest // SAMPLES, 1)
            for i in range(SAMPLES):
                at = HEAD_BYTES + min(i * step + step // 2, rest - 1)
                fh.seek(at)
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()


def identity(files: Sequence[Path]) -> list[list]:
    """What a cache depends on in the source files: resolved path, device, inode, size, mtime, ctime
    and the sampled content hash of each."""
    out = []
    for f in files:
        st = os.stat(f)
        out.append([str(Path(f).resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                    _content(Path(f), st.st_size)])
    return out


def _digest(files: Sequence[Path], recipe: dict, plan: Sequence[Planned]) -> tuple[str, str]:
    key = {"version": FORMAT_VERSION, "files": identity(files), "recipe": recipe,
           "tensors": [[p.name, safetensors_dtype(p.dtype), list(p.shape)] for p in plan]}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    where = hashlib.sha256(json.dumps(key["files"][0][0]).encode()).hexdigest()[:12]
    return where, digest


def _header(plan: Sequence[Planned], digest: str) -> bytes:
    header: dict = {"__metadata__": {"format": "pt", DIGEST_KEY: digest}}
    offset = 0
    for p in plan:
        header[p.name] = {"dtype": safetensors_dtype(p.dtype), "shape": list(p.shape), "data_offsets": [offset, offset + p.nbytes]}
        offset += p.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return len(raw + b" " * (-len(raw) % 8)).to_bytes(8, "little") + raw + b" " * (-len(raw) % 8)


def _spans(path: Path, header: bytes, plan: Sequence[Planned], lease: Lease | None) -> dict[str, FileSpan]:
    base, spans, offset = len(header), {}, 0
    for p in plan:
        spans[p.name] = CachedSpan(str(path), base + offset, p.nbytes, p.dtype, tuple(p.shape), lease=lease)
        offset += p.nbytes
    return spans


def _lock(fd: int, exclusive: bool, wait: bool) -> bool:
    if fcntl is None:
        return not exclusive  # without locks: share freely, never evict
    flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
    try:
        fcntl.flock(fd, flags)
    except BlockingIOError:
        return False
    return True


def _same_file(fd: int, path: Path) -> bool:
    """Is the file open as `fd` still the one named `path` (not deleted or replaced meanwhile)?"""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _leased_valid(path: Path, header: bytes, plan: Sequence[Planned]) -> Lease | None:
    """A lease on `path` if it holds exactly this cache (same header, digest included, and every byte
    of data), else None. The lock is taken before the check, so the file cannot go in between."""
    for _attempt in range(3):
        try:
            fd = os.open(path, os.O_RDONLY | BINARY)
        except OSError:
            return None
        lease = Lease(fd)
        _lock(fd, exclusive=False, wait=True)
        if not _same_file(fd, path):  # evicted or replaced between open and lock: look again
            continue
        try:
            found = read_at(fd, len(header), 0)
            size = os.fstat(fd).st_size
        except OSError:
            return None
        ok = found == header and size == len(header) + sum(p.nbytes for p in plan)
        return lease if ok else None
    return None


def evict(where: str, keep: Path | None = None) -> list[Path]:
    """Delete this checkpoint's cache files (and dead writers' temporary files) that no handle in any
    process streams from; files in use are skipped. Returns the files deleted."""
    folder = cache_folder()
    gone = []
    candidates = [*folder.glob(f"{where}-*.safetensors"), *folder.glob(f".{where}-*.tmp-*")]
    for old in candidates:
        if keep is not None and old == keep:
            continue
        try:
            fd = os.open(old, os.O_RDONLY | BINARY)
        except OSError:
            continue
        try:
            if _lock(fd, exclusive=True, wait=False) and _same_file(fd, old):
                old.unlink(missing_ok=True)
                gone.append(old)
            else:
                log.debug("converted-weights cache %s is in use; kept", old)
        finally:
            os.close(fd)
    return gone


def cached(files: Sequence[Path], recipe: dict, groups: Sequence[tuple[Sequence[Planned], Producer]]
           ) -> dict[str, FileSpan]:
    """Disk homes of the converted tensors: the cache when it is valid, else written now (converting
    group by group, one at a time in memory) and then used. `recipe`: the conversion's parameters.
    The returned spans hold a lease on the file: it is not deleted while any of them lives."""
    plan = [p for specs, _produce in groups for p in specs]
    if not plan:
        return {}
    where, digest = _digest(files, recipe, plan)
    folder = cache_folder()
    path = folder / f"{where}-{digest}.safetensors"
    header = _header(plan, digest)
    lease = _leased_valid(path, header, plan)
    if lease is not None:
        return _spans(path, header, plan, lease)
    if path.exists():
        log.warning("converted-weights cache %s is incomplete or stale; rebuilding it", path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | BINARY, 0o644)
        lease = Lease(fd)
        _lock(fd, exclusive=False, wait=True)  # held from the first byte: no eviction takes it
        with open(os.dup(fd), "wb") as fh:
            fh.write(header)
            for specs, produce in groups:
                tensors = produce()
                for p, t in zip(specs, tensors):
                    if t.dtype != p.dtype or tuple(t.shape) != p.shape:
                        raise AssertionError(f"{p.name}: produced {t.dtype} {list(t.shape)}, planned "
                                             f"{p.dtype} {list(p.shape)}")
                    fh.write(t.contiguous().view(torch.uint8).numpy().data)
                del tensors
        lease = _publish(tmp, path, header, plan, lease)
    except OSError as err:
        raise OSError(f"disk offload could not write its converted-weights cache {path} ({err}); free disk "
                      "space (or point LINGBOT_TINY_DIR elsewhere), pre-quantize the checkpoint with "
                      "`python -m lingbot_core.quantize`, load it in its stored dtype, or use offload_to='ram'.") from err
    finally:
        _remove_temporary(tmp)
    evict(where, keep=path)  # other conversions of this checkpoint, unless in use
    log.info("disk offload: wrote %d converted tensors to %s", len(plan), path)
    return _spans(path, header, plan, lease)


def _remove_temporary(tmp: Path) -> None:
    """Remove the written file's temporary name. Windows refuses to remove a file that is open (the lease
    holds it): the name then stays until `evict` finds it free (a dead writer's temporary file)."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError as err:
        log.debug("converted-weights cache: %s stays for now (%s)", tmp, err)


def _publish(tmp: Path, path: Path, header: bytes, plan: Sequence[Planned], lease: Lease) -> Lease:
    """Give the written `tmp` its final name, unless another writer published the same cache first
    (then that one is used). Returns the lease on the file now named `path`."""
    try:
        os.link(tmp, path)  # fails if the name is taken: a valid file in use is never replaced
        return lease
    except FileExistsError:
        theirs = _leased_valid(path, header, plan)
        if theirs is not None:
            return theirs
    except OSError:  # a file system without hard links
        pass
    os.replace(tmp, path)  # the name holds a torn or foreign file (or links are not possible)
    return lease
