"""Checking widget values against ``INPUT_TYPES`` and the node's own ``VALIDATE_INPUTS``.

Runs before anything executes, so a typo in the last node of a long video workflow is reported
in a second rather than after minutes of sampling. Values are normalised on the way (an INT
written as ``5.0``, a FLOAT written as ``1``), as ComfyUI does, so the cache sees one spelling.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .errors import ValidationIssue, brief, clip
from .grid import GridMin
from .nodeinfo import WIDGET_TYPES, InputSpec, NodeClassInfo, is_link, unwrap_constant


def validate_node(
    node_id: str,
    node: dict[str, Any],
    info: NodeClassInfo,
    prompt: Mapping[str, Mapping[str, Any]],
    received_types: Mapping[str, Any],
) -> list[ValidationIssue]:
    """Check one node's inputs; converted constants are written back into ``node["inputs"]``.

    At most one issue per input, attached to that input; then the node's own ``VALIDATE_INPUTS``.
    """
    issues: list[ValidationIssue] = []
    class_type = info.class_type
    inputs: dict[str, Any] = node["inputs"]

    def issue(name: str | None, message: str) -> None:
        issues.append(ValidationIssue(node_id, class_type, name, message))

    for flag, value in (("INPUT_IS_LIST", info.input_is_list), ("OUTPUT_IS_LIST", any(info.output_is_list))):
        if value:
            issue(None, f"{flag} is not supported by the headless engine")

    for name, value in inputs.items():
        problem = _undeclared_problem(info, name, value)
        if problem is not None:
            issue(name, problem)

    validator = info.validate_inputs_params()
    own_params, takes_kwargs = validator if validator is not None else (set(), False)

    for spec in info.visible_inputs():
        if spec.name not in inputs:
            if spec.category == "required":
                issue(spec.name, "required input is missing")
            continue
        value = inputs[spec.name]
        if is_link(value):
            continue
        if not _takes_constants(spec):
            issue(spec.name, f"must be connected to a node output of type {_type_label(spec)}; "
                  f"a constant ({brief(unwrap_constant(value), 60)}) cannot stand in for it")
            continue
        value = unwrap_constant(value)
        converted, problem = _convert(spec, value)
        if problem is not None:
            issue(spec.name, problem)
            continue
        inputs[spec.name] = converted
        if spec.name in own_params or takes_kwargs:
            continue  # the node validates this one itself (ComfyUI skips its own range/combo checks)
        problem = _check_range_and_combo(spec, converted)
        if problem is not None:
            issue(spec.name, problem)

    # The node's own check sees only inputs that passed ours (else one bad value reads as two errors).
    flagged = {i.input_name for i in issues}
    if validator is not None and (own_params or takes_kwargs) and not (flagged & own_params or takes_kwargs and issues):
        issues.extend(_run_validate_inputs(node_id, node, info, prompt, received_types, own_params, takes_kwargs))
    return issues


def _undeclared_problem(info: NodeClassInfo, name: str, value: Any) -> str | None:
    """Inputs the class does not declare (or that only the host fills in) are refused, not ignored."""
    spec = info.declared(name)
    if spec is None:
        declared = ", ".join(s.name for s in info.visible_inputs()) or "none"
        what = "a link" if is_link(value) else "a value"
        return f"the node has no input of this name, but the workflow gives it {what} (inputs: {declared})"
    if spec.category == "hidden":
        return f"is a hidden input ({spec.type}) that the host fills in; the workflow must not set it"
    return None


def _takes_constants(spec: InputSpec) -> bool:
    """Whether a constant may be given for the input: widget types (also with forceInput), COMBOs."""
    return spec.combo_options is not None or spec.type in WIDGET_TYPES


def _type_label(spec: InputSpec) -> str:
    text = spec.type_name()
    return "any type" if text.strip() == "*" else text


def _convert(spec: InputSpec, value: Any) -> tuple[Any, str | None]:
    """Bring a constant to the declared widget type, or say why it cannot be."""
    t = spec.type
    if value is None and spec.combo_options is not None:  # a null would reach a node validator as "linked"
        return value, "expected one of the options, got null"
    if t == "INT":
        if isinstance(value, bool):
            return value, f"expected an integer, got {brief(value)}"
        if isinstance(value, int):
            return value, None
        if isinstance(value, float) and value.is_integer():
            return int(value), None
        if isinstance(value, str):
            try:
                return int(value.strip()), None
            except ValueError:
                pass
        return value, f"expected an integer, got {brief(value)}"
    if t == "FLOAT":
        if isinstance(value, bool):
            return value, f"expected a number, got {brief(value)}"
        number: float | None = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                pass
        if number is None:
            return value, f"expected a number, got {brief(value)}"
        if not math.isfinite(number):
            return value, f"expected a finite number, got {brief(value)}"
        return number, None
    if t == "BOOLEAN":
        if isinstance(value, bool):
            return value, None
        return value, f"expected true or false, got {brief(value)}"
    if t == "STRING":
        if isinstance(value, str):
            return value, None
        return value, f"expected a string, got {type(value).__name__} {brief(value)}"
    return value, None


def _check_range_and_combo(spec: InputSpec, value: Any) -> str | None:
    options = spec.options
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = options.get("min"), options.get("max")
        if isinstance(low, GridMin):
            if isinstance(value, int) and (problem := low.problem(value)) is not None:
                return problem  # the same rule ComfyUI applies through its `value < min`
        elif isinstance(low, (int, float)) and value < low:
            return f"value {brief(value)} is smaller than the minimum {low}"
        if isinstance(high, (int, float)) and value > high:
            return f"value {brief(value)} is bigger than the maximum {high}"
        # A plain `step` is not checked (ComfyUI's backend does not either); a grid is a GridMin.
    choices = spec.combo_options
    if choices is not None and value not in choices:
        shown = brief(choices, 400) if len(choices) <= 20 else f"a list of {len(choices)} options"
        return f"value {brief(value)} is not one of {shown}"
    return None


def _run_validate_inputs(
    node_id: str,
    node: Mapping[str, Any],
    info: NodeClassInfo,
    prompt: Mapping[str, Mapping[str, Any]],
    received_types: Mapping[str, Any],
    params: set[str],
    takes_kwargs: bool,
) -> list[ValidationIssue]:
    """Call ``VALIDATE_INPUTS`` the way ComfyUI does: only the parameters it names, links as None."""
    kwargs: dict[str, Any] = {}
    for name, value in node["inputs"].items():
        spec = info.declared(name)
        if is_link(value):
            if name in params or takes_kwargs:
                kwargs[name] = None  # not computed yet at validation time
        elif spec is not None and (name in params or takes_kwargs):
            kwargs[name] = unwrap_constant(value)
    for name, kind in info.hidden_values.items():
        if not info.v3 and (name in params or takes_kwargs):  # V3 nodes read them from cls.hidden
            kwargs[name] = hidden_value(kind, node_id, prompt)
    if "input_types" in params:
        kwargs["input_types"] = dict(received_types)
    try:
        result = info.run_validator(kwargs, {kind: hidden_value(kind, node_id, prompt)
                                             for kind in info.hidden_values.values()})
    except Exception as exc:
        return [ValidationIssue(node_id, info.class_type, None,
                                f"its input check failed ({type(exc).__name__}: {clip(str(exc), 300)})")]
    if result is True:
        return []
    per_input = getattr(result, "per_input", None)  # one message per wrong input (see InputProblems)
    if isinstance(per_input, Mapping) and per_input:
        return [ValidationIssue(node_id, info.class_type, str(name), _unnamed(str(name), clip(str(message), 500)))
                for name, message in per_input.items()]
    detail = "the node refused these inputs" if result is False else clip(str(result), 500)
    names = sorted(k for k in kwargs if k != "input_types")
    input_name = names[0] if len(names) == 1 else None
    return [ValidationIssue(node_id, info.class_type, input_name,
                            _unnamed(input_name, detail) if input_name else detail)]


def _unnamed(input_name: str, message: str) -> str:
    """The message without the input's name in front: the issue already names the input once
    ("input 'prompt': is not valid JSON ...", not "input 'prompt': prompt is not valid JSON ...")."""
    for lead in (f"{input_name} ", f"'{input_name}' ", f"{input_name}: "):
        if message.startswith(lead) and len(message) > len(lead):
            return message[len(lead):]
    return message


def hidden_value(kind: str, node_id: str, prompt: Mapping[str, Any],
                 extra_pnginfo: Mapping[str, Any] | None = None) -> Any:
    """What ComfyUI passes for a hidden input; values a headless run does not have are None."""
    if kind == "UNIQUE_ID":
        return node_id
    if kind == "PROMPT":
        return prompt
    if kind == "EXTRA_PNGINFO":
        return extra_pnginfo
    return None

