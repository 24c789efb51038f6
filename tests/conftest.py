"""Shared test helpers: where the reference fixtures live."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("LINGBOT_FIXTURES", REPO_ROOT.parent / "shared" / "fixtures" / "lingbot")).resolve()

torch.set_num_threads(2)
# Tests build the tiny checkpoints in a throwaway folder, never in the user's cache.
os.environ.setdefault("LINGBOT_TINY_DIR", tempfile.mkdtemp(prefix="lingbot-tiny-"))


@pytest.fixture(scope="session")
def fixtures_root() -> Path:
    if not (FIXTURES / "manifest.json").is_file():
        pytest.fail(f"parity fixtures not found at {FIXTURES}; set LINGBOT_FIXTURES")
    return FIXTURES
