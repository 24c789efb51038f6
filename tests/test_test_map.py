"""The module -> test map in docs/contributing.md ("Where each module is tested"): every product module
of lingbot_core/ and nodes/ has a row, every row names a module that exists, and every test file it
names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "contributing.md"
PRODUCT = ("lingbot_core", "nodes")
ROW = re.compile(r"^\| `([^`]+\.py)` \| (.+) \|$")


def _map() -> dict[str, list[str]]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Where each module is tested", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        found = ROW.match(line.strip())
        if found:
            assert found.group(1) not in rows, f"{found.group(1)} has two rows"
            rows[found.group(1)] = re.findall(r"`([^`]+)`", found.group(2))
    return rows


def _modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for package in PRODUCT for p in (ROOT / package).rglob("*.py")
            if "__pycache__" not in p.parts}


def test_every_module_has_a_row_and_every_row_a_module():
    rows, modules = _map(), _modules()
    assert len(rows) > 50  # the section was found and read
    missing = sorted(modules - set(rows))
    assert not missing, f"docs/contributing.md, 'Where each module is tested': add a row for {missing}"
    gone = sorted(set(rows) - modules)
    assert not gone, f"docs/contributing.md lists modules that do not exist (moved or removed?): {gone}"


def test_every_listed_test_exists():
    for module, tests in _map().items():
        assert tests, f"{module}: its row names no test file"
        for test in tests:
            assert test.startswith("tests/") and (ROOT / test).is_file(), f"{module}: {test} does not exist"
