"""Discovery and comparison of reference parity cases (tests/fixtures sets + LINGBOT_PARITY_DIRS)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from conftest import FIXTURES, fixture_set
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
        """Assert |a-e| <= atol + rtol*|e| (in float64) with the case's tolerance; integers must be equal.

        Shapes must match the expected tensor and the shape case.json states; integer tensors must
        also have the expected dtype. Returns the largest absolute difference.
        """
        want = expected[name]
        tol = self.spec["tensors"][name]
        actual = actual.detach().cpu()
        where = f"{self.name}/{name}"
        shape = tuple(want.shape)
        if "shape" in tol:
            assert shape == tuple(tol["shape"]), f"{where}: stored shape {shape} != case.json {tol['shape']}"
        assert tuple(actual.shape) == shape, f"{where}: shape {tuple(actual.shape)} != {shape}"
        if not want.is_floating_point():
            assert actual.dtype == want.dtype, f"{where}: dtype {actual.dtype} != {want.dtype}"
            assert torch.equal(actual, want), f"{where}: integer tensors differ"
            return 0.0
        diff = (actual.double() - want.double()).abs()
        bound = tol["atol"] + tol["rtol"] * want.double().abs()
        if not diff.numel():
            return 0.0
        worst = float(diff.max())
        at = [int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)]
        assert bool((diff <= bound).all()), f"{where}: max abs diff {worst:.3g} at {at} > atol {tol['atol']}"
        return worst


def _case_root(case_dir: Path, spec: dict) -> Path:
    """The folder `spec["model"]` is relative to: `model_root` (relative to the case) when the case
    names one, else the nearest parent holding `models/`, else the `lingbot` set."""
    if "model_root" in spec:
        return (case_dir / spec["model_root"]).resolve()
    for parent in case_dir.parents:
        if (parent / "models").is_dir():
            return parent
    return FIXTURES


def _case_dirs(entry: Path) -> list[Path]:
    """`entry` itself if it is a case folder, else the case folders in `entry/cases` or `entry`."""
    if (entry / "case.json").is_file():
        return [entry]
    if (entry / "cases").is_dir():
        entry = entry / "cases"
    return sorted(p for p in entry.iterdir() if (p / "case.json").is_file())


def extra_dirs() -> list[Path]:
    """The LINGBOT_PARITY_DIRS entries; one that is not a folder of cases is an error, never skipped."""
    entries = [Path(p).expanduser().resolve() for p in os.environ.get("LINGBOT_PARITY_DIRS", "").split(os.pathsep)
               if p.strip()]
    for entry in entries:
        if not entry.is_dir():
            raise FileNotFoundError(f"LINGBOT_PARITY_DIRS entry {entry} is not a folder (misspelled?)")
        if not _case_dirs(entry):
            raise FileNotFoundError(f"LINGBOT_PARITY_DIRS entry {entry} holds no case folder "
                                    "(a folder with case.json, or folders of them, directly or under cases/)")
    return entries


def discover(modes: set[str] | None = None, *, prefix: str | None = None, extra: bool = True,
             sets: tuple[str, ...] = ("lingbot",)) -> list[Case]:
    """The cases of the fixture `sets` (folders under tests/fixtures, see conftest.fixture_set), then,
    unless `extra` is False, every case under the folders in LINGBOT_PARITY_DIRS.

    LINGBOT_PARITY_DIRS is os.pathsep-separated; each entry is a case folder, a folder of case folders,
    or a folder with a `cases/` subfolder. A set or an entry that is missing raises, so a typo cannot
    quietly run fewer cases.
    """
    entries = []
    for name in sets:
        folder = fixture_set(name) / "cases"
        if not folder.is_dir():
            raise FileNotFoundError(f"fixture set {name!r} has no cases folder at {folder}")
        entries.append(folder)
    if extra:
        entries += extra_dirs()
    cases = []
    for entry in entries:
        for d in _case_dirs(entry):
            spec = json.loads((d / "case.json").read_text())
            if modes is not None and spec.get("mode") not in modes:
                continue
            if prefix is not None and not spec["name"].startswith(prefix):
                continue
            cases.append(Case(d, spec, _case_root(d, spec)))
    return cases
