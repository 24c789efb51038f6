"""Optional fast kernels, each used only after it has worked here: one trial rule for all of them.

A fast kernel (a grouped matmul, an fp8 matmul, an attention backend, a compiled decoder or block)
is one of several ways to compute the same thing; its plain path (`Kernel.plain`) computes it on
every device. Whether the fast one runs on *this* GPU, with *this* torch, in *this* dtype is not
read from a table of compute capabilities: tables go stale with every torch release and every new
card. It is tried instead, on its first real call per (kernel, device type, compute capability,
dtype, torch version), the `Trial` key:

- the kernel runs; where its caller can check it cheaply (`check`), its result is compared with the
  plain path's (a few rows of it, or all of it bit for bit for the decoders);
- any exception it raises (a refusal: "only supported on compute capability 9.0", a missing
  package, a compiler failure) or a mismatch makes this process use the plain path for that key
  from then on, with one warning naming the kernel and the reason, and that call returns the plain
  path's output; an out-of-memory error or an interrupt is not a refusal and is raised as it is;
- after a good first call the kernel runs without any check (`verdicts()` lists what was decided).

`probe(kernel, device, dtype)` runs a small trial now (the kernel's home module registers it with
`@trial_for`): the handle refuses an explicit choice that cannot run when it opens, never mid-run,
and the doctor lists each kernel's verdict. While `torch.compile` traces, nothing is tried (a trial
cannot run inside a graph): a kernel runs there unless a trial of the same name (on any device or
dtype) already refused it in this process.

`KERNELS` is the registry: every kernel the pack may try, what it is and which plain path replaces
it. A kernel with variants (a decoder per packed format, an attention backend with and without a
mask) is tried as `family/variant`, one verdict per variant.
"""

from __future__ import annotations

import importlib
import logging
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .workflow.errors import is_interrupt

log = logging.getLogger("lingbot_core.kernels")
T = TypeVar("T")

FAST, REFUSED, MISMATCH = "fast", "refused", "mismatch"
VERDICTS = (FAST, REFUSED, MISMATCH)
"""`fast`: the kernel ran and (where checked) agreed; `refused`: it raised; `mismatch`: it differed."""


@dataclass(frozen=True)
class Kernel:
    """One optional fast kernel: `what` it is, the `plain` path that replaces it, what the warning says
    the process does instead (`fallback`), how its first call is checked, and the module that
    registers its `probe` trial (`home`, imported on demand)."""

    name: str
    what: str
    plain: str
    fallback: str
    checked: str
    home: str


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("grouped_mm", "torch._grouped_mm: all MoE experts in three grouped matmuls (bf16/fp16 models)",
           "the expert-by-expert loop", "running the MoE experts one by one",
           "its first rows against the loop's (relative error)", "lingbot_core.models.moe"),
    Kernel("scaled_mm", "torch._scaled_mm: fp8 linears on fp8 tensor cores, activations quantized per row",
           "the fp8 weight decoded to the compute dtype, then a plain matmul", "decoding fp8 weights for their matmuls",
           "its first rows against the decoded matmul's (relative error)", "lingbot_core.weights.fp8"),
    Kernel("attention", "an attention backend of diffusers' dispatcher other than PyTorch SDPA, per backend, "
           "with and without a key mask", "PyTorch SDPA (diffusers' `native` backend)", "using SDPA",
           "its first query rows against SDPA's (relative error)", "lingbot_core.models.transformer"),
    Kernel("sparse_attention", "block-sparse self-attention (attention: sparse): comfy-kitchen's sol_attn CUDA kernel "
           "where installed, else the eager block loop", "dense PyTorch SDPA", "using dense SDPA",
           "its first query block: finite, inside the values' range, near dense SDPA's (a loose bound)",
           "lingbot_core.models.sparse_attention"),
    Kernel("compiled_decoder", "one torch.compile'd kernel per packed weight format (fp8, GGUF types)",
           "the eager decoder", "decoding eagerly", "every value, bit for bit, against the eager decoder",
           "lingbot_core.weights.fp8"),
    Kernel("compiled_blocks", "regional torch.compile of the DiT blocks (compile=blocks)",
           "the eager block", "running the blocks eagerly", "its first block's output against the eager block's "
           "(relative error)", "lingbot_core.models.compile"),
)}


@dataclass(frozen=True)
class Trial:
    """What a verdict holds for: a kernel (or `family/variant`) on one kind of device, dtype and torch."""

    kernel: str
    device: str
    capability: str
    dtype: str
    torch: str


