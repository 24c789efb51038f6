"""The headless workflow engine: loading, UI->API conversion, validation, cache, laziness,
order independence, errors, interrupts and overrides — all with fake node classes."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import workflow_fakes as fakes
from workflow_fakes import REGISTRY, ran

from lingbot_core.workflow import (
    ApiPrompt,
    Engine,
    Interrupted,
    NodeExecutionError,
    RunInterrupted,
    WorkflowError,
    WorkflowValidationError,
    apply_overrides,
    current_node_id,
    load_workflow,
    parse_override,
    run_workflow_file,
    ui_to_api,
)


@pytest.fixture(autouse=True)
def _reset_fakes() -> None:
    fakes.reset()
    fakes.Switch.lazy_calls.clear()
    fakes.Volatile.is_changed_calls = 0


def node(class_type: str, **inputs: Any) -> dict[str, Any]:
    return {"class_type": class_type, "inputs": inputs}


def chain_prompt() -> dict[str, Any]:
    """1 Number -> 3 Add <- 2 Number; 3 -> 4 Scale -> 5 Show; 6 Number -> 7 Show (unrelated)."""
    return {
        "1": node("Number", value=2),
        "2": node("Number", value=3),
        "3": node("Add", a=["1", 0], b=["2", 0]),
        "4": node("Scale", x=["3", 0], factor=2.0),
        "5": node("Show", value=["4", 0]),
        "6": node("Number", value=7),
        "7": node("Show", value=["6", 0]),
    }


def write(tmp_path: Path, data: Any, name: str = "wf.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


# -- loading ------------------------------------------------------------------------------------------


def test_load_api_file_normalises_ids_and_runs(tmp_path: Path) -> None:
    data = chain_prompt()
    data["3"]["inputs"]["a"] = [1, 0]  # hand-written files use int ids
    prompt = load_workflow(write(tmp_path, data), REGISTRY)
    assert prompt.format == "api"
    assert prompt.nodes["3"]["inputs"]["a"] == ["1", 0]
    result = Engine(REGISTRY).run(prompt)
    assert result.output("4") == 10.0
    assert result.ui["5"] == {"text": ["10.0"]}


def test_load_accepts_post_body_wrapper() -> None:
    prompt = load_workflow({"prompt": chain_prompt(), "client_id": "x"}, REGISTRY)
    assert set(prompt.nodes) == set(chain_prompt())


def test_malformed_json_names_file_and_position(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "1": {"class_type": "Number",\n  "inputs": {"value": 1,}}\n}', encoding="utf-8")
    with pytest.raises(WorkflowError) as err:
        load_workflow(path, REGISTRY)
    message = str(err.value)
    assert "broken.json" in message and "line 3" in message and "column" in message


def test_missing_file_is_a_workflow_error(tmp_path: Path) -> None:
    with pytest.raises(WorkflowError, match="not found"):
        load_workflow(tmp_path / "nope.json", REGISTRY)


def test_unknown_node_type_names_id_and_type() -> None:
    data = chain_prompt()
    data["9"] = node("Mystery", value=1)
    with pytest.raises(WorkflowValidationError) as err:
        load_workflow(data, REGISTRY)
    assert [(i.node_id, i.class_type) for i in err.value.issues] == [("9", "Mystery")]
    assert "node 9 (Mystery)" in str(err.value) and "unknown node type" in str(err.value)


def test_link_errors_are_collected_with_node_ids() -> None:
    data = chain_prompt()
    data["3"]["inputs"]["a"] = ["42", 0]  # dangling
    data["3"]["inputs"]["b"] = ["2", 1]  # Number has one output
    data["4"]["inputs"]["x"] = ["6", 0]
    data["8"] = node("Blur", strength=["4", 0], image=["1", 0], radius=1)  # INT into IMAGE
    with pytest.raises(WorkflowValidationError) as err:
        load_workflow(data, REGISTRY)
    by_input = {(i.node_id, i.input_name): i.message for i in err.value.issues}
    assert set(by_input) == {("3", "a"), ("3", "b"), ("8", "image")}
    assert "node 42" in by_input[("3", "a")]
    assert "output 1 of node 2" in by_input[("3", "b")]
    assert "INT" in by_input[("8", "image")] and "IMAGE" in by_input[("8", "image")]


def test_link_type_rules_any_and_combo() -> None:
    data = {
        "1": node("Choice"),
        "2": node("Picky", path="ok", choice=["1", 0]),  # COMBO output into a COMBO input
        "3": node("Show", value=["2", 0]),  # anything into "*"
    }
    assert Engine(REGISTRY).run(load_workflow(data, REGISTRY)).output("2") == "ok:b"
    data["2"]["inputs"]["path"] = ["1", 0]  # COMBO into STRING is a mismatch
    with pytest.raises(WorkflowValidationError, match="type mismatch"):
        load_workflow(data, REGISTRY)


def test_neither_format_is_rejected() -> None:
    with pytest.raises(WorkflowError, match="neither"):
        load_workflow({"foo": 1}, REGISTRY)
    with pytest.raises(WorkflowError, match="JSON object"):
        load_workflow([1, 2], REGISTRY)  # type: ignore[arg-type]


# -- UI -> API conversion ------------------------------------------------------------------------------


def ui_node(node_id: int, class_type: str, *, widgets: Any = None, inputs: list[dict[str, Any]] | None = None,
            outputs: list[dict[str, Any]] | None = None, mode: int = 0, order: int | None = None,
            title: str | None = None) -> dict[str, Any]:
    n: dict[str, Any] = {"id": node_id, "type": class_type, "pos": [0, 0], "size": [200, 80], "flags": {},
                         "order": node_id if order is None else order, "mode": mode,
                         "inputs": inputs or [], "outputs": outputs or [], "properties": {}}
    if widgets is not None:
        n["widgets_values"] = widgets
    if title is not None:
        n["title"] = title
    return n


def inp(name: str, type_: str, link: int | None, widget: bool = False) -> dict[str, Any]:
    d: dict[str, Any] = {"name": name, "type": type_, "link": link}
    if widget:
        d["widget"] = {"name": name}
    return d


def out(name: str, type_: str, links: list[int]) -> dict[str, Any]:
    return {"name": name, "type": type_, "links": links, "slot_index": 0}


def ui_workflow(nodes: list[dict[str, Any]], links: list[list[Any]]) -> dict[str, Any]:
    return {"last_node_id": max(n["id"] for n in nodes), "last_link_id": len(links), "nodes": nodes,
            "links": links, "groups": [], "config": {}, "extra": {"ds": {"scale": 1, "offset": [0, 0]}},
            "version": 0.4}


def sampler_ui(widgets: list[Any]) -> dict[str, Any]:
    return ui_workflow(
        [
            ui_node(1, "Number", widgets=[5], outputs=[out("INT", "INT", [1])], order=0, title="Five"),
            ui_node(2, "Sampler", widgets=widgets, inputs=[inp("value", "INT", 1)],
                    outputs=[out("STRING", "STRING", [2])], order=1),
            ui_node(3, "Show", inputs=[inp("value", "*", 2)], order=2),
        ],
        [[1, 1, 0, 2, 0, "INT"], [2, 2, 0, 3, 0, "STRING"]],
    )


def test_ui_conversion_matches_the_frontend_prompt() -> None:
    # seed, its control value, mode, steps, its control value, strength (saved as 1, a FLOAT)
    api = ui_to_api(sampler_ui([123, "randomize", "fixed", 8, "fixed", 1]), REGISTRY)
    assert api == {
        "1": {"inputs": {"value": 5}, "class_type": "Number", "_meta": {"title": "Five"}},
        "2": {"inputs": {"seed": 123, "mode": "fixed", "steps": 8, "strength": 1.0, "value": ["1", 0]},
              "class_type": "Sampler", "_meta": {"title": "Sampler"}},
        "3": {"inputs": {"value": ["2", 0]}, "class_type": "Show", "_meta": {"title": "Show"}},
    }
    assert isinstance(api["2"]["inputs"]["strength"], float)
    assert list(api) == ["1", "2", "3"]


def test_ui_conversion_decides_control_values_by_count() -> None:
    # An older save without the control values: "fixed" here is the combo's value, not a control.
    api = ui_to_api(sampler_ui([123, "fixed", 8, 0.5]), REGISTRY)
    assert api["2"]["inputs"] == {"seed": 123, "mode": "fixed", "steps": 8, "strength": 0.5, "value": ["1", 0]}
    # The control value can be anything in old files (the default graph once saved `true`).
    api = ui_to_api(sampler_ui([7, True, "slow", 3, "increment", 2]), REGISTRY)
    assert api["2"]["inputs"]["mode"] == "slow" and api["2"]["inputs"]["steps"] == 3
    # A save from before the optional widget existed: the frontend keeps its default.
    api = ui_to_api(sampler_ui([9, "randomize", "fast", 4, "fixed"]), REGISTRY)
    assert api["2"]["inputs"]["strength"] == 1.0
    # A save with its control values, as many values as the class has widgets now (it grew since): the
    # values only fit their widgets with the control slots kept, so the layout keeps them.
    api = ui_to_api(sampler_ui([9, "randomize", "fast", 4]), REGISTRY)
    assert api["2"]["inputs"] == {"seed": 9, "mode": "fast", "steps": 4, "strength": 1.0, "value": ["1", 0]}
    with pytest.raises(WorkflowValidationError, match="node 2 .*8 widget values"):
        ui_to_api(sampler_ui([1, "fixed", "fast", 4, "fixed", 1.0, 99, 98]), REGISTRY)


def test_converted_widget_link_wins_and_primitive_value_is_applied() -> None:
    wf = ui_workflow(
        [
            ui_node(1, "Number", widgets=[4], outputs=[out("INT", "INT", [1, 3])]),
            ui_node(2, "Sampler", widgets=[11, "fixed", "fast", 4, "fixed", 1.0],
                    inputs=[inp("value", "INT", 1), inp("seed", "INT", 3, widget=True),
                            inp("steps", "INT", 4, widget=True)],
                    outputs=[out("STRING", "STRING", [2])]),
            ui_node(3, "Show", inputs=[inp("value", "*", 2)]),
            ui_node(4, "PrimitiveNode", widgets=[17, "fixed"], outputs=[out("INT", "INT", [4])]),
        ],
        [[1, 1, 0, 2, 0, "INT"], [2, 2, 0, 3, 0, "STRING"], [3, 1, 0, 2, 1, "INT"], [4, 4, 0, 2, 2, "INT"]],
    )
    api = ui_to_api(wf, REGISTRY)
    assert api["2"]["inputs"]["seed"] == ["1", 0]  # the link beats the saved widget value 11
    assert api["2"]["inputs"]["steps"] == 17  # the primitive's value beats the saved 4
    assert "4" not in api  # the primitive itself is virtual


def test_muted_node_is_dropped_with_the_inputs_it_fed() -> None:
    wf = sampler_ui([1, "fixed", "fast", 4, "fixed", 1.0])
    wf["nodes"][0]["mode"] = 2
    api = ui_to_api(wf, REGISTRY)
    assert "1" not in api
    assert "value" not in api["2"]["inputs"]
    with pytest.raises(WorkflowValidationError, match=r"node 2 \(Sampler\) input 'value': required input is missing"):
        Engine(REGISTRY).run(api)


def bypass_ui(extra_nodes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """ImageSource 1 -> Blur 2 (bypassed) -> Reroute 5 -> Reroute 6 -> Show 3; Number 4 feeds Blur's strength."""
    nodes = [
        ui_node(1, "ImageSource", widgets=["cat"], outputs=[out("IMAGE", "IMAGE", [1])]),
        ui_node(4, "Scale", widgets=[1.0], inputs=[inp("x", "INT", None)], outputs=[out("FLOAT", "FLOAT", [2])]),
        ui_node(2, "Blur", widgets=[3], mode=4,
                inputs=[inp("strength", "FLOAT", 2), inp("image", "IMAGE", 1), inp("radius", "INT", None, widget=True)],
                outputs=[out("IMAGE", "IMAGE", [3])]),
        ui_node(5, "Reroute", inputs=[inp("", "*", 3)], outputs=[out("", "IMAGE", [4])]),
        ui_node(6, "Reroute", inputs=[inp("", "*", 4)], outputs=[out("", "IMAGE", [5])]),
        ui_node(3, "Show", inputs=[inp("value", "IMAGE", 5)]),
        ui_node(7, "Note", widgets=["remember to bypass the blur"]),
        ui_node(8, "MarkdownNote", widgets=["# notes"]),
    ]
    links = [[1, 1, 0, 2, 1, "IMAGE"], [2, 4, 0, 2, 0, "FLOAT"], [3, 2, 0, 5, 0, "IMAGE"],
             [4, 5, 0, 6, 0, "*"], [5, 6, 0, 3, 0, "IMAGE"]]
    return ui_workflow(nodes + (extra_nodes or []), links)


