"""The shipped workflows: structure, widget values, UI -> API conversion, and that they are current."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lingbot_core.workflow import Engine, load_workflow, ui_to_api
from lingbot_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

ROOT = Path(__file__).resolve().parents[1] / "workflows"
UI_FILES = sorted(ROOT.glob("lingbot_*.json"))
EXPECTED = {"lingbot_t2v_dense", "lingbot_t2i_dense", "lingbot_ti2v_dense", "lingbot_t2v_moe_refine"}


def test_every_shipped_workflow_has_both_formats():
    assert {p.stem for p in UI_FILES} == EXPECTED
    assert {p.stem for p in (ROOT / "api").glob("*.json")} == EXPECTED


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_ui_file_converts_to_exactly_the_shipped_api_file(path):
    ui = json.loads(path.read_text())
    api = json.loads((ROOT / "api" / path.name).read_text())
    assert ui_to_api(ui, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS) == api


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.stem)
def test_ui_file_structure(path):
    ui = json.loads(path.read_text())
    nodes = {n["id"]: n for n in ui["nodes"]}
    for node in nodes.values():
        assert node["type"] in NODE_CLASS_MAPPINGS or node["type"] == "Note", node["type"]
    assert any(n["type"] == "Note" and n["widgets_values"][0] for n in nodes.values()), "a short note"
    assert ui["groups"], "a group"
    assert ui["last_link_id"] == max(link[0] for link in ui["links"])
    for link_id, src, src_slot, dst, dst_slot, kind in ui["links"]:
        out = nodes[src]["outputs"][src_slot]
        inp = nodes[dst]["inputs"][dst_slot]
        assert link_id in out["links"] and inp["link"] == link_id
        assert out["type"] == kind and (inp["type"] == kind or "*" in (kind, inp["type"]))
    for node in nodes.values():
        for out in node.get("outputs", []):
            for link_id in out["links"]:
                assert any(link[0] == link_id for link in ui["links"])


@pytest.mark.parametrize("path", [*UI_FILES, *sorted((ROOT / "api").glob("*.json"))], ids=lambda p: p.parent.name + "/" + p.stem)
def test_widget_values_fit_the_inputs(path):
    """Full validation (types, ranges, combos, VALIDATE_INPUTS) passes without running anything."""
    prompt = load_workflow(path, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS)
    targets = Engine(NODE_CLASS_MAPPINGS).validate(prompt)
    kinds = {prompt.nodes[t]["class_type"] for t in targets}
    assert "LingBotSaveVideo" in kinds and kinds <= {"LingBotSaveVideo", "LingBotMemoryReport"}


def test_files_are_generated_from_the_current_spec():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "build.py"), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_offload_node_and_prompt_field_is_sane():
    for path in (ROOT / "api").glob("*.json"):
        prompt = json.loads(path.read_text())
        kinds = [n["class_type"] for n in prompt.values()]
        assert "LingBotOffload" in kinds, path.name
        for node in prompt.values():
            if node["class_type"] == "LingBotTextEncode":
                json.loads(node["inputs"]["prompt"])  # structured captions ship as valid JSON
