"""What the GPU measured, next to what the estimate said, and a per-device file that keeps later
estimates on that device from ever being below a measurement.

Every stage on a CUDA device resets torch's peak counters on entry and reads them on exit
(`torch.cuda.max_memory_allocated` / `max_memory_reserved`, the stage door does this): the figures,
with the estimate for that stage's phase under the installed mode, are a `MeasuredPeak`.
`measured_peaks()` lists the newest ones of this process (the doctor and the Memory Report read it),
and the log says both at INFO.

The calibration file (`calibration_path()`: `$LINGBOT_CALIBRATION`, else `lingbot/calibration.json`
under the user's cache folder; `LINGBOT_CALIBRATION=off` turns it off) holds, per device name and
offload mode, the largest ratio measured / estimated seen there. `record` raises a stored ratio (never
lowers it); `factor` reads it, at least 1. `estimate.estimate_peak` multiplies its result by the
factor of the device the door plans for (`on_device`), so `auto` and the fit check never plan below a
peak this machine has measured. The estimate is of `max_memory_allocated`, so the ratio's numerator is
the stage's own part of it: the peak less what others (a host's models, other nodes' tensors) held when
the stage started; the allocator's extra (reserved minus allocated) stays the fit check's `RESERVE_BYTES`.

The file is read bounded (`MAX_FILE_BYTES`) and a corrupt or foreign one counts as empty (with one
warning): it is a cache, rewritten whole (write to a temporary file, then rename) on the next record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import threading
from collections import deque
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from pathlib import Path
from stat import S_ISREG

import torch

log = logging.getLogger("lingbot_core.offload")

ENV = "LINGBOT_CALIBRATION"
OFF = "off"
MAX_FILE_BYTES = 1 << 20  # a calibration file is a few KB; a larger one is not ours
MAX_ENTRIES = 256  # devices kept in the file
MAX_NAME = 200  # characters of a device name (a longer one is not filed)
KEPT_PEAKS = 64  # measured peaks `measured_peaks()` keeps (the newest)
FORMAT = 1


@dataclass(frozen=True)
class MeasuredPeak:
    """One stage's measured peak on a CUDA device, next to its estimate (bytes; None: not estimated)."""

    stage: str
    device: str  # the device's name (`torch.cuda.get_device_name`)
    mode: str  # the offload mode installed
    estimate_bytes: int | None
    allocated_bytes: int  # torch.cuda.max_memory_allocated over the stage
    reserved_bytes: int  # torch.cuda.max_memory_reserved over the stage
    # allocated at the stage's start by others than this handle's resident components (a host's own
    # models, other nodes' tensors): part of the process's peak, not of this stage's
    foreign_bytes: int = 0

    @property
    def own_bytes(self) -> int:
        """The stage's own peak: the process's, less what others held when it started."""
        return max(self.allocated_bytes - self.foreign_bytes, 0)

    @property
    def ratio(self) -> float | None:
        """The stage's own measured peak over its estimate; None without an estimate."""
        return self.own_bytes / self.estimate_bytes if self.estimate_bytes else None

    def line(self) -> str:
        gib = 1024**3
        measured = f"peak {self.allocated_bytes / gib:.2f} GiB allocated ({self.reserved_bytes / gib:.2f} GiB reserved)"
        if self.foreign_bytes:
            measured += f", {self.foreign_bytes / gib:.2f} GiB of it held by others"
        if self.estimate_bytes is None:
            return f"{self.stage}: {measured}, no estimate"
        return f"{self.stage}: {measured}, estimate {self.estimate_bytes / gib:.2f} GiB (x{self.ratio:.2f})"

    def as_dict(self) -> dict:
        return asdict(self)


_PEAKS: deque[MeasuredPeak] = deque(maxlen=KEPT_PEAKS)
_LOCK = threading.Lock()
_WARNED: set[str] = set()
_DEVICE: ContextVar[str | None] = ContextVar("lingbot_calibration_device", default=None)


def measured_peaks() -> list[MeasuredPeak]:
    """The peaks the last stages of this process measured, oldest first (at most `KEPT_PEAKS`)."""
    with _LOCK:
        return list(_PEAKS)


def clear_measured() -> None:
    with _LOCK:
        _PEAKS.clear()


def device_name(device: torch.device) -> str | None:
    """The name calibration files its ratios under: the CUDA device's name; None for other devices."""
    if device.type != "cuda":
        return None
    try:
        return str(torch.cuda.get_device_name(device))
    except (RuntimeError, AssertionError, ValueError):  # no driver, or an index that is not there
        return None


# -- measuring a stage -----------------------------------------------------------------------------------

def start(device: torch.device, own_bytes: int = 0) -> tuple[str, int] | None:
    """Before a stage: reset the peak counters of a CUDA `device`; (its name, the bytes allocated now by
    others than the caller's `own_bytes`), or None (nothing measured)."""
    name = device_name(device)
    if name is None:
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return name, max(int(torch.cuda.memory_allocated(device)) - own_bytes, 0)


def finish(started: tuple[str, int], device: torch.device, stage: str, mode: str,
           estimate_bytes: int | None) -> MeasuredPeak:
    """After a stage `start` measured: read the peaks, keep them, log both figures, record the ratio."""
    name, foreign = started
    peak = MeasuredPeak(stage, name, mode, estimate_bytes, int(torch.cuda.max_memory_allocated(device)),
                        int(torch.cuda.max_memory_reserved(device)), foreign)
    with _LOCK:
        _PEAKS.append(peak)
    log.info("measured %s", peak.line())
    if estimate_bytes:
        record(name, mode, estimate_bytes, peak.own_bytes)
    return peak


