"""Loading workflow files (UI or API format) and checking the graph's structure.

Structure means what can be judged without running anything: every node's class exists, every
link points at an existing node and output, and the output's type fits the input. Value checks
(ranges, combos, ``VALIDATE_INPUTS``) belong to the engine, which knows which nodes will run.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .convert import ui_to_api
from .errors import ValidationIssue, WorkflowError, WorkflowValidationError, brief, clip
from .nodeinfo import NodeClassInfo, class_problem, is_link, link_types_compatible
from .values import MAX_ID_CHARS, MAX_NESTING, check_nesting, id_text, json_path  # noqa: F401 (re-exported)

Registry = Mapping[str, type]

MAX_FILE_BYTES = 256 * 1024 * 1024


@dataclass
class ApiPrompt:
    """A workflow in API ("prompt") format, plus where it came from.

    ``nodes`` is ``{node_id: {"class_type", "inputs", "_meta"?}}`` with links as
    ``[source_id, output_index]``; node ids are strings.
    """

    nodes: dict[str, dict[str, Any]]
    source: str = "<dict>"
    format: str = "api"  # "api" or "ui": what the file was before conversion
    ui: dict[str, Any] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """A deep copy of the API dict, safe to edit or to ``json.dump``."""
        return copy.deepcopy(self.nodes)

    def title(self, node_id: str) -> str:
        """The node's title (``_meta.title``), falling back to its class type."""
        node = self.nodes[node_id]
        return str((node.get("_meta") or {}).get("title") or node.get("class_type"))


def load_workflow(
    source: str | os.PathLike[str] | Mapping[str, Any],
    registry: Registry,
    *,
    display_names: Mapping[str, str] | None = None,
) -> ApiPrompt:
    """Read a UI or API workflow (a path or an already parsed dict) and check its structure.

    UI files are converted with :func:`ui_to_api`, which needs the registry to know each class's
    widgets; that is why the registry is required even for API files, which it checks.
    """
    if isinstance(source, (str, os.PathLike)):
        origin = str(source)
        data: Any = read_json(Path(source))
    else:
        data = source
        origin = "<dict>"
    with reading_guard(origin):
        check_nesting(data, origin)
        kind = detect_format(data, origin)
        ui: dict[str, Any] | None = None
        if kind == "ui":
            ui = copy.deepcopy(dict(data))
            api = ui_to_api(data, registry, display_names=display_names, source=origin)
        else:
            if "prompt" in data and isinstance(data["prompt"], Mapping) and "class_type" not in data["prompt"]:
                data = data["prompt"]  # a saved POST /prompt body
            api = normalize_api(data, origin)
        issues = check_structure(api, registry)
    if issues:
        raise WorkflowValidationError(issues, source=origin)
    return ApiPrompt(nodes=api, source=origin, format=kind, ui=ui)


@contextmanager
def reading_guard(origin: str) -> Iterator[None]:
    """The safety net around reading a workflow: anything but our own error becomes one.

    The readers check shapes explicitly; this only makes sure that a case they missed still
    reaches the user (and the CLI's exit code 2) as a :class:`WorkflowError` naming the file.
    The fuzz tests fail if it ever fires.
    """
    try:
        yield
    except WorkflowError:
        raise
    except RecursionError:
        raise WorkflowError(f"{clip(origin, 500)}: the workflow is nested too deeply to read") from None
    except Exception as exc:
        err = WorkflowError(f"{clip(origin, 500)}: malformed workflow ({type(exc).__name__}: {clip(str(exc), 300)})")
        err.internal = True
        raise err from exc