def test_bypass_passes_the_matching_type_through_reroutes_and_notes_are_ignored() -> None:
    api = ui_to_api(bypass_ui(), REGISTRY)
    assert set(api) == {"1", "3", "4"}  # no Blur (bypassed), Reroutes or Notes
    # Blur's first input is a FLOAT; its IMAGE output passes through its IMAGE input instead.
    assert api["3"]["inputs"] == {"value": ["1", 0]}
    assert Engine(REGISTRY).run(api, outputs=["3"]).ui["3"] == {"text": ["['cat']"]}


def test_active_blur_is_linked_normally() -> None:
    wf = bypass_ui()
    wf["nodes"][2]["mode"] = 0
    api = ui_to_api(wf, REGISTRY)
    assert api["2"]["inputs"] == {"radius": 3, "strength": ["4", 0], "image": ["1", 0]}
    assert api["3"]["inputs"] == {"value": ["2", 0]}


def test_upload_widget_value_and_dict_widgets_are_handled() -> None:
    wf = ui_workflow([
        ui_node(1, "LoadImage", widgets=["b.png", "image"], outputs=[out("IMAGE", "IMAGE", [1])]),
        ui_node(2, "Show", inputs=[inp("value", "IMAGE", 1)]),
        ui_node(3, "Text", widgets={"text": "hello", "preview": {"hidden": True}}),
    ], [[1, 1, 0, 2, 0, "IMAGE"]])
    api = ui_to_api(wf, REGISTRY)
    assert api["1"]["inputs"] == {"image": "b.png"}
    assert api["3"]["inputs"] == {"text": "hello"}