# -- the calibration file --------------------------------------------------------------------------------

def calibration_path() -> Path | None:
    """Where the calibration file lives; None when `LINGBOT_CALIBRATION=off`."""
    given = os.environ.get(ENV, "").strip()
    if given.lower() == OFF:
        return None
    if given:
        return Path(given).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(cache) if cache else Path.home() / ".cache") / "lingbot" / "calibration.json"


def _warn_once(path: Path, why: str) -> None:
    key = f"{path}:{why}"
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("memory calibration file %s ignored (%s); it is rewritten on the next measurement", path, why)


_CACHE: dict[Path, tuple[tuple[int, int], dict[str, dict[str, float]]]] = {}


def load(path: Path | None = None) -> dict[str, dict[str, float]]:
    """The stored ratios, {device name: {mode: ratio}}; empty when there is no file or it is unusable.
    (Read again only when the file's size or modification time changed: `auto` asks many times a plan.)"""
    path = path if path is not None else calibration_path()
    if path is None:
        return {}
    try:
        stat = path.stat()
        if not S_ISREG(stat.st_mode):
            _warn_once(path, "not a regular file")
            return {}
        cached = _CACHE.get(path)
        if cached is not None and cached[0] == (stat.st_mtime_ns, stat.st_size):
            return {k: dict(v) for k, v in cached[1].items()}
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as err:
        _warn_once(path, f"cannot read it: {err.strerror or err}")
        return {}
    parsed = _parse(path, raw)
    _CACHE[path] = ((stat.st_mtime_ns, stat.st_size), parsed)
    return {k: dict(v) for k, v in parsed.items()}


def _parse(path: Path, raw: bytes) -> dict[str, dict[str, float]]:
    if len(raw) > MAX_FILE_BYTES:
        _warn_once(path, f"larger than {MAX_FILE_BYTES} bytes")
        return {}
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        _warn_once(path, "not valid JSON")
        return {}
    devices = data.get("devices") if isinstance(data, dict) and data.get("format") == FORMAT else None
    if not isinstance(devices, dict):
        _warn_once(path, "not a calibration file of this version")
        return {}
    out: dict[str, dict[str, float]] = {}
    for name, modes in devices.items():
        if not isinstance(name, str) or not isinstance(modes, dict):
            continue
        kept = {m: float(r) for m, r in modes.items() if isinstance(m, str) and _plausible(r)}
        if kept and len(name) <= MAX_NAME:
            out[name] = kept
    return out


def _plausible(ratio: object) -> bool:
    """A ratio a measurement can give: a finite number in (0, 100) (a file edited by hand may hold anything)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        return False
    try:
        return math.isfinite(float(ratio)) and 0 < float(ratio) < 100
    except OverflowError:
        return False


def _write(path: Path, devices: dict[str, dict[str, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".calibration-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"format": FORMAT, "devices": devices}, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def record(device: str, mode: str, estimate_bytes: int, measured_bytes: int, *, path: Path | None = None) -> float:
    """File the ratio measured / estimated for (`device`, `mode`) when it is larger than the stored one;
    returns the ratio stored now (1.0 where nothing is stored and nothing was written). Never raises for
    the file: a failure to write is a warning (the run goes on)."""
    if estimate_bytes <= 0 or measured_bytes < 0:
        raise ValueError(f"a calibration needs a positive estimate and a measured size, got {estimate_bytes}, "
                         f"{measured_bytes}")
    path = path if path is not None else calibration_path()
    ratio = measured_bytes / estimate_bytes
    if path is None or not device or len(device) > MAX_NAME:
        return ratio
    with _LOCK:
        devices = load(path)
        stored = devices.get(device, {}).get(mode)
        if stored is not None and stored >= ratio:
            return stored
        devices.setdefault(device, {})[mode] = ratio
        if len(devices) > MAX_ENTRIES:  # keep the file bounded: drop other devices first
            for other in [d for d in devices if d != device][:len(devices) - MAX_ENTRIES]:
                devices.pop(other)
        try:
            _write(path, devices)
        except OSError as err:
            _warn_once(path, f"cannot write it: {err.strerror or err}")
    return ratio


def factor(device: str | None, mode: str, *, path: Path | None = None) -> float:
    """What estimates for `mode` on `device` are multiplied by: the stored ratio, at least 1 (1 for no
    device, no file, or nothing stored for the pair)."""
    if device is None:
        return 1.0
    return max(1.0, load(path).get(device, {}).get(mode, 1.0))


@contextlib.contextmanager
def on_device(name: str | None) -> Iterator[None]:
    """Estimates made in this block (`estimate.estimate_peak`) are for device `name` (None: no device)."""
    token = _DEVICE.set(name)
    try:
        yield
    finally:
        _DEVICE.reset(token)


def scaled(mode: str, nbytes: int) -> int:
    """`nbytes` of an estimate under `mode`, scaled by the calibration of the device being planned for."""
    name = _DEVICE.get()
    if name is None:
        return nbytes
    return int(math.ceil(nbytes * factor(name, mode)))
