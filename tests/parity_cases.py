"""Discovery and comparison of reference parity cases (shared fixtures + LINGBOT_PARITY_DIRS)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from conftest import FIXTURES
from safetensors.torch import load_file


@dataclass
class Case:
    path: Path
    spec: dict
    root: Path  # the folder `spec["model"]` is relative to

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def model_dir(self) -> Path:
        return self.root / self.spec["model"]

    def expected(self) -> dict[str, torch.Tensor]:
        return load_file(self.path / self.spec.get("expected", "expected.safetensors"))

    def check(self, name: str, actual: torch.Tensor, expected: dict[str, torch.Tensor]) -> float:
        """Assert |a-e| <= atol + rtol*|e| with the case's tolerance; integers must be equal."""
        want = expected[name]
        tol = self.spec["tensors"][name]
        actual = actual.detach().cpu()
        assert tuple(actual.shape) == tuple(want.shape), f"{self.name}/{name}: shape {tuple(actual.shape)} != {tuple(want.shape)}"
        if not want.is_floating_point():
            assert torch.equal(actual.to(want.dtype), want), f"{self.name}/{name}: integer tensors differ"
            return 0.0
        diff = (actual.float() - want).abs()
        bound = tol["atol"] + tol["rtol"] * want.abs()
        worst = float(diff.max()) if diff.numel() else 0.0
        assert bool((diff <= bound).all()), f"{self.name}/{name}: max abs diff {worst:.3g} > atol {tol['atol']}"
        return worst


def _case_root(case_dir: Path) -> Path:
    for parent in case_dir.parents:
        if (parent / "models").is_dir():
            return parent
    return FIXTURES


def _case_dirs(entry: Path) -> list[Path]:
    if (entry / "case.json").is_file():
        return [entry]
    if (entry / "cases").is_dir():
        entry = entry / "cases"
    return sorted(p for p in entry.iterdir() if (p / "case.json").is_file())


def discover(modes: set[str] | None = None, *, prefix: str | None = None) -> list[Case]:
    """Shared cases, then every case under the folders in LINGBOT_PARITY_DIRS (os.pathsep-separated)."""
    entries = [FIXTURES / "cases"]
    entries += [Path(p) for p in os.environ.get("LINGBOT_PARITY_DIRS", "").split(os.pathsep) if p.strip()]
    cases = []
    for entry in entries:
        if not entry.exists():
            continue
        for d in _case_dirs(entry):
            spec = json.loads((d / "case.json").read_text())
            if modes is not None and spec.get("mode") not in modes:
                continue
            if prefix is not None and not spec["name"].startswith(prefix):
                continue
            cases.append(Case(d, spec, _case_root(d)))
    return cases