def test_ui_errors_name_the_node() -> None:
    wf = sampler_ui([1, "fixed", "fast", 4, "fixed", 1.0])
    wf["links"] = wf["links"][1:]  # node 2's input link 1 is gone
    with pytest.raises(WorkflowValidationError, match=r"node 2 \(Sampler\) input 'value'.*dangling"):
        ui_to_api(wf, REGISTRY)
    wf = sampler_ui([1, "fixed", "fast", 4, "fixed", 1.0])
    wf["nodes"][2]["type"] = "SaveSomething"
    with pytest.raises(WorkflowValidationError, match=r"node 3 \(SaveSomething\): unknown node type"):
        ui_to_api(wf, REGISTRY)
    wf = sampler_ui([1, "fixed", "fast", 4, "fixed", 1.0])
    wf["definitions"] = {"subgraphs": [{"id": "0b6e-uuid"}]}
    wf["nodes"][2]["type"] = "0b6e-uuid"
    with pytest.raises(WorkflowValidationError, match="node 3 .*subgraph"):
        ui_to_api(wf, REGISTRY)


def test_muted_node_of_an_unknown_class_does_not_matter() -> None:
    wf = sampler_ui([1, "fixed", "fast", 4, "fixed", 1.0])
    wf["nodes"].append(ui_node(9, "SomePackNode", widgets=[1, 2], mode=2))
    assert "9" not in ui_to_api(wf, REGISTRY)
    wf["nodes"][-1]["mode"] = 0
    with pytest.raises(WorkflowValidationError, match="node 9"):
        ui_to_api(wf, REGISTRY)