_verdicts: dict[Trial, tuple[str, str]] = {}  # trial -> (verdict, reason)
_demoted: dict[str, bool] = {}  # kernel (or family/variant) -> some trial refused it (read while compiling)
_probes: dict[str, Callable[[torch.device, torch.dtype, str], str | None]] = {}
_lock = threading.RLock()
_probing = threading.local()  # set while `probe` runs: its refusals are returned, not warned about


def family(name: str) -> Kernel:
    """The registry entry of `name` (`grouped_mm`, `attention/flash`, ...); KeyError for an unknown one."""
    head = name.split("/", 1)[0]
    if head not in KERNELS:
        raise KeyError(f"unknown fast kernel {name!r}; the registry has {', '.join(KERNELS)}")
    return KERNELS[head]


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "-" if dtype is None else str(dtype).replace("torch.", "")


def capability(device: torch.device | str) -> str:
    """"9.0" for a CUDA device (its compute capability), "-" for any other device type."""
    device = torch.device(device)
    if device.type != "cuda":
        return "-"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def trial_key(name: str, device: torch.device | str, dtype: torch.dtype | None) -> Trial:
    family(name)
    device = torch.device(device)
    return Trial(name, device.type, capability(device), _dtype_name(dtype), str(torch.__version__))


def verdict(name: str, device: torch.device | str, dtype: torch.dtype | None) -> str | None:
    """What the process decided for `name` here (one of `VERDICTS`), or None before its first call."""
    found = _verdicts.get(trial_key(name, device, dtype))
    return found[0] if found else None


def usable(name: str, device: torch.device | str, dtype: torch.dtype | None) -> bool:
    """False once a trial refused `name` here or found it differing; True before its trial and after a good one."""
    if torch.compiler.is_compiling():
        return not _demoted.get(name, False)
    return verdict(name, device, dtype) in (None, FAST)


def _first_line(exc: BaseException) -> str:
    """"Type: first line" of `exc`; a first line that only announces the next ("backend='inductor'
    raised:", as the compiler wraps an error) takes the next line with it."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if first.endswith(":") and len(lines) > 1:
        first = f"{first} {lines[1]}"
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__


def _passes_through(exc: BaseException) -> bool:
    """Errors that say nothing about the kernel: memory ran out, or the user stopped the run."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or is_interrupt(exc)


def _record(key: Trial, outcome: str, reason: str, label: str | None) -> None:
    _verdicts[key] = (outcome, reason)
    if outcome == FAST:
        return
    _demoted[key.kernel] = True
    entry = family(key.kernel)
    place = key.device if key.capability == "-" else f"{key.device} {key.capability}"
    label = label or f"{key.kernel} ({entry.what})"
    verb = "failed" if outcome == REFUSED else "differs from " + entry.plain
    say = log.info if getattr(_probing, "active", False) else log.warning
    say("lingbot: %s %s on %s, %s, torch %s (%s); %s instead for the rest of this process", label, verb, place,
        key.dtype, key.torch, reason, entry.fallback)


