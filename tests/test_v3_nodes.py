"""The nodes as V3 classes: schemas read by the engine, hidden values, per-input validation, the V1 view."""

from __future__ import annotations

import asyncio

import pytest

from lingbot_core.workflow import Engine, WorkflowValidationError
from lingbot_core.workflow.nodeinfo import NodeClassInfo
from lingbot_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, NODES, comfy_entrypoint
from lingbot_nodes.v3_fallback import ComfyNode, Hidden, NodeOutput, Schema, io, ui


def test_every_node_is_v3_with_a_description_and_tooltips_on_every_input():
    for class_type, cls in NODE_CLASS_MAPPINGS.items():
        info = NodeClassInfo(class_type, cls)
        assert info.v3 and cls.define_schema().node_id == class_type
        assert len(info.description) > 40, class_type
        for spec in info.visible_inputs():
            assert len(spec.options.get("tooltip") or "") > 5, f"{class_type}.{spec.name} has no tooltip"
        assert NODE_DISPLAY_NAME_MAPPINGS[class_type].startswith("LingBot ")
        assert cls.CATEGORY == "LingBot-Video"


def test_extension_lists_the_same_nodes():
    extension = asyncio.run(comfy_entrypoint())
    assert asyncio.run(extension.get_node_list()) == NODES
    assert {c.define_schema().node_id for c in NODES} == set(NODE_CLASS_MAPPINGS)


def test_schema_reading_matches_the_v1_view():
    """nodeinfo's reading of the V3 schema and the V1 INPUT_TYPES view (what ComfyUI's /object_info
    shows) agree on types, categories and options."""
    for class_type, cls in NODE_CLASS_MAPPINGS.items():
        info = NodeClassInfo(class_type, cls)
        v1 = cls.INPUT_TYPES()
        for category in ("required", "optional"):
            for name, (kind, options) in v1.get(category, {}).items():
                spec = info.declared(name)
                assert spec.category == category and spec.type == kind and dict(spec.options) == options
        assert set(info.hidden_values) == set(v1.get("hidden", {}))
        assert list(info.return_types) == list(cls.RETURN_TYPES)
    combo = NodeClassInfo("LingBotLoader", NODE_CLASS_MAPPINGS["LingBotLoader"]).declared("variant")
    assert combo.type_name() == "COMBO" and combo.combo_options == ["auto", "dense", "moe"] and combo.is_widget
    seed = NodeClassInfo("LingBotDenoise", NODE_CLASS_MAPPINGS["LingBotDenoise"]).declared("seed")
    assert seed.has_control_widget


class Source(ComfyNode):
    calls: list = []

    @classmethod
    def define_schema(cls):
        return Schema(node_id="Source", inputs=[io.Int.Input("value", default=1, min=0, max=10, tooltip="v")],
                      outputs=[io.Int.Output(display_name="value")], hidden=[Hidden.unique_id])

    @classmethod
    def fingerprint_inputs(cls, value):
        cls.calls.append(("fingerprint", value, cls.hidden.unique_id))
        return value

    @classmethod
    def execute(cls, value):
        cls.calls.append(("execute", value, cls.hidden.unique_id))
        return NodeOutput(value * 2)


class Sink(ComfyNode):
    seen: list = []

    @classmethod
    def define_schema(cls):
        return Schema(node_id="Sink", is_output_node=True,
                      inputs=[io.Int.Input("value", tooltip="v"),
                              io.Int.Input("lazy_one", optional=True, lazy=True, tooltip="l")],
                      outputs=[io.String.Output(display_name="text")])

    @classmethod
    def check_lazy_status(cls, value, lazy_one=None):
        return ["lazy_one"] if value > 2 and lazy_one is None else []

    @classmethod
    def validate_inputs(cls, value=None):
        return True if value is None or value != 7 else "seven is not allowed"

    @classmethod
    def execute(cls, value, lazy_one=None):
        cls.seen.append((value, lazy_one, cls.hidden.prompt is not None))
        return NodeOutput(f"{value}/{lazy_one}", ui=ui.PreviewText(f"v={value}"))