def test_hidden_prompt_and_workflow_metadata_reach_the_node(tmp_path: Path) -> None:
    wf = sampler_ui([1, "fixed", "fast", 4, "fixed", 1.0])
    wf["nodes"][2]["type"] = "Meta"
    result = run_workflow_file(write(tmp_path, wf), REGISTRY)
    assert result.output("3") == "['1', '2', '3']|True"  # the editor's workflow travels as EXTRA_PNGINFO
    api = load_workflow(write(tmp_path, wf), REGISTRY).to_dict()
    assert Engine(REGISTRY).run(api).output("3") == "['1', '2', '3']|False"


def test_load_ui_file_and_title_override(tmp_path: Path) -> None:
    path = write(tmp_path, sampler_ui([1, "fixed", "fast", 4, "fixed", 1.0]), "ui.json")
    prompt = load_workflow(path, REGISTRY)
    assert prompt.format == "ui" and prompt.ui is not None
    result = run_workflow_file(path, REGISTRY, overrides=["Five.value=9", "Sampler.mode=slow"])
    assert result.output("2") == "9|1|slow|4|1.0"


# -- validation -----------------------------------------------------------------------------------------


def test_value_errors_are_collected_before_anything_runs() -> None:
    prompt = {
        "1": node("Number", value=101),  # > max
        "2": node("Number", value="seven"),  # not an int
        "3": node("Add", a=["1", 0], b=["2", 0], bias=2.5),  # not integral
        "4": node("Scale", x=["3", 0], factor=0.7),  # off the 0.5 step grid: accepted, as ComfyUI does
        "5": node("Sampler", value=["3", 0], seed=1, mode="medium", steps=0),  # combo, min
        "6": node("Switch", cond="yes", on_true=["4", 0], on_false=["5", 0]),  # not a bool
        "7": node("Show", value=["6", 0]),
        "8": node("Fail", value=["1", 0]),  # required 'boom' missing
        "9": node("Show", value=["8", 0]),
        "10": node("Text", text=5),
        "11": node("Show", value=["10", 0]),
    }
    with pytest.raises(WorkflowValidationError) as err:
        Engine(REGISTRY).run(prompt)
    found = {(i.node_id, i.class_type, i.input_name) for i in err.value.issues}
    assert found == {
        ("1", "Number", "value"), ("2", "Number", "value"), ("3", "Add", "bias"),
        ("5", "Sampler", "mode"), ("5", "Sampler", "steps"), ("6", "Switch", "cond"), ("8", "Fail", "boom"),
        ("10", "Text", "text"),
    }
    text = str(err.value)
    assert "bigger than the maximum 100" in text and "not one of ['fast', 'fixed', 'slow']" in text
    assert fakes.CALLS == []


