"""Property-based fuzzing of workflow loading and validation over the shipped workflows.

Whatever a workflow file holds, loading and validating it either succeeds or raises the engine's
own :class:`WorkflowError` (which the CLI turns into exit 2) with a bounded message; never a
``TypeError``, ``RecursionError`` or ``UnicodeDecodeError`` from deep inside. Nothing here runs a
model: the properties stop at validation, so the whole file takes seconds.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lingbot_core.workflow import Engine, WorkflowError, load_workflow  # noqa: E402
from lingbot_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1] / "workflows"
SHIPPED = {p.parent.name + "/" + p.name: json.loads(p.read_text())
           for p in sorted([*ROOT.glob("*.json"), *(ROOT / "api").glob("*.json")])}
MAX_MESSAGE = 20_000
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["LingBotLoader", "LINGBOT_PIPE", "IMAGE", "Reroute", "PrimitiveNode", "Note", "*",
                     "1", "2", "-1", "fixed", "__value__", "../x", "", "tiny (built-in dense)"]),
    st.builds(lambda: 10 ** 5000),  # more digits than str(int) allows
    st.builds(lambda: "x" * 200_000),  # a huge field: messages must not echo it whole
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.text(max_size=6) | st.sampled_from(
                                   ["id", "type", "inputs", "outputs", "links", "link", "widgets_values",
                                    "class_type", "mode", "nodes", "definitions", "subgraphs", "name",
                                    "__value__", "widget", "order"]), children, max_size=4)),
    max_leaves=12,
)


def _deep(levels: int) -> Any:
    value: Any = 0
    for i in range(levels):
        value = [value] if i % 2 else {"a": value}
    return value


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into the document (iteratively: the shipped files are small but we stay safe)."""
    out = [prefix]
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _paths(value, prefix + (key,))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            out += _paths(value, prefix + (index,))
    return out


PATHS = {name: _paths(doc) for name, doc in SHIPPED.items()}


@st.composite
def mutated_workflows(draw: st.DrawFn) -> tuple[str, Any]:
    name = draw(st.sampled_from(sorted(SHIPPED)))
    doc = copy.deepcopy(SHIPPED[name])
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS[name]))
        action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "deep", "swap"]))
        if not path:
            if action in ("replace", "deep"):
                doc = draw(json_values) if action == "replace" else _deep(draw(st.integers(400, 3000)))
            continue
        parent = doc
        try:
            for key in path[:-1]:
                parent = parent[key]
            key = path[-1]
            if action == "replace":
                parent[key] = draw(json_values)
            elif action == "delete":
                del parent[key]
            elif action == "deep":
                parent[key] = _deep(draw(st.integers(400, 3000)))
            else:  # swap in a value from elsewhere in some shipped file (plausible but wrong)
                other = draw(st.sampled_from(sorted(SHIPPED)))
                source: Any = SHIPPED[other]
                for k in draw(st.sampled_from(PATHS[other])):
                    source = source[k]
                parent[key] = copy.deepcopy(source)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or replaced this path
    return name, doc


def _check_outcome(load) -> None:
    try:
        prompt = load()
        Engine(NODE_CLASS_MAPPINGS).validate(prompt)
    except WorkflowError as err:
        text = str(err)
        assert len(text) < MAX_MESSAGE, f"message of {len(text)} characters"
        assert not getattr(err, "internal", False), f"an unexpected failure reached the safety net: {text}"


@FUZZ
@given(mutated_workflows())
def test_mutated_shipped_workflow_loads_or_raises_workflow_error(case):
    _name, doc = case
    _check_outcome(lambda: load_workflow(doc, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS))


@FUZZ
@given(st.sampled_from(sorted(SHIPPED)), st.binary(max_size=64), st.integers(0, 2000), st.integers(0, 3))
def test_mutated_file_bytes_load_or_raise_workflow_error(tmp_path_factory, name, junk, position, kind):
    data = json.dumps(SHIPPED[name]).encode()
    position = min(position, len(data))
    if kind == 0:  # raw bytes spliced in (often not UTF-8)
        data = data[:position] + junk + data[position:]
    elif kind == 1:  # cut short
        data = data[:position]
    elif kind == 2:  # latin-1 re-encoding of the whole file
        data = json.dumps(SHIPPED[name], ensure_ascii=False).encode("utf-16")
    else:
        data = b"\xef\xbb\xbf" + data  # a UTF-8 BOM, as some Windows editors write
    path = tmp_path_factory.mktemp("fuzz") / "workflow.json"
    path.write_bytes(data)
    _check_outcome(lambda: load_workflow(path, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS))


@pytest.mark.parametrize("text", [
    "[" * 5000 + "]" * 5000,
    '{"a":' * 3000 + "1" + "}" * 3000,
    '{"1": {"class_type": "LingBotLoader", "inputs": {"x": ' + "9" * 5000 + "}}}",
    '{"1": {"class_type": "LingBotLoader", "inputs": {"x": 1e999999}}}',
])
def test_pathological_json_text_is_a_workflow_error(tmp_path, text):
    path = tmp_path / "w.json"
    path.write_text(text)
    with pytest.raises(WorkflowError) as info:
        Engine(NODE_CLASS_MAPPINGS).validate(load_workflow(path, NODE_CLASS_MAPPINGS))
    assert str(path) in str(info.value)


def test_non_utf8_file_is_a_workflow_error_naming_the_file(tmp_path):
    path = tmp_path / "w.json"
    path.write_bytes(b'{"1": {"class_type": "LingBotLoader\xff\xfe"}}')
    with pytest.raises(WorkflowError, match="UTF-8"):
        load_workflow(path, NODE_CLASS_MAPPINGS)


def test_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "w.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(SHIPPED["api/lingbot_t2v_dense.json"]).encode())
    prompt = load_workflow(path, NODE_CLASS_MAPPINGS)
    assert Engine(NODE_CLASS_MAPPINGS).validate(prompt)


@pytest.mark.parametrize("levels", [450, 1000, 5000])
def test_deeply_nested_dict_workflow_is_a_workflow_error(levels):
    doc = copy.deepcopy(SHIPPED["api/lingbot_t2v_dense.json"])
    doc["3"]["inputs"]["prompt"] = {"__value__": _deep(levels)}
    with pytest.raises(WorkflowError, match="nest"):
        Engine(NODE_CLASS_MAPPINGS).validate(load_workflow(doc, NODE_CLASS_MAPPINGS))
    with pytest.raises(WorkflowError, match="nest"):
        Engine(NODE_CLASS_MAPPINGS).validate(doc)  # the Python API, without load_workflow


@pytest.mark.parametrize("content", [b'{"1": {"class_type": "LingBotLoader\xff"}}', b"[" * 5000,
                                     b'{"nodes": [{"id": 1, "inputs": 5}], "links": []}'])
def test_cli_reports_a_malformed_workflow_with_exit_code_2(tmp_path, monkeypatch, capsys, content):
    from lingbot_nodes.cli import main

    monkeypatch.setenv("LINGBOT_OUTPUT_DIR", str(tmp_path / "out"))
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    assert main([str(path), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "TypeError" not in err


def test_a_path_of_any_length_gets_a_short_message():
    # a workflow given as a string is a path; a 200,000-character one made a 400,000-character message
    # (the path, then the OS error quoting it again)
    with pytest.raises(WorkflowError) as err:
        load_workflow("x" * 200_000, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS)
    assert len(str(err.value)) < 1000 and "cannot read workflow file" in str(err.value)