def test_engine_runs_v3_nodes_with_hidden_values_fingerprints_and_lazy_inputs():
    Source.calls.clear()
    Sink.seen.clear()
    registry = {"Source": Source, "Sink": Sink}
    prompt = {"1": {"class_type": "Source", "inputs": {"value": 2}},
              "2": {"class_type": "Source", "inputs": {"value": 3}},
              "3": {"class_type": "Sink", "inputs": {"value": ["1", 0], "lazy_one": ["2", 0]}}}
    engine = Engine(registry)
    result = engine.run(prompt)
    assert result.output("3") == "4/6" and result.ui["3"] == {"text": ("v=4",)}
    assert Sink.seen == [(4, 6, True)]  # value 4 > 2: the lazy input was requested, and the prompt is hidden
    assert ("execute", 2, "1") in Source.calls and ("fingerprint", 3, "2") in Source.calls
    assert Source.hidden.unique_id is None  # values live on a per-execution clone only
    again = engine.run(prompt)
    assert again.executed == [] and set(again.cached) == {"1", "2", "3"}

    prompt["3"]["inputs"]["value"] = 7
    with pytest.raises(WorkflowValidationError) as err:
        engine.run(prompt)
    assert [(i.node_id, i.input_name) for i in err.value.issues] == [("3", "value")]


def _issues(prompt, node_id):
    with pytest.raises(WorkflowValidationError) as err:
        Engine(NODE_CLASS_MAPPINGS).validate(prompt)
    return sorted((i.input_name, i.message) for i in err.value.issues if i.node_id == node_id)


def _shipped(name: str = "lingbot_t2v_dense") -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(__file__).resolve().parents[1] / "workflows" / "api" / f"{name}.json").read_text())


# Every input whose value must lie on a grid: sizes in steps of 16, frame counts 1 or 4n+1.
GRID_INPUTS = {
    ("LingBotDenoise", "width"), ("LingBotDenoise", "height"), ("LingBotDenoise", "frames"),
    ("LingBotRefine", "width"), ("LingBotRefine", "height"),
    ("LingBotImageEncode", "width"), ("LingBotImageEncode", "height"),
    ("LingBotTextEncode", "image_width"), ("LingBotTextEncode", "image_height"),
    ("LingBotOffload", "plan_width"), ("LingBotOffload", "plan_height"), ("LingBotOffload", "plan_frames"),
    ("LingBotExtendVideo", "frames"),
}


def _comfyui_064_errors(cls, inputs: dict) -> list[tuple[str, str]]:
    """(input name, message) as ComfyUI 0.3.64's validate_inputs reports them for constant widget
    values: its range check (`val < min`, `val > max`) for each input the node's validator does not
    take, then the validator's message attached to every input the validator takes."""
    import inspect

    spec = cls.INPUT_TYPES()
    declared = {**spec.get("required", {}), **spec.get("optional", {})}
    own = cls.__dict__.get("validate_inputs")
    named = [a for a in inspect.getfullargspec(own.__func__).args[1:] if a in inputs] if own else []
    assert own is None or inspect.getfullargspec(own.__func__).varkw is None
    errors = []
    for name, value in inputs.items():
        kind, extra = declared[name]
        if kind != "INT" or name in named:
            continue
        if "min" in extra and value < extra["min"]:
            errors.append((name, "Value {} smaller than min of {}".format(value, extra["min"])))
        elif "max" in extra and value > extra["max"]:
            errors.append((name, "Value {} bigger than max of {}".format(value, extra["max"])))
    if named:
        result = cls.validate_inputs(**{n: inputs[n] for n in named})
        if result is not True:
            errors += [(n, f"{n} - {result}") for n in named]
    return errors


def test_one_message_per_wrong_input_attached_to_that_input():
    """The headless engine: one issue per wrong input, on that input, before anything runs."""
    prompt = _shipped()
    prompt["4"]["inputs"]["width"] = 100
    assert _issues(prompt, "4") == [("width", "value 100 is not a multiple of 16; try 96 or 112")]
    prompt["4"]["inputs"]["width"] = 5008
    assert _issues(prompt, "4") == [("width", "value 5008 is bigger than the maximum 4096")]
    prompt["4"]["inputs"].update(width=100, frames=10, height=40)
    prompt["2"]["inputs"]["plan_frames"] = 120
    assert _issues(prompt, "4") == [
        ("frames", "value 10 is not one of 1, 5, 9, ... (1 plus a multiple of 4); try 9 or 13"),
        ("height", "value 40 is not a multiple of 16; try 32 or 48"),
        ("width", "value 100 is not a multiple of 16; try 96 or 112")]
    assert _issues(prompt, "2") == [("plan_frames", "value 120 is not one of 1, 5, 9, ... (1 plus a multiple of 4); "
                                                     "try 117 or 121")]


