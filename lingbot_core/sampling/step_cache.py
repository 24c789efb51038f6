"""Step caching: skip DiT blocks on steps whose result the previous step already predicts.

Methods (`STEP_CACHE`, the option's choices; `off` is the default):
- `first_block`: model-agnostic residual threshold (First-Block Cache / DBCache with one front
  block). Block 0 always runs; when its residual changed by less than `threshold` (mean |change| /
  mean |previous|) since the last fully computed step, the remaining blocks are skipped and their
  last residual is added instead. Knobs: `threshold` (0.05), `warmup_steps` (4: always compute
  the first steps), `max_skips` (3 consecutive skips at most).
- `magcache`: MagCache. The whole block stack is skipped while the accumulated error of the
  calibrated magnitude ratios (1 - product of the ratios since the last computed step, summed)
  stays under `threshold` (0.06), at most `max_skips` (3) in a row, never in the first
  `warmup_steps` (20% of the steps by default). It needs the ratios of this model, sampler, shift
  and step count, recorded by one run with `magcache_calibrate`.
- `magcache_calibrate`: computes every block (its output equals `off`) and writes the ratios
  ||r_t|| / ||r_{t-1}|| of the stack's residual per step and CFG branch to a small JSON file in
  the calibration folder (`default_calibration_dir()`, or the folder the host gives: inside
  ComfyUI, its user folder). The file name is a hash of what the ratios depend on, never a path
  from a workflow.

Every CFG branch (`cond`, `uncond`, or `pair` for batched CFG) has its own state; a `StepCache` is
made per Denoise/Refine call and attached only for its loop, so nothing carries over between
generations or handles. Caching is refused for the `dmd_student` sampler and for runs of
`MIN_STEPS` steps or fewer: few-step schedules have no near-duplicate steps to reuse.

Why our own and not diffusers' `FirstBlockCacheHook`/`MagCacheHook` or cache-dit: both replace the
blocks' forwards (diffusers through a block registry keyed on a `hidden_states` parameter and a
`CacheMixin` context; cache-dit by swapping the model's `blocks` list for a wrapper), so a skipped
block is still *called*: its torch pre-hooks run, and under disk offload those stream the block's
weights in for nothing. Here the cache is a named hook (`lingbot_core.hooks`) on the DiT that hands
the DiT a `block_runner`; the runner calls only the blocks it computes, so a skipped block costs no
transfer under any offload mode (group, sequential, disk), and the module tree is never changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import hooks

log = logging.getLogger(__name__)

STEP_CACHE = ("off", "first_block", "magcache", "magcache_calibrate")
MIN_STEPS = 8  # runs of this many steps or fewer are refused
CALIBRATION_FORMAT = "lingbot-magcache/1"
MAX_CALIBRATION_BYTES = 1 << 20
DEFAULTS = {
    "first_block": dict(threshold=0.05, warmup_steps=4, max_skips=3),
    "magcache": dict(threshold=0.06, warmup_steps=None, max_skips=3),  # warm-up: 20% of the steps
    "magcache_calibrate": dict(threshold=0.0, warmup_steps=0, max_skips=0),
}
MAGCACHE_WARMUP_FRACTION = 0.2

__all__ = ["CalibrationMissing", "Keyed", "MIN_STEPS", "STEP_CACHE", "StepCache", "StepCacheSettings",
           "calibration_file", "default_calibration_dir", "keyed", "read_calibration"]


class CalibrationMissing(ValueError):
    """`magcache` was asked for a model/sampler/step count that has no calibration file yet."""


@dataclass(frozen=True)
class StepCacheSettings:
    """What the user chose: the method and its knobs (None: the method's default)."""

    method: str = "off"
    threshold: float | None = None
    warmup_steps: int | None = None
    max_skips: int | None = None
    calibration_dir: str | None = None

    def __post_init__(self) -> None:
        if self.method not in STEP_CACHE:
            raise ValueError(f"step_cache must be one of {', '.join(STEP_CACHE)}, got {self.method!r}")
        t = self.threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
                              or t < 0):
            raise ValueError(f"cache threshold must be a finite number >= 0, got {t!r}")
        for name in ("warmup_steps", "max_skips"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"cache {name} must be an integer >= 0, got {v!r}")

    @classmethod
    def of(cls, value: str | StepCacheSettings | None) -> StepCacheSettings:
        if isinstance(value, StepCacheSettings):
            return value
        return cls("off" if value is None else value)

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @property
    def calibrated(self) -> bool:
        """A method keyed by a calibration (read or written): it needs the run's identity."""
        return self.method in ("magcache", "magcache_calibrate")

    def resolved(self, steps: int) -> tuple[float, int, int]:
        """(threshold, warm-up steps, max consecutive skips) for a run of `steps` steps."""
        base = DEFAULTS[self.method]
        threshold = base["threshold"] if self.threshold is None else float(self.threshold)
        warmup = self.warmup_steps if self.warmup_steps is not None else base["warmup_steps"]
        if warmup is None:
            warmup = max(1, int(round(MAGCACHE_WARMUP_FRACTION * steps)))
        skips = base["max_skips"] if self.max_skips is None else self.max_skips
        return threshold, int(warmup), int(skips)


