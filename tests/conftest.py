"""Shared test helpers: where the reference fixtures live."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("LINGBOT_FIXTURES", REPO_ROOT.parent / "shared" / "fixtures" / "lingbot")).resolve()

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def fixtures_root() -> Path:
    if not (FIXTURES / "manifest.json").is_file():
        pytest.fail(f"parity fixtures not found at {FIXTURES}; set LINGBOT_FIXTURES")
    return FIXTURES
