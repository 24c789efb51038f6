"""Shared test helpers: where the reference fixtures live, and a throwaway tiny-model folder.

The fixtures ship with the repository under `tests/fixtures/`, one folder per fixture set:
`lingbot/` (tiny models + pipeline/transformer cases) and, as features land, sets such as
`lingbot-dmd/` or `lingbot-lora/` whose cases reuse `lingbot/models`. `LINGBOT_FIXTURES` points
the `lingbot` set elsewhere (its sibling folders then supply the other sets);
`LINGBOT_PARITY_DIRS` adds more case folders (see `parity_cases.discover`).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES_HOME = REPO_ROOT / "tests" / "fixtures"
FIXTURES = Path(os.environ.get("LINGBOT_FIXTURES") or FIXTURES_HOME / "lingbot").resolve()


def fixture_set(name: str) -> Path:
    """The folder of fixture set `name` ("lingbot", "lingbot-dmd", ...): a sibling of FIXTURES."""
    return FIXTURES if name == "lingbot" else FIXTURES.parent / name


# One thread per test process, and for the processes tests start: the tiny models' ops are far below
# the size where a second thread pays, and on a busy or small machine OpenMP's waiting threads made the
# same tests several times slower (a tiny MoE refine: 0.44 s with one thread, 1.7 s with two, load 10).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A GPU run of the suite neither reads nor writes the user's memory calibration file (a stage on CUDA
# files its measured peak there, and a filed ratio scales later estimates); its tests set their own.
os.environ.setdefault("LINGBOT_CALIBRATION", "off")

# Tests build the tiny checkpoints in a throwaway folder, never in the user's cache; the folder
# is removed when the session ends (only if this run created it).
_TINY_DIR: str | None = None
if "LINGBOT_TINY_DIR" not in os.environ:
    _TINY_DIR = tempfile.mkdtemp(prefix="lingbot-tiny-")
    os.environ["LINGBOT_TINY_DIR"] = _TINY_DIR


def _freeze_survivors() -> None:
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection left alive (torch, diffusers, transformers, the test modules) out of the
    garbage collector's sight. Those objects live for the whole run, and every full collection (one per
    `gc.collect()` in a release, besides Python's own) walked all of them again: a fifth to a third of a
    test file's time went there. Objects made later, by fixtures and tests, are collected as before;
    reference counting still frees frozen objects nobody holds."""
    _freeze_survivors()


_last_module: list[object] = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Likewise when a test file starts (before its fixtures are made, so they stay collectable), for what
    earlier files left alive: modules imported on first use, caches. A cycle among those that becomes
    garbage later is not reclaimed before the run ends (memory only: nothing a test checks)."""
    module = getattr(item, "module", None)
    if module is not _last_module[0]:
        _last_module[0] = module
        _freeze_survivors()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _TINY_DIR is not None:
        shutil.rmtree(_TINY_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def fresh_kernel_verdicts():
    """Each test starts with no fast kernel judged (`lingbot_core.kernels`): a test that makes one refuse
    must not send the next test down the plain path."""
    from lingbot_core import kernels

    kernels.reset()
    yield
    kernels.reset()


@pytest.fixture(scope="session")
def fixtures_root() -> Path:
    if not (FIXTURES / "manifest.json").is_file():
        pytest.fail(f"parity fixtures not found at {FIXTURES} (no manifest.json); unset LINGBOT_FIXTURES "
                    f"to use the copy in {FIXTURES_HOME / 'lingbot'}")
    return FIXTURES