def check_step_cache(settings: StepCacheSettings, *, steps: int, sampler_name: str) -> None:
    """Refuse caching where it cannot help (before any model work)."""
    if not settings.enabled:
        return
    if sampler_name == "dmd_student":
        raise ValueError("step caching does not work with the dmd_student sampler (a distilled few-step "
                         "model has no near-duplicate steps to reuse); set step_cache to off")
    if steps <= MIN_STEPS:
        raise ValueError(f"step caching needs more than {MIN_STEPS} steps (this run has {steps}): few-step "
                         "schedules have no near-duplicate steps to reuse; set step_cache to off")


def default_calibration_dir() -> Path:
    """Where MagCache calibrations live headless: $LINGBOT_CACHE_DIR, else the user cache folder."""
    root = os.environ.get("LINGBOT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "lingbot-nodes")
    return Path(root) / "magcache"


def calibration_key(identity: dict[str, Any]) -> str:
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def calibration_file(settings: StepCacheSettings, identity: dict[str, Any]) -> Path:
    """Where the calibration for `identity` lives: a hash-named file in the calibration folder."""
    folder = Path(settings.calibration_dir) if settings.calibration_dir else default_calibration_dir()
    return folder / f"{calibration_key(identity)}.json"


def read_calibration(path: Path, identity: dict[str, Any]) -> dict[str, list[float]]:
    """The ratios recorded for `identity`; `CalibrationMissing` (says how to calibrate) when there are none."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CalibrationMissing(
            "step_cache=magcache has no calibration for this model, sampler, shift, guidance and step count yet: "
            "run the same settings once with step_cache=magcache_calibrate (it computes every block and writes "
            f"the ratios to {path.parent.name}/{path.name}), then use magcache; or choose first_block, which "
            "needs no calibration") from None
    if size > MAX_CALIBRATION_BYTES:
        raise ValueError(f"MagCache calibration file {path.name} is {size} bytes; over the "
                         f"{MAX_CALIBRATION_BYTES}-byte limit, so it is not read (delete it and calibrate again)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        assert data["format"] == CALIBRATION_FORMAT and data["identity"] == json.loads(
            json.dumps(identity, sort_keys=True, default=str))
        ratios = {str(k): [float(r) for r in v] for k, v in data["ratios"].items()}
        assert ratios and all(all(math.isfinite(r) and r >= 0 for r in v) for v in ratios.values())
    except Exception:
        raise ValueError(f"MagCache calibration file {path.name} is unreadable or for other settings; "
                         "run step_cache=magcache_calibrate again") from None
    return ratios


@dataclass(frozen=True)
class Keyed:
    """A calibrated method's key for one run, found before any model work (`keyed`): the `identity` its
    file is named by, that file's `path`, and for `magcache` the ratios read from it (empty for
    `magcache_calibrate`, which writes them)."""

    identity: dict[str, Any]
    path: Path
    ratios: dict[str, list[float]] = field(default_factory=dict)


def keyed(settings: StepCacheSettings, identity: dict[str, Any]) -> Keyed:
    """`identity` with what `settings` needs of its calibration file: `magcache` reads it here, once per run
    (`CalibrationMissing` or a refusal of an unreadable file before the run starts)."""
    path = calibration_file(settings, identity)
    return Keyed(identity, path, read_calibration(path, identity) if settings.method == "magcache" else {})


def _write_calibration(path: Path, identity: dict[str, Any], ratios: dict[str, list[float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": CALIBRATION_FORMAT, "identity": identity, "ratios": ratios}
    fd, tmp = tempfile.mkstemp(prefix=".magcache-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, sort_keys=True, default=str)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


Reduce = Callable[[torch.Tensor], torch.Tensor]


def _rel_l1(now: torch.Tensor, before: torch.Tensor, reduce: Reduce | None = None) -> float:
    """mean |now - before| / mean |before| (both over the same values, so the counts cancel). `reduce`
    sums the two partial sums over the processes that hold parts of one sequence (sequence parallel):
    every rank then sees the whole sequence's figure and decides alike."""
    sums = torch.stack(((now - before).abs().float().sum(), before.abs().float().sum()))
    if reduce is not None:
        sums = reduce(sums)
    return float(sums[0] / sums[1].clamp_min(1e-12))


