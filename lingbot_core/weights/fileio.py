"""Opening weight files that may be anything and may change while they are read.

A path a user gives as a weights file may be a directory, a FIFO (opening it blocks), a device
(`/dev/zero` never ends) or a link to one; `regular_file_problem` says which, so the message names
what the path is rather than "does not exist". `open_regular` opens without blocking and refuses
anything but a regular file on the descriptor itself (no race between the check and the open).

A file may also be truncated or replaced while it is read (a download still running, a model
swapped on disk mid-run). Mapping it would turn a truncation into SIGBUS (the whole process, in
ComfyUI the server), so headers and tensors are read with `pread` and every short read is an error;
and a file reopened later (disk offload reads its tensors at every step) is checked to be the one
that was read at first (`Identity`: device, inode, size, modification time), so a replaced file is
refused in one line instead of mixing two models' weights.

Reads at an offset (`read_at`, `readinto_at`, `write_at`) are `os.pread`/`preadv`/`pwrite` where the
platform has them (POSIX). Windows has none of them: there a seek and a read (or write) run under one
lock per descriptor, so two threads reading one file at different offsets never see each other's seek;
descriptors are opened with `BINARY` (Windows opens in text mode by default, which would rewrite line
ends and stop at a Ctrl-Z byte in the weights).
"""

from __future__ import annotations

import io
import os
import stat
import threading
from dataclasses import dataclass

from ..errors import CheckpointError

BINARY = getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
"""Flags every descriptor of ours is opened with, besides its access mode: binary (Windows) and not
inherited by child processes (POSIX)."""
_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | BINARY

_SEEK_LOCKS: dict[int, threading.Lock] = {}
_SEEK_LOCKS_GUARD = threading.Lock()


def _seek_lock(fd: int) -> threading.Lock:
    with _SEEK_LOCKS_GUARD:
        return _SEEK_LOCKS.setdefault(fd, threading.Lock())


def read_at(fd: int, n: int, offset: int) -> bytes:
    """Up to `n` bytes of `fd` at `offset` (fewer only at the end of the file)."""
    if hasattr(os, "pread"):
        return os.pread(fd, n, offset)
    with _seek_lock(fd):
        os.lseek(fd, offset, os.SEEK_SET)
        return os.read(fd, n)


def readinto_at(fd: int, out: memoryview, offset: int) -> int:
    """Read into `out` (a writable byte view) from `offset`; how many bytes came (fewer only at the end)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [out], offset)
    with _seek_lock(fd):
        os.lseek(fd, offset, os.SEEK_SET)
        with io.FileIO(fd, "r", closefd=False) as raw:
            return raw.readinto(out) or 0


def write_at(fd: int, data: bytes, offset: int) -> int:
    """Write `data` to `fd` at `offset`; how many bytes went."""
    if hasattr(os, "pwrite"):
        return os.pwrite(fd, data, offset)
    with _seek_lock(fd):
        os.lseek(fd, offset, os.SEEK_SET)
        return os.write(fd, data)


@dataclass(frozen=True)
class Identity:
    """Which file a path named when it was checked: a different one (replaced, rewritten, truncated)
    differs in at least one field."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> Identity:
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def kind_of(mode: int) -> str:
    """What a non-regular file is, as a message says it."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def regular_file_problem(path: str | os.PathLike) -> str | None:
    """None for a regular file (or a link to one); else what the path is, as a phrase that follows
    the path in a message: "does not exist", "is a directory", "is a FIFO (named pipe)", ..."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    except (OSError, ValueError) as err:
        return f"cannot be read ({getattr(err, 'strerror', None) or err})"
    if stat.S_ISREG(info.st_mode):
        return None
    return f"is {kind_of(info.st_mode)}, not a weights file"


def open_regular(path: str | os.PathLike, error: type[Exception] = CheckpointError) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file at `path` and its `fstat`; anything else is refused
    with `error` naming what the path is. The open never blocks (a FIFO is never waited on)."""
    problem = regular_file_problem(path)
    if problem is not None:
        raise error(f"{path} {problem}.")
    try:
        fd = os.open(path, _FLAGS)
    except OSError as err:
        raise error(f"{path} cannot be opened ({err.strerror or err}).") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # replaced between the check and the open
        os.close(fd)
        raise error(f"{path} is {kind_of(info.st_mode)}, not a weights file.")
    return fd, info


def pread_exact(fd: int, n: int, offset: int, path: str | os.PathLike,
                error: type[Exception] = CheckpointError) -> bytes:
    """Exactly `n` bytes at `offset`; a short read (the file shrank since it was checked) is refused."""
    parts, got = [], 0
    while got < n:
        chunk = read_at(fd, min(n - got, 1 << 26), offset + got)
        if not chunk:
            raise error(f"{path} changed while it was read (it ended at byte {offset + got}, {n - got} bytes "
                        "short); it is being written or was replaced. Wait for the copy to finish, then run again.")
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def pread_into(fd: int, out: memoryview, offset: int, path: str | os.PathLike,
               error: type[Exception] = CheckpointError) -> None:
    """Fill `out` (a writable byte view) from `offset`; a short read is refused as in `pread_exact`."""
    got, n = 0, len(out)
    while got < n:
        k = readinto_at(fd, out[got:got + (1 << 28)], offset + got)
        if not k:
            raise error(f"{path} changed while it was read (it ended at byte {offset + got}, {n - got} bytes "
                        "short); it is being written or was replaced. Wait for the copy to finish, then run again.")
        got += k


def check_same_file(path: str | os.PathLike, fd: int, expected: Identity | None,
                    error: type[Exception] = CheckpointError) -> None:
    """Refuse an open file that is not the one checked at first (replaced, rewritten or resized)."""
    if expected is None:
        return
    now = Identity.of(os.fstat(fd))
    if now != expected:
        what = ("was replaced by another file" if (now.device, now.inode) != (expected.device, expected.inode)
                else f"changed size ({expected.size} -> {now.size} bytes)" if now.size != expected.size
                else "was rewritten")
        raise error(f"{path} {what} since it was loaded; its weights would mix two files. Reload the model "
                    "(run the Loader again) after the file is final.")
