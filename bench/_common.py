"""Helpers shared by the benchmark scripts: CPU peak memory, tables, JSON, the fuzzers' frame.

House rule: performance claims come from a script in `bench/`, run side by side with its baseline in
one process and reported as ratios. These helpers keep every script doing that the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def cpu_peak_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Peak of CPU bytes allocated by torch *during* `fn()` (net of what existed before), and its result.

    torch has no CPU counterpart of `torch.cuda.max_memory_allocated`, and process RSS mixes in
    imports, weights and the allocator's caching. The profiler with `profile_memory=True` records
    every CPU allocation and free as a `[memory]` event with a signed size; their running sum in
    time order is the bytes torch holds, and its maximum is the peak. Tensors that existed before
    the call (weights, inputs) are not counted, so the number is what the call itself adds.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        result = fn()
    cpu = torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    events.sort(key=lambda e: e.start_ns())
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak, result


def fmt_bytes(n: float | None) -> str:
    """Decimal units (GB = 1e9 bytes), as the published offload numbers use."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt(value: Any, digits: int = 3) -> str:
    """One table cell: floats with a fixed number of significant digits, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value == 0:
            return "0"
        if abs(value) < 1e-3 or abs(value) >= 1e5:
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.{max(digits - 1, 1)}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A compact fixed-width text table (cells already formatted or formatted by `fmt`)."""
    cells = [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def write_json(path: str | Path | None, data: dict[str, Any]) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")


def run_main(parse_args: Callable[[list[str] | None], Any], run: Callable[[Any], dict[str, Any]],
             report: Callable[[dict[str, Any]], str], argv: list[str] | None = None) -> dict[str, Any]:
    """A bench's `main`: parse the arguments, run, print the report, write `--json`; the result."""
    args = parse_args(argv)
    result = run(args)
    print(report(result))
    print_machine()  # after the run, which set the threads
    write_json(args.json, result)
    return result


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference (inf on a shape mismatch, nan if either side has NaNs)."""
    if a.shape != b.shape:
        return math.inf
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def cpu_bf16_kind(cpuinfo: str | None = None) -> str:
    """How this CPU multiplies bf16 matrices, from its /proc/cpuinfo flags (`cpuinfo`: that text, for
    tests): "AMX" (Intel AMX tiles, the fastest), "AVX512-bf16", or "no bf16 instructions" (bf16
    converted to float32 first). A ratio measured on one kind can differ on another: faster matmuls
    make everything that is not a matmul (decoding weights, Python, memory traffic) a larger share."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                cpuinfo = fh.read()
        except OSError:
            return "unknown (no /proc/cpuinfo)"
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[-1].split())
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512-bf16"
    return "no bf16 instructions"


def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_MACHINE: dict[str, Any] = {}

NOT_SPEED_BENCHES: dict[str, str] = {
    "comfy_e2e": "drives ComfyUI end to end: pass or fail, no speed ratios",
    "comfy_editor": "drives the graph editor in a browser: pass or fail, no speed ratios",
    "fuzz_configs": "a fuzzer: its clock is the hang limit",
    "fuzz_gguf": "a fuzzer: its clock is the hang limit",
    "fuzz_jobs": "a fuzzer: its clock is the hang limit",
    "fuzz_rewriter": "a fuzzer: its clock is the hang limit",
    "fuzz_single_files": "a fuzzer: its clock is the hang limit",
    "gguf_header": "hostile headers: whether a parse ends in bounded time and memory, not compute speed",
    "multinode": "how jobs end when a node fails: timeouts, not compute speed",
    "parallel_failure": "how a rank's failure is noticed: timeouts, not compute speed",
    "quant_error": "output error of each format; no speed ratios",
}
"""Benches that read a clock but report no speed ratio, so they need not print `machine_line`
(tests/test_bench_machine.py: every other bench that reads a clock prints it)."""


def bf16_matmul_rate(size: int = 2048, repeats: int = 2) -> dict[str, Any]:
    """This machine's CPU bf16 matmul speed with the threads torch uses now: TFLOP/s of a `size`^3
    bf16 matmul (best of `repeats` after one warm-up), the CPU's name and its bf16 kind
    (`cpu_bf16_kind`). Measured once per process (the benches call it before their own rows)."""
    import time

    key = f"{size}x{repeats}x{torch.get_num_threads()}"
    if key not in _MACHINE:
        a = torch.randn(size, size).to(torch.bfloat16)
        b = torch.randn(size, size).to(torch.bfloat16)
        torch.mm(a, b)
        best = math.inf
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        _MACHINE[key] = {"cpu": _cpu_name(), "cpu_bf16": cpu_bf16_kind(), "threads": torch.get_num_threads(),
                         "bf16_matmul_tflops": round(2 * size**3 / best / 1e12, 4)}
    return dict(_MACHINE[key])


def machine_line(rate: dict[str, Any] | None = None) -> str:
    """One line saying which CPU a bench's ratios come from: its name, bf16 kind and bf16 matmul rate."""
    rate = rate or bf16_matmul_rate()
    return (f"machine: {rate['cpu']} ({rate['cpu_bf16']}), bf16 matmul {rate['bf16_matmul_tflops']:.3g} TFLOP/s "
            f"on {rate['threads']} thread(s); ratios measured here can differ on a CPU of another kind")