@dataclass
class _Branch:
    """One CFG branch's cache state."""

    step: int = 0  # forwards seen = the step index of the next one
    head: torch.Tensor | None = None  # first_block: block 0's residual at the last computed step
    tail: torch.Tensor | None = None  # residual to reuse (blocks 1.. for first_block; all for magcache)
    skips: int = 0  # consecutive skipped steps
    acc_ratio: float = 1.0
    acc_error: float = 0.0
    last_norm: float | None = None
    ratios: list[float] = field(default_factory=list)  # calibration


class StepCache:
    """The cache of one Denoise/Refine call: per-branch state, the block runner, and its hook."""

    def __init__(self, settings: StepCacheSettings, *, steps: int, key: Keyed | None = None):
        self.settings = settings
        self.method = settings.method
        self.steps = steps
        self.threshold, self.warmup, self.max_skips = settings.resolved(steps)
        self.identity = key.identity if key is not None else {}
        self.branches: dict[str, _Branch] = {}
        self.current = "cond"
        self.computed = 0  # blocks run
        self.skipped = 0  # blocks skipped
        self.calibration_path = key.path if key is not None else None  # where magcache_calibrate writes
        self.ratios: dict[str, list[float]] = dict(key.ratios) if key is not None else {}
        # sums partial sums over a sequence-parallel group (`distributed.stage.share_step_cache`); None: one process
        self.reduce: Reduce | None = None
        if settings.calibrated and key is None:
            raise ValueError(f"step_cache={self.method} needs its calibration key (`keyed`, found by the request check)")
        if self.method == "magcache" and not self.ratios:
            raise ValueError("step_cache=magcache needs its calibration's ratios (`keyed`, read by the request check)")

    # -- per forward ----------------------------------------------------------------------------

    @contextmanager
    def branch(self, name: str) -> Iterator[None]:
        """Route the next DiT forwards to branch `name`'s state."""
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    def _ratios_for(self, name: str) -> list[float]:
        for key in (name, "cond", *self.ratios):
            if key in self.ratios:
                return self.ratios[key]
        return []

    def run(self, blocks: torch.nn.ModuleList, x: torch.Tensor, *extra: Any, real_tokens: int | None = None) -> torch.Tensor:
        """The DiT's block stack for the current branch and step, skipping what the method allows.
        `real_tokens`: how many leading tokens of `x` are the sequence's (a sequence-parallel share may
        end in padding, which the figures the cache decides on must not count); None: all of them."""
        real = slice(None, real_tokens)  # the tokens the figures count
        state = self.branches.setdefault(self.current, _Branch())
        index = state.step
        state.step += 1
        if self.method == "first_block":
            return self._first_block(state, index, blocks, x, extra, real)
        if self.method == "magcache":
            return self._magcache(state, index, blocks, x, extra)
        out = self._compute(blocks, x, extra)
        if self.method == "magcache_calibrate":
            squares = (out - x)[:, real].float().square().sum()
            norm = float((self.reduce(squares) if self.reduce is not None else squares).sqrt())
            state.ratios.append(1.0 if not state.last_norm else norm / state.last_norm)
            state.last_norm = norm
        return out

    def _compute(self, blocks, x, extra, start: int = 0) -> torch.Tensor:
        for block in list(blocks)[start:]:
            x = block(x, *extra)
        self.computed += len(blocks) - start
        return x

    def _first_block(self, state: _Branch, index: int, blocks, x, extra, real: slice) -> torch.Tensor:
        h = self._compute(blocks[:1], x, extra)
        head = h - x
        if (index >= self.warmup and state.tail is not None and state.head is not None
                and state.skips < self.max_skips and state.tail.shape == h.shape
                and _rel_l1(head[:, real], state.head[:, real], self.reduce) < self.threshold):
            state.skips += 1
            self.skipped += len(blocks) - 1
            return h + state.tail
        out = self._compute(blocks, h, extra, start=1)
        state.tail, state.head, state.skips = out - h, head, 0
        return out

    def _magcache(self, state: _Branch, index: int, blocks, x, extra) -> torch.Tensor:
        ratios = self._ratios_for(self.current)
        if index >= self.warmup and state.tail is not None and index < len(ratios) and state.tail.shape == x.shape:
            state.acc_ratio *= ratios[index]
            state.acc_error += abs(1.0 - state.acc_ratio)
            if state.acc_error < self.threshold and state.skips < self.max_skips:
                state.skips += 1
                self.skipped += len(blocks)
                return x + state.tail
        state.acc_ratio, state.acc_error, state.skips = 1.0, 0.0, 0
        out = self._compute(blocks, x, extra)
        state.tail = out - x
        return out

    # -- attaching ------------------------------------------------------------------------------

    @contextmanager
    def attached(self, dit: torch.nn.Module) -> Iterator[StepCache]:
        """Hook the cache onto `dit` for one sampling loop; removed on exit, whatever happens."""
        hooks.attach(dit, _RunnerHook(self))
        try:
            yield self
        finally:
            hooks.detach(dit, _RunnerHook.name)

    def finish(self) -> None:
        """After a complete run: write the calibration (magcache_calibrate), log what was skipped."""
        if self.method == "magcache_calibrate":
            ratios = {name: state.ratios for name, state in self.branches.items()}
            _write_calibration(self.calibration_path, self.identity, ratios)
            log.info("MagCache calibration written: %s (%s)", self.calibration_path.name,
                     ", ".join(f"{k}: {len(v)} steps" for k, v in ratios.items()))
        elif self.method != "off":
            total = self.computed + self.skipped
            log.info("step cache %s: %d of %d DiT blocks skipped", self.method, self.skipped, total)


@hooks.named("lingbot.step_cache", "hands the DiT the step cache's block runner for one sampling loop")
class _RunnerHook(hooks.Hook):
    """Hands the DiT the cache's block runner on every forward."""

    def __init__(self, cache: StepCache):
        super().__init__()
        self.cache = cache

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if kwargs.get("block_runner") is not None:  # a sequence-parallel runner wraps the cache, never the reverse
            raise RuntimeError("the step cache must be attached after sequence parallel (its runner is handed "
                               "to the sharding runner, which runs it on this rank's share of the sequence)")
        kwargs["block_runner"] = self.cache.run
        return args, kwargs