def run(name: str, fast: Callable[[], T], plain: Callable[[], T], *, device: torch.device | str,
        dtype: torch.dtype | None, check: Callable[[T], str | None] | None = None, label: str | None = None) -> T:
    """`fast()` where the kernel `name` is trusted here, else `plain()`; its first call here is its trial.

    `check(result)` (optional) returns why the fast result is wrong (it differs from the plain path's,
    which `check` computes cheaply), or None. `label` names the kernel in the warning (default: its
    registry entry). See the module docstring for the rule."""
    if torch.compiler.is_compiling():
        return plain() if _demoted.get(name, False) else fast()
    key = trial_key(name, device, dtype)
    found = _verdicts.get(key)
    if found is not None:
        return fast() if found[0] == FAST else plain()
    with _lock:
        found = _verdicts.get(key)
        if found is not None:  # another thread tried it meanwhile
            return fast() if found[0] == FAST else plain()
        try:
            result = fast()
        except Exception as exc:
            if _passes_through(exc):
                raise
            _record(key, REFUSED, _first_line(exc), label)
            return plain()
        problem = check(result) if check is not None else None
        if problem:
            del result
            _record(key, MISMATCH, problem, label)
            return plain()
        _record(key, FAST, "", label)
        return result


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 over the finite values; inf where the NaN or inf positions
    differ (a kernel that writes NaN where the plain path does not is wrong, whatever the norm)."""
    got, want = got.detach(), want.detach()
    if got.shape != want.shape:
        return float("inf")
    bad_got, bad_want = ~torch.isfinite(got), ~torch.isfinite(want)
    if not torch.equal(bad_got, bad_want):
        return float("inf")
    ok = ~bad_want
    diff = (got[ok].double() - want[ok].double()).norm().item()
    scale = want[ok].double().norm().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def differs(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> str | None:
    """Why `got` is not `want` within `tolerance` (relative error, see `relative_error`), or None."""
    error = relative_error(got, want)
    if error <= tolerance:
        return None
    return f"relative error {error:.3g} against the plain path, more than {tolerance:g}"


# -- probes, the report ---------------------------------------------------------------------------

def trial_for(name: str) -> Callable[[Callable[[torch.device, torch.dtype, str], str | None]],
                                     Callable[[torch.device, torch.dtype, str], str | None]]:
    """Register the small trial `probe` runs for the kernel family `name`: `fn(device, dtype, variant)`
    runs the kernel on small inputs through `run` (so a refusal or mismatch is judged by the rule) and
    returns why it cannot run at all before trying (a missing package, a device it has no code for),
    or None."""
    family(name)

    def register(fn: Callable[[torch.device, torch.dtype, str], str | None]):
        _probes[name] = fn
        return fn

    return register


def _row(key: Trial, outcome: str, reason: str) -> dict[str, str]:
    return {"kernel": key.kernel, "device": key.device, "capability": key.capability, "dtype": key.dtype,
            "torch": key.torch, "verdict": outcome, "reason": reason}


def probe(kernel: str, device: torch.device | str, dtype: torch.dtype) -> dict[str, str]:
    """Try `kernel` (a `KERNELS` name, or `family/variant`: `attention/flash`, `compiled_decoder/Q8_0`)
    now on small inputs on `device` in `dtype` and return its verdict as a `verdicts()` row.

    A refusal or mismatch is kept for the process (it holds for every later call with that key); a
    good probe is not: the first real call is still tried. A verdict the process already holds is
    returned as it is."""
    device = torch.device(device)
    key = trial_key(kernel, device, dtype)
    found = _verdicts.get(key)
    if found is not None:
        return _row(key, *found)
    head, _, variant = kernel.partition("/")
    if head not in _probes:
        importlib.import_module(KERNELS[head].home)  # the home module registers its trial as it loads
    runner = _probes.get(head)
    if runner is None:
        return _row(key, REFUSED, f"no trial is registered for {kernel}")
    with _lock:
        before = set(_verdicts)
        _probing.active = True
        said: list[warnings.WarningMessage] = []
        try:
            # a library's warnings about a kernel it runs on a probe's small inputs (torch: flex attention
            # "called without torch.compile()") are about the probe, not the user's run: logged, not shown
            with warnings.catch_warnings(record=True) as said:
                problem = runner(device, dtype, variant)
        except Exception as exc:
            if _passes_through(exc):
                raise
            problem = _first_line(exc)
        finally:
            _probing.active = False
            for w in said:
                log.info("lingbot: probing %s on %s: %s", kernel, device, _first_line(w.message))
        if problem and key not in _verdicts:
            _probing.active = True
            try:
                _record(key, REFUSED, problem, None)
            finally:
                _probing.active = False
        added = set(_verdicts) - before
        # a trial under another name (a family probed through its default variant) speaks for this one
        inner = [_verdicts[k] for k in sorted(added, key=str) if _verdicts[k][0] != FAST]
        outcome = _verdicts.get(key) or (inner[0] if inner else (FAST, ""))
        for tried in added:  # a good probe decides nothing: the first real call is the trial
            if _verdicts[tried][0] == FAST:
                del _verdicts[tried]
        return _row(key, *outcome)


def verdicts() -> list[dict[str, str]]:
    """Every verdict this process holds, one dict per trial (keys: kernel, device, capability, dtype,
    torch, verdict in `VERDICTS`, reason), sorted by kernel."""
    rows = [_row(key, *value) for key, value in _verdicts.items()]
    return sorted(rows, key=lambda r: (r["kernel"], r["device"], r["capability"], r["dtype"]))


def reset() -> None:
    """Forget every verdict (tests; a process otherwise keeps them for its life)."""
    with _lock:
        _verdicts.clear()
        _demoted.clear()


def summary_lines() -> list[str]:
    """One line per verdict, for the Memory Report and logs: "grouped_mm on cuda 8.6, bfloat16: refused (...)"."""
    lines = []
    for row in verdicts():
        place = row["device"] if row["capability"] == "-" else f"{row['device']} {row['capability']}"
        reason = f" ({row['reason']})" if row["reason"] else ""
        lines.append(f"{row['kernel']} on {place}, {row['dtype']}: {row['verdict']}{reason}")
    return lines


def describe() -> list[dict[str, Any]]:
    """The registry as rows (name, what, plain, checked): what the doctor and the docs list."""
    return [{"name": k.name, "what": k.what, "plain": k.plain, "checked": k.checked} for k in KERNELS.values()]