def test_validate_inputs_runs_with_named_constants_and_replaces_combo_check() -> None:
    prompt = {"1": node("Picky", path="bad/path", choice="a"), "2": node("Show", value=["1", 0])}
    with pytest.raises(WorkflowValidationError, match=r"node 1 \(Picky\).*must start with 'ok'"):
        Engine(REGISTRY).run(prompt)
    # "custom" is not in the declared combo, but Picky validates `choice` itself and accepts it.
    prompt["1"]["inputs"].update(path="ok.txt", choice="custom")
    assert Engine(REGISTRY).run(prompt).output("1") == "ok.txt:custom"


def test_only_needed_nodes_are_validated_and_run() -> None:
    prompt = chain_prompt()
    prompt["6"]["inputs"]["value"] = 1000  # invalid, but only node 7's branch needs it
    result = Engine(REGISTRY).run(prompt, outputs=["5"])
    assert sorted(result.executed) == ["1", "2", "3", "4", "5"]
    with pytest.raises(WorkflowValidationError, match="node 6"):
        Engine(REGISTRY).run(prompt)


def test_cycles_and_missing_outputs_are_reported() -> None:
    prompt = {"1": node("Add", a=["2", 0], b=["2", 0]), "2": node("Add", a=["1", 0], b=["1", 0]),
              "3": node("Show", value=["1", 0])}
    with pytest.raises(WorkflowValidationError, match="dependency cycle"):
        Engine(REGISTRY).run(prompt)
    with pytest.raises(WorkflowValidationError, match="no output nodes"):
        Engine(REGISTRY).run({"1": node("Number", value=1)})
    with pytest.raises(WorkflowValidationError, match="node 99"):
        Engine(REGISTRY).run(chain_prompt(), outputs=["99"])


# -- cache ----------------------------------------------------------------------------------------------


def test_rerun_executes_nothing_and_a_changed_widget_reruns_only_descendants() -> None:
    engine = Engine(REGISTRY)
    first = engine.run(chain_prompt())
    assert sorted(first.executed) == ["1", "2", "3", "4", "5", "6", "7"]
    assert first.cached == []

    again = engine.run(chain_prompt())
    assert again.executed == []
    assert again.cached == ["1", "2", "3", "4", "5", "6", "7"]
    assert again.output("4") == 10.0 and again.ui["5"] == {"text": ["10.0"]}

    changed = chain_prompt()
    changed["2"]["inputs"]["value"] = 4
    third = engine.run(changed)
    assert third.executed == ["2", "3", "4", "5"]  # a chain: this order is forced
    assert third.output("4") == 12.0
    assert {"1", "6", "7"} <= set(third.cached)

    fourth = engine.run(changed, outputs=["5"])  # narrowing targets keeps everything cached
    assert fourth.executed == []
    assert engine.run(changed).executed == []  # ... including the branch that was not a target


def test_cache_survives_only_for_nodes_in_the_current_prompt() -> None:
    engine = Engine(REGISTRY)
    engine.run(chain_prompt())
    small = {"6": node("Number", value=7), "7": node("Show", value=["6", 0])}
    assert engine.run(small).executed == []
    assert sorted(engine.run(chain_prompt()).executed) == ["1", "2", "3", "4", "5"]


