"""The fixture sets ship with the repository; case discovery fails loudly on a bad extra folder."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import parity_cases
import pytest
from conftest import FIXTURES_HOME, REPO_ROOT, fixture_set

# CI clones beside a `shared/` folder; a helper worktree sits one level deeper.
SHARED = next((p / "shared" / "fixtures" for p in REPO_ROOT.parents[:2] if (p / "shared" / "fixtures").is_dir()),
              REPO_ROOT.parent / "shared" / "fixtures")


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_lingbot_set_is_in_the_repository():
    root = FIXTURES_HOME / "lingbot"
    assert (root / "manifest.json").is_file()
    names = {c.name for c in parity_cases.discover(extra=False)}
    assert {"transformer-dense", "t2v-dense", "t2i-dense", "ti2v-dense", "t2v-moe", "refine-moe"} <= names
    for case in parity_cases.discover(extra=False):
        assert case.model_dir.is_dir(), case.name


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES_HOME.iterdir() if p.is_dir()))
def test_repository_copy_matches_shared(name):
    """Where a shared fixtures folder sits beside the checkout, our copy of each set is byte-identical."""
    if not (SHARED / name).is_dir():
        pytest.skip(f"no shared copy of the {name!r} fixture set beside this checkout to compare with "
                    "(a developer machine has one)")
    assert _digests(FIXTURES_HOME / name) == _digests(SHARED / name)


@pytest.mark.parametrize("kind", ["missing", "no-cases"])
def test_bad_parity_dir_entry_fails_loudly(tmp_path, monkeypatch, kind):
    entry = tmp_path / ("typo" if kind == "missing" else "empty")
    if kind == "no-cases":
        entry.mkdir()
    monkeypatch.setenv("LINGBOT_PARITY_DIRS", str(entry))
    with pytest.raises(FileNotFoundError, match="LINGBOT_PARITY_DIRS entry"):
        parity_cases.discover()


def test_unknown_fixture_set_fails_loudly():
    with pytest.raises(FileNotFoundError, match="fixture set 'lingbot-nope'"):
        parity_cases.discover(sets=("lingbot-nope",))


def test_sibling_sets_resolve_models_through_model_root(tmp_path, monkeypatch):
    """A set beside `lingbot/` (as lingbot-dmd / lingbot-lora are) finds the models via `model_root`
    or, without one, falls back to the lingbot set."""
    src = fixture_set("lingbot")
    other = tmp_path / "lingbot-extra" / "cases"
    shutil.copytree(src / "cases" / "transformer-dense", other / "with-root")
    shutil.copytree(src / "cases" / "t2i-dense", other / "without-root")
    spec = (other / "with-root" / "case.json").read_text()
    (other / "with-root" / "case.json").write_text(
        spec.replace('"model":', f'"model_root": "{src}", "model":', 1))
    monkeypatch.setenv("LINGBOT_PARITY_DIRS", str(tmp_path / "lingbot-extra"))
    found = {c.path.name: c for c in parity_cases.discover() if c.path.parent == other}
    assert found["with-root"].model_dir == src / "models" / "tiny-dense"
    assert found["without-root"].model_dir == src / "models" / "tiny-dense"


def test_a_test_run_leaves_no_tiny_folder_behind(tmp_path):
    """conftest makes a throwaway LINGBOT_TINY_DIR per session and removes it at the end."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "LINGBOT_TINY_DIR"}
    env["TMPDIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{__file__}::test_unknown_fixture_set_fails_loudly"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not list(tmp_path.glob("lingbot-tiny-*"))
