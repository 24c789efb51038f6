"""Bad input gets a clear error before any node runs: workflow values, links and messages.

Each test reproduces one class found by the adversarial probe (issue 12, items 6 and 9).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import workflow_fakes as fakes

from lingbot_core.workflow import Engine, WorkflowValidationError, load_workflow
from lingbot_core.workflow.cache import SignatureBuilder
from lingbot_nodes import NODE_CLASS_MAPPINGS

API = Path(__file__).resolve().parents[1] / "workflows" / "api"
T2V = json.loads((API / "lingbot_t2v_dense.json").read_text())


def _node_of(prompt: dict, class_type: str) -> str:
    return next(nid for nid, n in prompt.items() if n["class_type"] == class_type)


def _invalid(prompt: dict) -> WorkflowValidationError:
    outputs = [nid for nid, n in prompt.items() if n["class_type"] in ("LingBotSaveVideo", "LingBotRelease",
                                                                        "LingBotMemoryReport")]
    with pytest.raises(WorkflowValidationError) as info:
        Engine(NODE_CLASS_MAPPINGS).validate(copy.deepcopy(prompt), outputs=outputs)
    return info.value


def test_constant_for_a_link_only_input_is_refused():
    prompt = copy.deepcopy(T2V)
    denoise = _node_of(prompt, "LingBotDenoise")
    prompt[denoise]["inputs"]["pipe"] = "../../somewhere"
    err = _invalid(prompt)
    assert any(i.node_id == denoise and i.input_name == "pipe" and "must be connected" in i.message
               for i in err.issues), str(err)


def test_constant_for_an_any_type_input_is_refused():
    prompt = copy.deepcopy(T2V)
    prompt["90"] = {"class_type": "LingBotRelease", "inputs": {"pipe": ["2", 0], "value": 5, "what": "all"}}
    err = _invalid(prompt)
    assert any(i.node_id == "90" and i.input_name == "value" for i in err.issues), str(err)


@pytest.mark.parametrize("value", [["1", 0], 7])
def test_undeclared_inputs_are_refused(value):
    prompt = copy.deepcopy(T2V)
    denoise = _node_of(prompt, "LingBotDenoise")
    prompt[denoise]["inputs"]["stepz"] = value
    err = _invalid(prompt)
    assert any(i.input_name == "stepz" and "no input of this name" in i.message for i in err.issues), str(err)


def test_hidden_inputs_cannot_be_set_by_the_workflow():
    prompt = copy.deepcopy(T2V)
    save = _node_of(prompt, "LingBotSaveVideo")
    prompt[save]["inputs"]["prompt"] = {"forged": True}
    err = _invalid(prompt)
    assert any(i.input_name == "prompt" and "hidden" in i.message for i in err.issues), str(err)


@pytest.mark.parametrize("class_type", ["LingBotRelease", "LingBotMemoryReport"])
def test_release_and_memory_report_keep_the_engines_checks(class_type):
    prompt = copy.deepcopy(T2V)
    inputs = {"pipe": ["2", 0], "value": ["4", 0]}
    if class_type == "LingBotRelease":
        inputs["what"] = "everything please"  # not one of the combo's options
    else:
        inputs["pipe"] = ["4", 0]  # a LATENT into a LINGBOT_PIPE input
    prompt["90"] = {"class_type": class_type, "inputs": inputs}
    err = _invalid(prompt)
    assert any(i.node_id == "90" for i in err.issues), str(err)


def test_wrong_link_type_into_release_value_is_fine_but_pipe_is_checked():
    prompt = copy.deepcopy(T2V)
    prompt["90"] = {"class_type": "LingBotRelease", "inputs": {"pipe": ["2", 0], "value": ["4", 0], "what": "all"}}
    Engine(NODE_CLASS_MAPPINGS).validate(copy.deepcopy(prompt), outputs=["90"])  # any type into `value`
    prompt["90"]["inputs"]["pipe"] = ["4", 0]
    err = _invalid(prompt)
    assert any(i.input_name == "pipe" and "type mismatch" in i.message for i in err.issues), str(err)


def test_messages_do_not_echo_huge_values():
    prompt = copy.deepcopy(T2V)
    denoise = _node_of(prompt, "LingBotDenoise")
    prompt[denoise]["inputs"]["seed"] = "9" * 200_000 + "x"
    prompt[denoise]["inputs"]["stepz"] = "y" * 200_000
    prompt["x" * 100_000] = {"class_type": "z" * 100_000, "inputs": {}}
    err = _invalid(prompt)
    assert len(str(err)) < 5_000
    assert "more characters" in str(err) or "..." in str(err)


def test_an_integer_too_long_to_print_is_reported_not_raised():
    prompt = copy.deepcopy(T2V)
    denoise = _node_of(prompt, "LingBotDenoise")
    prompt[denoise]["inputs"]["steps"] = 10 ** 5000
    err = _invalid(prompt)
    assert any(i.input_name == "steps" and "digits" in i.message for i in err.issues), str(err)


def test_many_issues_are_counted_but_listed_briefly():
    prompt = copy.deepcopy(T2V)
    denoise = _node_of(prompt, "LingBotDenoise")
    for i in range(500):
        prompt[denoise]["inputs"][f"extra{i}"] = i
    err = _invalid(prompt)
    assert len(err.issues) >= 500 and "more" in str(err) and len(str(err)) < 20_000


def test_signatures_are_linear_in_chain_length(monkeypatch):
    """A 2,000-node chain: each node's sources are read a bounded number of times (it was quadratic)."""
    n = 2000
    prompt = {"0": {"class_type": "Number", "inputs": {"value": 1}}}
    for i in range(1, n):
        prompt[str(i)] = {"class_type": "Add", "inputs": {"a": [str(i - 1), 0], "b": [str(i - 1), 0]}}
    prompt[str(n)] = {"class_type": "Show", "inputs": {"value": [str(n - 1), 0]}}
    calls = 0
    original = SignatureBuilder._linked_sources

    def counting(self, node_id):
        nonlocal calls
        calls += 1
        return original(self, node_id)

    monkeypatch.setattr(SignatureBuilder, "_linked_sources", counting)
    engine = Engine(fakes.REGISTRY)
    keys = engine._signatures(engine._plan(prompt, None))
    assert len(set(keys.values())) == n + 1  # every node distinct
    assert calls <= 2 * (n + 1), calls


def test_equal_subgraphs_share_a_signature_and_differences_propagate():
    def chain(value: int) -> dict:
        return {"0": {"class_type": "Number", "inputs": {"value": value}},
                "1": {"class_type": "Add", "inputs": {"a": ["0", 0], "b": ["0", 0]}},
                "2": {"class_type": "Show", "inputs": {"value": ["1", 0]}}}

    engine = Engine(fakes.REGISTRY)
    a = engine._signatures(engine._plan(chain(1), None))
    b = engine._signatures(engine._plan(chain(1), None))
    c = engine._signatures(engine._plan(chain(2), None))
    assert a == b
    assert all(a[k] != c[k] for k in a)


def test_a_workflow_file_with_bad_link_shapes_names_the_json_path(tmp_path):
    ui = json.loads((API.parent / "lingbot_t2v_dense.json").read_text())
    ui["links"][0] = [1, 2]  # too short
    path = tmp_path / "w.json"
    path.write_text(json.dumps(ui))
    with pytest.raises(Exception) as info:
        load_workflow(path, NODE_CLASS_MAPPINGS)
    assert "links[0]" in str(info.value) and str(path) in str(info.value)
    assert type(info.value).__name__ == "WorkflowError"