def read_json(path: Path) -> Any:
    """Parse a JSON file; every failure (encoding, syntax, size, nesting) names the file (its name
    clipped: a path string can be any length, and an OS error quotes it again)."""
    name = clip(str(path), 300)
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise WorkflowError(f"{name}: the file is over {MAX_FILE_BYTES >> 20} MiB; not a workflow")
        raw = path.read_bytes()
    except FileNotFoundError:
        raise WorkflowError(f"{name}: workflow file not found") from None
    except IsADirectoryError:
        raise WorkflowError(f"{name}: is a folder, not a workflow file") from None
    except OSError as exc:
        raise WorkflowError(f"{name}: cannot read workflow file: {exc.strerror or type(exc).__name__}") from exc
    try:
        text = raw.decode("utf-8-sig")  # a BOM, as some Windows editors write, is accepted
    except UnicodeDecodeError as exc:
        raise WorkflowError(f"{name}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                            "save the workflow as UTF-8 JSON") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        # str(exc) is the decoder's whole sentence ("Unterminated string starting at: line 1 column 9
        # (char 8)"); exc.msg alone can end mid-phrase.
        raise WorkflowError(f"{name}: not valid JSON: {exc}") from None
    except RecursionError:
        raise WorkflowError(f"{name}: the JSON nests too deeply to read (a workflow uses a few levels)") from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise WorkflowError(f"{name}: cannot read a value in the JSON: {clip(str(exc), 200)}") from None


def detect_format(data: Any, origin: str = "<dict>") -> str:
    """``"ui"`` for an editor save (``nodes``/``links`` lists), ``"api"`` for a prompt dict."""
    if not isinstance(data, Mapping):
        raise WorkflowError(f"{origin}: a workflow must be a JSON object, got {type(data).__name__}")
    if isinstance(data.get("nodes"), list):
        return "ui"
    if isinstance(data.get("prompt"), Mapping) and "class_type" not in data["prompt"]:
        return "api"
    if data and any(isinstance(v, Mapping) and "class_type" in v for v in data.values()):
        return "api"
    if not data:
        raise WorkflowError(f"{origin}: the workflow is empty")
    raise WorkflowError(
        f"{origin}: neither a UI workflow (no 'nodes' list) nor an API prompt (no node has a 'class_type')"
    )


def normalize_api(data: Mapping[str, Any], origin: str = "<dict>") -> dict[str, dict[str, Any]]:
    """Copy an API dict with string node ids and string link sources; reject malformed nodes."""
    check_nesting(data, origin)
    issues: list[ValidationIssue] = []
    out: dict[str, dict[str, Any]] = {}
    for raw_id, node in data.items():
        node_id = id_text(raw_id)
        if node_id is None:
            issues.append(ValidationIssue(brief(raw_id, 40), None, None, "node id must be a string or an integer"))
            continue
        if not isinstance(node, Mapping):
            issues.append(ValidationIssue(node_id, None, None, f"node must be an object, got {type(node).__name__}"))
            continue
        class_type = node.get("class_type")
        if not isinstance(class_type, str):
            issues.append(ValidationIssue(node_id, None, None, "node has no 'class_type'"))
            continue
        inputs = node.get("inputs", {})
        if not isinstance(inputs, Mapping):
            issues.append(ValidationIssue(node_id, clip(class_type, 100), None, "'inputs' must be an object"))
            continue
        new_node = copy.deepcopy(dict(node))
        new_inputs: dict[str, Any] = {}
        for name, value in inputs.items():
            if not isinstance(name, str):
                issues.append(ValidationIssue(node_id, clip(class_type, 100), brief(name, 40),
                                              "input names must be strings"))
                continue
            value = copy.deepcopy(value)
            if is_link(value):
                source = id_text(value[0])
                if source is None:
                    issues.append(ValidationIssue(node_id, clip(class_type, 100), name,
                                                  f"links to node id {brief(value[0], 40)}, which is not a valid id"))
                    continue
                value = [source, value[1]]
            new_inputs[name] = value
        new_node["inputs"] = new_inputs
        out[node_id] = new_node
    if issues:
        raise WorkflowValidationError(issues, source=origin)
    return out


def class_infos(prompt: Mapping[str, Mapping[str, Any]], registry: Registry) -> tuple[dict[str, NodeClassInfo], list[ValidationIssue]]:
    """Read the declarations of every class used by the prompt, once each."""
    infos: dict[str, NodeClassInfo] = {}
    issues: list[ValidationIssue] = []
    broken: set[str] = set()
    for node_id, node in prompt.items():
        class_type = node.get("class_type")
        if not isinstance(class_type, str):
            issues.append(ValidationIssue(node_id, None, None, "node has no 'class_type'"))
            continue
        if class_type in infos or class_type in broken:
            continue
        cls = registry.get(class_type)
        if cls is None:
            continue  # reported per node by check_structure
        problem = class_problem(cls)
        if problem is None:
            try:
                infos[class_type] = NodeClassInfo(class_type, cls)
            except Exception as exc:  # a broken INPUT_TYPES must not crash loading
                problem = f"cannot read its declarations: {type(exc).__name__}: {exc}"
        if problem is not None:
            broken.add(class_type)
            issues.append(ValidationIssue(node_id, class_type, None, f"class {problem}"))
    return infos, issues


def check_structure(
    prompt: Mapping[str, Mapping[str, Any]],
    registry: Registry,
    infos: Mapping[str, NodeClassInfo] | None = None,
) -> list[ValidationIssue]:
    """Every problem with node classes and links, for all nodes (reachable or not).

    ``infos`` lets a caller that already read the classes (the engine) avoid a second
    ``INPUT_TYPES()`` call per class.
    """
    if infos is None:
        infos, issues = class_infos(prompt, registry)
    else:
        issues = []
    for node_id, node in prompt.items():
        class_type = node.get("class_type")
        if not isinstance(class_type, str):
            continue
        if class_type not in registry:
            issues.append(ValidationIssue(node_id, class_type, None, f"unknown node type '{class_type}'"))
            continue
        info = infos.get(class_type)
        if info is None:
            continue
        params = info.validate_inputs_params()
        skip_types = params is not None and "input_types" in params[0]
        for name, value in node.get("inputs", {}).items():
            if not isinstance(value, list):
                continue
            if not is_link(value):
                issues.append(ValidationIssue(
                    node_id, class_type, name,
                    f"bad link {brief(value)}: must be [source_node_id, output_index] "
                    "(wrap list constants as {\"__value__\": [...]})",
                ))
                continue
            src_id, index = str(value[0]), value[1]
            src = prompt.get(src_id)
            if src is None:
                issues.append(ValidationIssue(node_id, class_type, name, f"links to node {src_id}, which does not exist"))
                continue
            src_info = infos.get(str(src.get("class_type")))
            if src_info is None:
                continue  # the source's own problem is reported on its own line
            outputs = src_info.return_types
            if not 0 <= index < len(outputs):
                issues.append(ValidationIssue(
                    node_id, class_type, name,
                    f"links to output {brief(index)} of node {src_id} ({src_info.class_type}), "
                    f"which has {len(outputs)} output{'s' if len(outputs) != 1 else ''}",
                ))
                continue
            spec = info.declared(name)
            if spec is None or skip_types:
                continue
            received = outputs[index]
            if not link_types_compatible(received, spec.type):
                issues.append(ValidationIssue(
                    node_id, class_type, name,
                    f"type mismatch: node {src_id} ({src_info.class_type}) output {index} is "
                    f"{_type_label(received)}, but the input expects {_type_label(spec.type)}",
                ))
    return issues


def _type_label(t: Any) -> str:
    return "COMBO" if isinstance(t, (list, tuple)) else str(t)