def print_machine() -> dict[str, Any]:
    """Print `machine_line` (flushed, before a bench's rows) and return the rate for its JSON. Every speed
    bench calls it (tests/test_bench_machine.py checks)."""
    rate = bf16_matmul_rate()
    print(machine_line(rate), flush=True)
    return rate


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between `a` and `b` in bf16 representable values (0: bit-identical in bf16;
    1: one rounding step, "1 ulp"), both rounded to bf16 first."""
    def ordered(x: torch.Tensor) -> torch.Tensor:  # bf16 bit patterns as integers in value order
        bits = x.to(torch.bfloat16).contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def environment() -> dict[str, Any]:
    """What the numbers were measured with (goes into every JSON), the CPU's bf16 matmul rate included."""
    import platform

    info: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                            "python": platform.python_version(), "machine": platform.machine(),
                            "bf16_matmul": bf16_matmul_rate()}
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def random_dit(config: dict[str, Any], weight_scale: float = 0.02) -> Any:
    """A LingBot-Video DiT of `config` with seeded random weights (torch's global seed set to 0 first): matrices
    N(0, weight_scale), vectors N(0, 0.1), norm weights around 1. The benches and the tests' random DiTs."""
    from lingbot_core.models.transformer import LingBotVideoTransformer3DModel

    torch.manual_seed(0)
    model = LingBotVideoTransformer3DModel(**config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (weight_scale if p.ndim > 1 else 0.1) + (1.0 if "norm" in name else 0.0))
    return model


def vm_bytes() -> int:
    """This process's virtual address space in bytes (Linux `VmSize`; 0 where /proc is absent)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _limited_child(conn, fn: Callable[..., Any], args: tuple, memory: int) -> None:
    if memory:
        import resource

        limit = vm_bytes() + memory
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as err:  # whatever the call raised goes back as text: the caller judges it
        conn.send(("raised", (type(err).__name__, str(err)[:4000])))


def run_limited(fn: Callable[..., Any], *args: Any, seconds: float, memory: int) -> tuple[str, Any]:
    """Run `fn(*args)` in a forked child allowed `memory` bytes of address space beyond its start and
    `seconds` of wall time. Returns ("ok", return value), ("raised", (exception type, message)),
    ("hang", None) when it gave no answer in time (it is killed), or ("died", exit code) when the child
    ended without answering (a signal, the kernel's OOM killer, a hard crash in native code).

    One runner for the fuzzers in `bench/` and the tests that replay their findings.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_limited_child, args=(child, fn, args, memory))
    proc.start()
    child.close()
    try:
        if not parent.poll(seconds):
            proc.kill()
            return "hang", None
        try:
            return parent.recv()
        except EOFError:
            proc.join()
            return "died", proc.exitcode
    finally:
        proc.join()


# -- the fuzzers' shared frame (bench/fuzz_*.py): their command line, the tally, the summary ---------------

ESCAPED = ("crash", "hang", "silent")  # what a fuzzer counts against the code: the rest is read or refused


def fuzz_parser(doc: str, cases: int, keep: bool = False) -> argparse.ArgumentParser:
    """A fuzzer's command line: `--cases` (default `cases`), `--seed`, `--json OUT` and, with `keep`,
    `--keep DIR`; the caller adds its own options and parses."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=cases)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the summary here")
    if keep:
        parser.add_argument("--keep", type=Path, metavar="DIR", help="save every file that escaped here")
    return parser


def fuzz_tally(cases: int, one: Callable[[int], tuple[str, str, dict[str, Any]]], outcomes: Sequence[str],
               hang_s: float | None = None) -> dict[str, Any]:
    """Run `one(index)` -> (outcome, detail, what to show of the case) for every case: the count per
    outcome (`outcomes` and `ESCAPED`), the first ten escapes with their details, the slowest and total
    seconds. A case slower than `hang_s` counts as a hang whatever it returned."""
    counts = dict.fromkeys((*outcomes, *ESCAPED), 0)
    bad: list[dict[str, Any]] = []
    slowest, start = 0.0, time.perf_counter()
    for index in range(cases):
        began = time.perf_counter()
        outcome, detail, shown = one(index)
        took = time.perf_counter() - began
        slowest = max(slowest, took)
        if hang_s is not None and took > hang_s and outcome != "hang":
            outcome, detail = "hang", f"{took:.1f} s"
        counts[outcome] += 1
        if outcome in ESCAPED and len(bad) < 10:
            bad.append({"case": index, "outcome": outcome, "detail": detail, **shown})
    return {**counts, "slowest_s": round(slowest, 2), "total_s": round(time.perf_counter() - start, 1), "bad": bad}


def keep_case(folder: Path | None, name: str, raw: bytes) -> None:
    """Save a fuzz case that escaped under `folder` (`--keep`), when one was given."""
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(raw)


def fuzz_report(summary: dict[str, Any], out: Path | None) -> dict[str, Any]:
    """Print a fuzzer's summary and write it to `out` (`--json`) when given; the summary."""
    text = json.dumps(summary, indent=1)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    return summary
