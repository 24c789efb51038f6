"""Issue 36 item 5: every speed bench prints the CPU's bf16 matmul rate beside its ratios, since a ratio
measured on a CPU with AMX differs from one on a CPU without bf16 instructions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import _common

BENCH = Path(__file__).resolve().parents[1] / "bench"
CLOCKS = re.compile(r"perf_counter|process_time|time\.time\(\)|time\.monotonic")


@pytest.mark.parametrize("flags, kind", [
    ("fpu sse avx512f avx512_bf16 amx_bf16 amx_tile amx_int8", "AMX"),
    ("fpu sse avx512f avx512_bf16 avx512_vnni", "AVX512-bf16"),
    ("fpu sse avx2 fma", "no bf16 instructions"),
])
def test_the_cpu_kind_comes_from_its_flags(flags, kind):
    text = f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
    assert _common.cpu_bf16_kind(text) == kind


def test_the_machine_line_names_the_cpu_its_kind_and_rate(capsys):
    rate = _common.print_machine()
    printed = capsys.readouterr().out
    assert rate["bf16_matmul_tflops"] > 0 and rate["cpu_bf16"] == _common.cpu_bf16_kind()
    assert printed.startswith("machine: ") and rate["cpu_bf16"] in printed and "TFLOP/s" in printed
    assert _common.environment()["bf16_matmul"] == rate  # measured once per process, in every JSON


def test_every_bench_that_reads_a_clock_prints_the_machine_line():
    missing = []
    for path in sorted(BENCH.glob("*.py")):
        name = path.stem
        if name.startswith("_") or name in _common.NOT_SPEED_BENCHES:
            continue
        text = path.read_text(encoding="utf-8")
        if CLOCKS.search(text) and "print_machine(" not in text and "run_main(" not in text:
            missing.append(name)
    assert missing == []
    assert [n for n in _common.NOT_SPEED_BENCHES if not (BENCH / f"{n}.py").is_file()] == []
