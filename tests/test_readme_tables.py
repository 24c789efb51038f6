"""The README's workflow and node tables list exactly what ships: every workflow of the shipped-workflow
registry (by its template title, with a name `lingbot-run` takes) and every node of the registry, by its
display name."""

from __future__ import annotations

import re
from pathlib import Path

from test_readme import _table_rows as _table

from lingbot_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from lingbot_nodes.cli import SHORT_NAMES, resolve_workflow

ROOT = Path(__file__).resolve().parents[1]


def _code(cell: str) -> str:
    found = re.fullmatch(r"`([^`]+)`", cell)
    return found.group(1) if found else ""


def test_every_shipped_workflow_is_in_the_workflow_table_with_its_name():
    """One row per shipped workflow, by the title the template browser shows, with a name `lingbot-run`
    resolves to that workflow's API file; every short name reaches the table."""
    from workflows import build

    rows = _table("| template | `lingbot-run` |")
    by_title = {spec["title"]: name for name, spec in build.WORKFLOWS.items()}
    listed = [row[0] for row in rows]
    assert sorted(listed) == sorted(by_title), (sorted(set(by_title) - set(listed)), sorted(set(listed) - set(by_title)))
    for row in rows:
        assert resolve_workflow(_code(row[1])).resolve() == build.api_path(by_title[row[0]]).resolve(), row
    # every shipped name reaches the table (the aliases of one workflow: the first is listed)
    named = {SHORT_NAMES.get(_code(row[1]), _code(row[1])) for row in rows}
    assert set(SHORT_NAMES.values()) <= named


def test_every_node_is_in_the_node_table():
    listed = {row[0] for row in _table("| node | what it does |")}
    registered = {NODE_DISPLAY_NAME_MAPPINGS.get(key, key) for key in NODE_CLASS_MAPPINGS}
    assert listed == registered, (sorted(registered - listed), sorted(listed - registered))
