"""glibc's allocator set up for a CPU run's large tensors (issue 36 item 4): the thresholds a CPU run
sets, what it leaves alone, and that the command-line entry points call it before a model loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lingbot_core import allocator

ROOT = Path(__file__).resolve().parents[1]


class FakeLibc:
    def __init__(self, answer: int = 1):
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(allocator, "_done", [])
    for name in allocator.ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)


def test_a_cpu_run_raises_both_thresholds():
    libc = FakeLibc()
    assert allocator.tune_for_cpu("cpu", libc=libc) == "set"
    assert libc.calls == [(allocator.M_MMAP_THRESHOLD, allocator.LARGE_THRESHOLD),
                          (allocator.M_TRIM_THRESHOLD, allocator.LARGE_THRESHOLD)]
    assert allocator.tune_for_cpu("cpu", libc=libc) == "set" and len(libc.calls) == 2  # once per process


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "mps", None])
def test_other_devices_are_left_alone(device):
    libc = FakeLibc()
    assert allocator.tune_for_cpu(device, libc=libc) == "not a CPU run" and libc.calls == []


def test_a_threshold_from_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    libc = FakeLibc()
    assert allocator.tune_for_cpu("cpu", libc=libc) == "left as the environment sets it" and libc.calls == []


def test_a_refusal_is_said():
    assert allocator.tune_for_cpu("cpu", libc=FakeLibc(answer=0)) == "mallopt refused"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_real_glibc_takes_it():
    code = "from lingbot_core.allocator import tune_for_cpu; print(tune_for_cpu('cpu'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() in ("set", "not glibc")  # musl has no mallopt to set


def test_the_entry_points_tune_before_a_model_loads():
    """Both command-line entry points call `tune_for_cpu` before the first model opens."""
    main = (ROOT / "lingbot_core" / "__main__.py").read_text(encoding="utf-8")
    assert main.index("PipelineHandle.open(") < main.index("tune_for_cpu(") < main.index("configure_offload(handle")
    cli = (ROOT / "nodes" / "cli.py").read_text(encoding="utf-8")
    body = cli[cli.index("def main("):]
    assert "_tune_allocator()" in body and body.index("_tune_allocator()") < body.index("Manifest(")
