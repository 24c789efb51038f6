"""Workflows saved by earlier versions of the pack still load, with every saved value on its own widget,
and the Loaders' `ffn_chunk` widget (the token-chunked FFN/MoE) is wired node -> handle and checked early.

`tests/old_workflows/` holds UI files as the pack shipped them before widgets were added (the T2V workflow
of 2026-11-30, whose Loader had 6 widgets and Denoise 7, and the T2V / files workflows just before
`ffn_chunk`), each with the API twin shipped beside it then. The editor assigns a UI file's
`widgets_values` by position and leaves the widgets past the saved ones at their defaults; our converter
does the same. A widget inserted before existing ones shifts every later value onto the wrong widget:
these files then convert to other values than their twins, and the tests below fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lingbot_core.handle import check_ffn_chunk, ffn_chunk_setting
from lingbot_core.placement.estimate import AUTO_CHUNK, FFN_CHUNK_CHOICES, FFN_CHUNKS, NO_CHUNK
from lingbot_core.workflow import Engine, WorkflowValidationError, load_workflow, ui_to_api
from lingbot_core.workflow.nodeinfo import NodeClassInfo
from lingbot_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

OLD = Path(__file__).resolve().parent / "old_workflows"
OLD_UI = sorted(p for p in OLD.glob("*.json") if not p.name.endswith(".api.json"))
API = Path(__file__).resolve().parents[1] / "workflows" / "api"
LOADERS = ("LingBotLoader", "LingBotLoaderFiles")


def _widgets(class_type: str) -> list:
    return [s for s in NodeClassInfo(class_type, NODE_CLASS_MAPPINGS[class_type]).visible_inputs() if s.is_widget]


def test_the_old_files_are_older_than_the_node_classes():
    """Each old file lacks at least the ffn_chunk value on its Loader (else it tests nothing)."""
    assert len(OLD_UI) >= 3
    for path in OLD_UI:
        ui = json.loads(path.read_text())
        loader = next(n for n in ui["nodes"] if n["type"] in LOADERS)
        assert len(loader["widgets_values"]) < len(_widgets(loader["type"])), path.name


@pytest.mark.parametrize("path", OLD_UI, ids=lambda p: p.stem)
def test_an_old_ui_file_keeps_every_saved_value_and_defaults_the_new_widgets(path):
    ui = json.loads(path.read_text())
    then = json.loads(path.with_suffix(".api.json").read_text())
    now = ui_to_api(ui, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS)
    assert set(now) == set(then)
    for nid, node in then.items():
        inputs = now[nid]["inputs"]
        for name, value in node["inputs"].items():
            assert inputs[name] == value, (path.name, node["class_type"], name)  # no shifted value
        declared = {s.name: s for s in _widgets(node["class_type"])}
        for name in set(inputs) - set(node["inputs"]):  # widgets added since: their declared defaults
            assert inputs[name] == declared[name].options["default"], (path.name, name)
    loader = next(n for n in now.values() if n["class_type"] in LOADERS)
    assert loader["inputs"]["ffn_chunk"] == AUTO_CHUNK


@pytest.mark.parametrize("path", OLD_UI, ids=lambda p: p.stem)
def test_an_old_ui_file_validates_as_a_whole(path):
    prompt = load_workflow(path, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS)
    assert Engine(NODE_CLASS_MAPPINGS).validate(prompt)


# the widgets each Loader gained after the files in old_workflows/ were saved, in the order they came
ADDED = {"LingBotLoader": ["ffn_chunk", "fp8_matmul"], "LingBotLoaderFiles": ["ffn_chunk", "compile", "fp8_matmul"]}


@pytest.mark.parametrize("class_type", LOADERS)
def test_widgets_added_since_are_each_loaders_last_and_ffn_chunk_defaults_to_auto(class_type):
    """Appended, never inserted: the positional values of files saved before them stay where they were."""
    widgets = _widgets(class_type)
    added = widgets[-len(ADDED[class_type]):]
    assert [w.name for w in added] == ADDED[class_type] and all(w.category == "optional" for w in added)
    chunk = next(w for w in added if w.name == "ffn_chunk")
    assert chunk.combo_options == list(FFN_CHUNK_CHOICES) and chunk.options["default"] == AUTO_CHUNK


def test_the_choices_are_auto_off_and_bounded_token_counts():
    sizes = [int(c) for c in FFN_CHUNK_CHOICES if c not in (AUTO_CHUNK, NO_CHUNK)]
    assert FFN_CHUNK_CHOICES[:2] == (AUTO_CHUNK, NO_CHUNK)
    assert set(FFN_CHUNKS) <= set(sizes)  # every chunk auto may pick can also be asked for
    assert sizes == sorted(sizes, reverse=True) and 256 <= min(sizes) and max(sizes) <= 65536


def test_each_choice_maps_to_the_handles_setting():
    assert ffn_chunk_setting("auto") == "auto"
    assert ffn_chunk_setting("off") is None
    for choice in FFN_CHUNK_CHOICES[2:]:
        assert ffn_chunk_setting(choice) == int(choice)
        assert check_ffn_chunk(ffn_chunk_setting(choice)) == int(choice)


@pytest.mark.parametrize("bad", ["300", "0", "-256", "4096 ", "whole", 4096, None, True, 2.5, "x" * 5000])
def test_other_values_are_refused_with_the_choices(bad):
    with pytest.raises(ValueError) as err:
        ffn_chunk_setting(bad)
    message = str(err.value)
    assert message.startswith("ffn_chunk must be one of auto, off, 65536") and len(message) < 200


def _refused_by_validation(class_type: str, name: str, value: object) -> None:
    """The shipped T2V workflow of that Loader with one input set to `value`: validation refuses exactly it."""
    workflow = "lingbot_t2v_dense" if class_type == "LingBotLoader" else "lingbot_t2v_dense_files"
    prompt = load_workflow(API / f"{workflow}.json", NODE_CLASS_MAPPINGS).to_dict()
    loader = next(nid for nid, n in prompt.items() if n["class_type"] == class_type)
    prompt[loader]["inputs"][name] = value
    with pytest.raises(WorkflowValidationError) as err:
        Engine(NODE_CLASS_MAPPINGS).validate(prompt)
    assert [(i.node_id, i.input_name) for i in err.value.issues] == [(loader, name)]


@pytest.mark.parametrize("class_type", LOADERS)
def test_a_bad_value_is_refused_by_validation_before_anything_runs(class_type):
    _refused_by_validation(class_type, "ffn_chunk", "300")


@pytest.mark.parametrize("class_type", LOADERS)
def test_the_loader_refuses_a_bad_value_before_opening_anything(class_type):
    """Called directly (no validation in front): the chunk is refused before the checkpoint is looked up,
    so the message is about the chunk even for a checkpoint that does not exist."""
    loader = NODE_CLASS_MAPPINGS[class_type]
    args = (("no-such-checkpoint", "auto", "auto", "default") if class_type == "LingBotLoader"
            else ("(from checkpoint)", "(from checkpoint)", "(from checkpoint)", "no-such-checkpoint"))
    with pytest.raises(ValueError, match="ffn_chunk must be one of"):
        loader.execute(*args, ffn_chunk="123")


@pytest.mark.parametrize("choice, expected", [("auto", "auto"), ("off", None), ("512", 512)])
@pytest.mark.parametrize("class_type", LOADERS)
def test_the_loaders_pass_the_choice_to_the_handle(class_type, choice, expected):
    loader = NODE_CLASS_MAPPINGS[class_type]
    if class_type == "LingBotLoader":
        out = loader.execute("tiny (built-in dense)", "auto", "auto", "default", device="cpu", ffn_chunk=choice)
    else:
        out = loader.execute("(from checkpoint)", "(from checkpoint)", "(from checkpoint)", "tiny (built-in dense)",
                             device="cpu", ffn_chunk=choice)
    handle = out.result[0] if hasattr(out, "result") else out[0]
    assert handle.shared.ffn_chunk == expected
    assert not handle.shared.loaded  # nothing heavy loaded by the Loader


@pytest.mark.parametrize("class_type", LOADERS)
def test_both_loaders_offer_compile_and_pass_it_to_the_handle(class_type):
    """The Loader (files) gained `compile` (appended after ffn_chunk): same choices as the Loader, wired
    through to the handle; a value outside the choices is refused by validation."""
    from lingbot_core.models.compile import COMPILE_CHOICES

    widget = next(w for w in _widgets(class_type) if w.name == "compile")
    assert widget.combo_options == list(COMPILE_CHOICES) and widget.options["default"] == "off"
    loader = NODE_CLASS_MAPPINGS[class_type]
    args = (("tiny (built-in dense)", "auto", "auto", "default") if class_type == "LingBotLoader"
            else ("(from checkpoint)", "(from checkpoint)", "(from checkpoint)", "tiny (built-in dense)"))
    for choice in COMPILE_CHOICES:
        out = loader.execute(*args, device="cpu", compile=choice)
        handle = out.result[0] if hasattr(out, "result") else out[0]
        assert handle.shared.compile == choice and not handle.shared.loaded
    _refused_by_validation(class_type, "compile", "everything")


@pytest.mark.parametrize("class_type", LOADERS)
def test_both_loaders_offer_fp8_matmul_and_set_it_on_the_fp8_layers(class_type):
    """`fp8_matmul` (appended last): the choices of weights.fp8.FP8_MATMULS, default decode; the choice
    reaches every fp8 layer of the DiT when it loads; scaled_mm is refused by the Loader on a device
    without fp8 tensor cores (this CPU) before anything loads; other values by validation."""
    from lingbot_core.weights.fp8 import FP8_MATMULS
    from lingbot_core.weights.modules import QuantizedLinear

    widget = next(w for w in _widgets(class_type) if w.name == "fp8_matmul")
    assert widget.combo_options == list(FP8_MATMULS) and widget.options["default"] == "decode"
    loader = NODE_CLASS_MAPPINGS[class_type]
    args = (("tiny (built-in dense)", "auto", "auto", "default") if class_type == "LingBotLoader"
            else ("(from checkpoint)", "(from checkpoint)", "(from checkpoint)", "tiny (built-in dense)"))
    out = loader.execute(*args, device="cpu", weights="fp8_e4m3", fp8_matmul="auto")
    handle = out.result[0] if hasattr(out, "result") else out[0]
    assert handle.shared.fp8_matmul == "auto" and not handle.shared.loaded
    layers = [m for m in handle.component("transformer").modules() if isinstance(m, QuantizedLinear)]
    assert layers and {m.fp8_matmul for m in layers} == {"auto"}
    with pytest.raises(ValueError, match="fp8_matmul scaled_mm cannot run here: fp8 matmuls need a CUDA device"):
        loader.execute(*args, device="cpu", weights="fp8_e4m3", fp8_matmul="scaled_mm")
    _refused_by_validation(class_type, "fp8_matmul", "fast")
