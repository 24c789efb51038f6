"""The README's workflow and node tables list exactly what ships: every workflow in `workflows/` (with
its `lingbot-run` name where it has one) and every node of the registry, by its display name."""

from __future__ import annotations

import re
from pathlib import Path

from test_readme import _table_rows as _table

from lingbot_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from lingbot_nodes.cli import SHORT_NAMES

ROOT = Path(__file__).resolve().parents[1]


def _code(cell: str) -> str:
    found = re.fullmatch(r"`([^`]+)`", cell)
    return found.group(1) if found else ""


def test_every_shipped_workflow_is_in_the_workflow_table_with_its_name():
    rows = _table("| workflow | `lingbot-run` |")
    listed = {_code(row[0]) for row in rows}
    shipped = {p.name for p in (ROOT / "workflows").glob("lingbot_*.json")}
    assert listed == shipped, (sorted(shipped - listed), sorted(listed - shipped))
    for row in rows:
        name = _code(row[1])
        if name:
            assert SHORT_NAMES.get(name) + ".json" == _code(row[0]), row
    # every shipped name reaches the table (the aliases of one workflow: the first is listed)
    named = {_code(row[0]) for row in rows if _code(row[1])}
    assert {stem + ".json" for stem in SHORT_NAMES.values()} <= named


def test_every_node_is_in_the_node_table():
    listed = {row[0] for row in _table("| node | what it does |")}
    registered = {NODE_DISPLAY_NAME_MAPPINGS.get(key, key) for key in NODE_CLASS_MAPPINGS}
    assert listed == registered, (sorted(registered - listed), sorted(listed - registered))