def test_every_grid_input_gets_one_message_from_comfyui_itself():
    """The same rule through ComfyUI's own per-input range check (its 0.3.64 logic, replayed on the
    V1 INPUT_TYPES view it reads): one message, on the off-grid input, for every grid input."""
    from lingbot_core.workflow.grid import GridMin

    found = set()
    for class_type, cls in NODE_CLASS_MAPPINGS.items():
        info = NodeClassInfo(class_type, cls)
        params = info.validate_inputs_params()
        # ComfyUI skips its own checks of the inputs a validator names (no **kwargs): never a grid input
        # (the inputs a validator names re-check their own choices: tests/test_sampling_nodes.py)
        grid = {s.name for s in info.visible_inputs() if isinstance(s.options.get("min"), GridMin)}
        assert params is None or (not params[1] and not params[0] & grid), class_type
        for spec in info.visible_inputs():
            low = spec.options.get("min")
            if not isinstance(low, GridMin):
                continue
            found.add((class_type, spec.name))
            assert spec.options["step"] == low.step  # the editor rounds its widget to the same grid
            good = {s.name: s.options["default"] for s in info.visible_inputs()
                    if s.type == "INT" and "default" in s.options}
            assert _comfyui_064_errors(cls, good) == [], class_type
            off = int(low) + low.step + 1
            errors = _comfyui_064_errors(cls, {**good, spec.name: off})
            assert errors == [(spec.name, f"Value {off} smaller than min of {int(low)}, or not {low.grid_text()}")]
    assert found == GRID_INPUTS


def test_every_combo_reaches_comfyui_in_the_form_it_checks():
    """ComfyUI 0.3.64 checks a value against a COMBO's options only when the input type is the
    options list itself (`isinstance(input_type, list)`); a V3 ("COMBO", {"options": ...}) input is
    never checked there, so a wrong LoRA name or sampler got through validation."""
    combos = []
    for class_type, cls in NODE_CLASS_MAPPINGS.items():
        spec = cls.INPUT_TYPES()
        for name, (kind, extra) in {**spec.get("required", {}), **spec.get("optional", {})}.items():
            if "options" in extra:
                combos.append(f"{class_type}.{name}")
                assert isinstance(kind, list) and kind == extra["options"], f"{class_type}.{name}"
                assert NodeClassInfo(class_type, cls).declared(name).type_name() == "COMBO"
    assert "LingBotLoRA.lora_name" in combos and "LingBotDenoise.sampler" in combos and len(combos) >= 15


def test_a_wrong_combo_value_is_one_message_on_that_input():
    prompt = _shipped()
    prompt["4"]["inputs"]["sampler"] = "dpmpp"
    assert _issues(prompt, "4") == [("sampler", "value 'dpmpp' is not one of ['flow_unipc', 'euler', 'dmd_student']")]


def test_a_size_off_the_16_grid_is_refused_before_anything_runs():
    prompt = _shipped()
    prompt["4"]["inputs"]["width"] = 100
    with pytest.raises(WorkflowValidationError) as err:
        Engine(NODE_CLASS_MAPPINGS).run(prompt)
    assert [(i.node_id, i.input_name) for i in err.value.issues] == [("4", "width")]


def test_a_linked_size_off_the_grid_is_refused_when_denoise_starts():
    """A link's value is not known at validation time; Denoise checks it first thing."""
    from workflow_fakes import Number

    from lingbot_core.workflow import NodeExecutionError

    prompt = _shipped()
    prompt["2"]["inputs"]["mode"] = "none"
    prompt["90"] = {"class_type": "Number", "inputs": {"value": 40}}
    prompt["4"]["inputs"]["height"] = ["90", 0]
    with pytest.raises(NodeExecutionError) as err:
        Engine({**NODE_CLASS_MAPPINGS, "Number": Number}).run(prompt)
    assert err.value.node_id == "4" and "multiples of 16" in str(err.value) and "48" in str(err.value)


def test_the_v1_view_runs_a_node_as_a_classic_host_would():
    """A ComfyUI without V3 calls FUNCTION with hidden values as keyword arguments."""
    node = Sink()
    assert Sink.VALIDATE_INPUTS(value=7) == "seven is not allowed"
    assert "hidden" in Sink.INPUT_TYPES() and Sink.OUTPUT_NODE is True and Sink.RETURN_TYPES == ("STRING",)
    Sink.seen.clear()
    out = getattr(node, Sink.FUNCTION)(value=1, prompt={"x": 1}, extra_pnginfo=None)
    assert out == {"ui": {"text": ("v=1",)}, "result": ("1/None",)} and Sink.seen == [(1, None, True)]
    assert Source.IS_CHANGED(value=5) == 5