def test_is_changed_controls_reruns() -> None:
    engine = Engine(REGISTRY)
    prompt = {"1": node("Volatile", value=3), "2": node("Show", value=["1", 0])}
    assert engine.run(prompt).executed == ["1", "2"]
    assert engine.run(prompt).executed == []
    assert fakes.Volatile.is_changed_calls == 2  # called on every run, even when cached
    fakes.Volatile.token = "v2"
    assert engine.run(prompt).executed == ["1", "2"]
    fakes.Volatile.token = float("nan")  # NaN: always changed
    assert engine.run(prompt).executed == ["1", "2"]
    assert engine.run(prompt).executed == ["1", "2"]


def test_is_changed_that_raises_means_always_rerun(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(fakes.Volatile):
        @classmethod
        def IS_CHANGED(cls, value: int) -> Any:
            raise OSError("file vanished")

    registry = {**REGISTRY, "Broken": Broken}
    engine = Engine(registry)
    prompt = {"1": node("Broken", value=3), "2": node("Show", value=["1", 0])}
    with caplog.at_level(logging.WARNING):
        assert engine.run(prompt).executed == ["1", "2"]
        assert engine.run(prompt).executed == ["1", "2"]
    assert "file vanished" in caplog.text


def test_equal_signatures_share_one_result_unless_unique_id_is_declared() -> None:
    engine = Engine(REGISTRY)
    prompt = {"1": node("Number", value=5), "2": node("Number", value=5),
              "3": node("Add", a=["1", 0], b=["2", 0]), "4": node("Show", value=["3", 0])}
    result = engine.run(prompt)
    assert len([n for n in result.executed if n in ("1", "2")]) == 1  # as in ComfyUI
    assert result.output("3") == 10
    with_id = {"1": node("WithId", value=5), "2": node("WithId", value=5),
               "3": node("Show", value=["1", 0]), "4": node("Show", value=["2", 0])}
    result = engine.run(with_id)
    assert {"1", "2"} <= set(result.executed)
    assert (result.output("1"), result.output("2")) == ("1:5", "2:5")


# -- lazy inputs ----------------------------------------------------------------------------------------


def lazy_prompt(cond: bool) -> dict[str, Any]:
    return {
        "1": node("Number", value=1),
        "2": node("Number", value=2),
        "3": node("Fail", value=["2", 0], boom=True),  # would raise if it ever ran
        "4": node("Switch", cond=cond, on_true=["1", 0], on_false=["3", 0]),
        "5": node("Show", value=["4", 0]),
    }


def test_lazy_branch_that_is_not_needed_never_runs() -> None:
    engine = Engine(REGISTRY)
    result = engine.run(lazy_prompt(True))
    assert result.output("4") == 1
    assert "3" not in result.executed and "2" not in result.executed
    assert [c for c, _ in fakes.CALLS].count("Fail") == 0
    # First call: nothing evaluated yet; second: the requested branch is there, the other is None.
    assert fakes.Switch.lazy_calls == [(None, None), (1, None)]


def test_lazy_branch_runs_when_requested_and_the_other_stays_cached() -> None:
    engine = Engine(REGISTRY)
    engine.run(lazy_prompt(True))
    prompt = lazy_prompt(False)
    prompt["3"]["inputs"]["boom"] = False
    result = engine.run(prompt)
    assert result.executed == ["2", "3", "4", "5"]
    assert result.output("4") == 2


# -- order independence -----------------------------------------------------------------------------------


def wide_prompt() -> dict[str, Any]:
    prompt: dict[str, Any] = {}
    for i in range(1, 7):
        prompt[f"n{i}"] = node("Number", value=i)
    prompt["a1"] = node("Add", a=["n1", 0], b=["n2", 0])
    prompt["a2"] = node("Add", a=["n3", 0], b=["n4", 0], bias=1)
    prompt["a3"] = node("Add", a=["a1", 0], b=["a2", 0])
    prompt["a4"] = node("Add", a=["a3", 0], b=["n5", 0])
    prompt["s1"] = node("Scale", x=["a4", 0], factor=1.5)
    prompt["s2"] = node("Scale", x=["n6", 0], factor=3.0)
    prompt["o1"] = node("Show", value=["s1", 0])
    prompt["o2"] = node("Show", value=["s2", 0])
    prompt["o3"] = node("Show", value=["a2", 0])
    return prompt


def test_shuffled_orders_respect_dependencies_and_give_identical_results() -> None:
    prompt = wide_prompt()
    reference = Engine(REGISTRY).run(prompt)
    orders = set()
    for seed in range(40):
        result = Engine(REGISTRY).run(prompt, seed_order=seed)
        assert result.outputs == reference.outputs and result.ui == reference.ui
        assert sorted(result.executed) == sorted(prompt)
        position = {nid: i for i, nid in enumerate(result.executed)}
        for nid, spec in prompt.items():
            for value in spec["inputs"].values():
                if isinstance(value, list):
                    assert position[value[0]] < position[nid], (seed, result.executed)
        assert [nid for _, nid in fakes.CALLS[-len(prompt):]] == result.executed
        orders.add(tuple(result.executed))
    assert len(orders) > 10  # the seed really changes the order


# -- errors and interrupts --------------------------------------------------------------------------------


def failing_prompt(boom: bool) -> dict[str, Any]:
    return {
        "1": node("Number", value=4),
        "2": node("Scale", x=["1", 0], factor=2.0),
        "3": node("Fail", value=["1", 0], boom=boom),
        "4": node("Add", a=["3", 0], b=["1", 0]),
        "5": node("Show", value=["4", 0]),
        "6": node("Show", value=["2", 0]),
    }


def test_node_error_is_wrapped_and_a_rerun_resumes_from_cache() -> None:
    engine = Engine(REGISTRY)
    with pytest.raises(NodeExecutionError) as err:
        engine.run(failing_prompt(True), seed_order=3)
    assert (err.value.node_id, err.value.class_type) == ("3", "Fail")
    assert isinstance(err.value.__cause__, ValueError)
    assert "node 3 (Fail)" in str(err.value) and "boom requested" in str(err.value)
    finished = err.value.executed
    assert "1" in finished and "3" not in finished

    result = engine.run(failing_prompt(False))
    assert "1" in result.cached and "1" not in result.executed
    assert set(result.executed) == {"3", "4", "5"} | ({"2", "6"} - set(finished))
    assert result.output("4") == 8


def test_wrong_number_of_outputs_is_a_node_error() -> None:
    with pytest.raises(NodeExecutionError, match=r"node 1 \(Flaky\).*1 values.*2 output"):
        Engine(REGISTRY).run({"1": node("Flaky"), "2": node("Show", value=["1", 1])})


def interrupt_prompt() -> dict[str, Any]:
    return {
        "1": node("Number", value=1),
        "2": node("Stopper", value=["1", 0]),
        "3": node("Scale", x=["2", 0], factor=2.0),
        "4": node("Show", value=["3", 0]),
    }


def test_node_raising_interrupted_stops_the_run_and_a_rerun_completes() -> None:
    engine = Engine(REGISTRY)
    fakes.Stopper.stop = True
    with pytest.raises(RunInterrupted) as err:
        engine.run(interrupt_prompt())
    assert err.value.node_id == "2" and err.value.executed == ["1"]
    assert isinstance(err.value.__cause__, Interrupted)
    fakes.Stopper.stop = False
    result = engine.run(interrupt_prompt())
    assert result.executed == ["2", "3", "4"]
    assert result.cached == ["1"]


def test_comfyui_interrupt_exception_is_treated_as_an_interrupt() -> None:
    prompt = {"1": node("Number", value=1), "2": node("ComfyStop", value=["1", 0]), "3": node("Show", value=["2", 0])}
    with pytest.raises(RunInterrupted, match="node 2"):
        Engine(REGISTRY).run(prompt)


def test_interrupt_check_between_nodes() -> None:
    engine = Engine(REGISTRY)
    polls: list[str | None] = []

    def stop_at_third() -> bool:
        polls.append(current_node_id())
        return len(polls) >= 3

    with pytest.raises(RunInterrupted) as err:
        engine.run(interrupt_prompt(), interrupt_check=stop_at_third)
    assert err.value.executed == ["1", "2"] and err.value.node_id == "3"
    assert ran() == ["1", "2"]
    result = engine.run(interrupt_prompt(), interrupt_check=lambda: False)
    assert result.executed == ["3", "4"]


def test_progress_reports_carry_the_node_id_and_are_interrupt_points() -> None:
    prompt = {"1": node("Number", value=1), "2": node("Progressing", value=["1", 0]), "3": node("Show", value=["2", 0])}
    seen: list[tuple[str, float, float | None]] = []
    Engine(REGISTRY).run(prompt, progress=lambda nid, value, total: seen.append((nid, value, total)))
    assert seen == [("2", 1, 3), ("2", 2, 3), ("2", 3, 3)]

    def stop_after_first_report() -> bool:
        return len(seen) >= 4

    with pytest.raises(RunInterrupted, match="node 2"):
        Engine(REGISTRY).run(prompt, progress=lambda nid, value, total: seen.append((nid, value, total)),
                             interrupt_check=stop_after_first_report)
    assert len(seen) == 4
    assert current_node_id() is None


# -- overrides ------------------------------------------------------------------------------------------------


def test_parse_override() -> None:
    assert parse_override("3.seed=42") == ("3", "seed", 42, "42")
    assert parse_override("My v1.2 loader.text=hello world") == ("My v1.2 loader", "text", "hello world", "hello world")
    assert parse_override('5.text={"a": 1}')[2] == {"a": 1}
    for bad in ("3seed=1", "3.seed", ".seed=1", "3.=1"):
        with pytest.raises(WorkflowError, match="NODE.INPUT=VALUE"):
            parse_override(bad)


def test_overrides_resolve_nodes_and_shape_values() -> None:
    prompt = ApiPrompt(nodes={
        "1": {**node("Number", value=1), "_meta": {"title": "Width"}},
        "2": node("Number", value=2),
        "3": node("Text", text="x"),
        "4": node("Scale", x=["1", 0], factor=1.0),
    })
    new = apply_overrides(prompt, ["Width.value=8", "3.text=123", "Scale.factor=2", "2.value=3.0"], REGISTRY)
    assert new.nodes["1"]["inputs"]["value"] == 8
    assert new.nodes["3"]["inputs"]["text"] == "123"  # STRING keeps the raw text
    assert new.nodes["4"]["inputs"]["factor"] == 2.0 and isinstance(new.nodes["4"]["inputs"]["factor"], float)
    assert new.nodes["2"]["inputs"]["value"] == 3 and isinstance(new.nodes["2"]["inputs"]["value"], int)
    assert prompt.nodes["1"]["inputs"]["value"] == 1  # the original is untouched
    with pytest.raises(WorkflowError, match="ambiguous.*1, 2"):
        apply_overrides(prompt, ["Number.value=1"], REGISTRY)
    with pytest.raises(WorkflowError, match="no node 'Height'"):
        apply_overrides(prompt, ["Height.value=1"], REGISTRY)
    with pytest.raises(WorkflowError, match=r"node 4 \(Scale\) has no input 'factr'.*x, factor"):
        apply_overrides(prompt, ["4.factr=1"], REGISTRY)


def test_run_workflow_file_with_a_shared_engine_reruns_only_what_changed(tmp_path: Path) -> None:
    path = write(tmp_path, chain_prompt())
    engine = Engine(REGISTRY)
    first = run_workflow_file(path, REGISTRY, engine=engine)
    assert len(first.executed) == 7
    second = run_workflow_file(path, REGISTRY, overrides=["4.factor=3"], engine=engine)
    assert second.executed == ["4", "5"] and second.output("4") == 15.0
    with pytest.raises(WorkflowValidationError, match=r"node 4 \(Scale\) input 'factor'"):
        run_workflow_file(path, REGISTRY, overrides=["4.factor=11"], engine=engine)


def test_non_finite_float_is_rejected() -> None:
    prompt = {"1": node("Number", value=1), "2": node("Scale", x=["1", 0], factor=math.nan),
              "3": node("Show", value=["2", 0])}
    with pytest.raises(WorkflowValidationError, match=r"node 2 \(Scale\) input 'factor': expected a finite number"):
        Engine(REGISTRY).run(prompt)


def test_node_inputs_may_share_names_with_engine_parameters() -> None:
    class Echo:
        RETURN_TYPES = ("STRING",)
        FUNCTION = "run"
        OUTPUT_NODE = True

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"what": ("STRING", {"default": ""}), "fn": ("STRING", {"default": ""}),
                                 "node_id": ("STRING", {"default": ""})}}

        def run(self, what, fn, node_id):
            return {"ui": {"text": [what + fn + node_id]}, "result": (what,)}

    result = Engine({"Echo": Echo}).run({"1": {"class_type": "Echo", "inputs": {"what": "a", "fn": "b", "node_id": "c"}}})
    assert result.ui["1"] == {"text": ["abc"]}
