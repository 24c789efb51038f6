"""UI ("workflow") format -> API ("prompt") format, following the frontend's ``graphToPrompt``.

The rules, in the frontend's terms:
- virtual nodes (Note, MarkdownNote, Reroute, PrimitiveNode) and muted (mode 2) or bypassed
  (mode 4) nodes are not emitted;
- ``widgets_values`` is positional over the class's widget inputs (required, then optional); a
  ``control_after_generate`` value after a seed and an upload-button value after an upload combo
  are saved there but never sent. Whether a file has those extra entries is decided by counting;
- a link wins over the widget value of the same input (a "converted widget");
- links are resolved through Reroutes and through bypassed nodes (first input of a matching
  type); a PrimitiveNode's value is written into the widget it feeds;
- inputs that point at nodes which were not emitted (muted, for example) are dropped;
- list constants are wrapped as ``{"__value__": [...]}`` so they are not read as links.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ValidationIssue, WorkflowError, WorkflowValidationError
from .nodeinfo import InputSpec, NodeClassInfo, is_link

MODE_MUTED = 2
MODE_BYPASS = 4
NOTE_TYPES = frozenset({"Note", "MarkdownNote"})
VIRTUAL_TYPES = NOTE_TYPES | {"Reroute", "PrimitiveNode"}


@dataclass(frozen=True)
class _Link:
    origin_id: str
    origin_slot: int
    target_id: str
    target_slot: int
    type: Any


@dataclass(frozen=True)
class _Output:
    """A link resolved to a real node's output."""

    node_id: str
    slot: int


@dataclass(frozen=True)
class _Value:
    """A link resolved to a PrimitiveNode, whose value replaces the target's widget value."""

    value: Any


@dataclass(frozen=True)
class _WidgetSlot:
    spec: InputSpec | None  # None: a UI-only value (seed control, upload button), skipped


def ui_to_api(
    ui: Mapping[str, Any],
    registry: Mapping[str, type],
    *,
    display_names: Mapping[str, str] | None = None,
    source: str = "<workflow>",
) -> dict[str, dict[str, Any]]:
    """Convert an editor save to the API dict the frontend would queue.

    Nodes come out in the saved execution ``order`` (then id), so the result is deterministic.
    Problems (unknown classes, dangling links, unsupported subgraphs) are collected and raised
    together as :class:`WorkflowValidationError`.
    """
    return _Converter(ui, registry, display_names or {}, source).convert()


class _Converter:
    def __init__(self, ui: Mapping[str, Any], registry: Mapping[str, type], display_names: Mapping[str, str], source: str) -> None:
        self.ui = ui
        self.registry = registry
        self.display_names = display_names
        self.source = source
        self.issues: list[ValidationIssue] = []
        self.nodes = self._index_nodes()
        self.links = self._index_links()
        subgraphs = ((ui.get("definitions") or {}).get("subgraphs")) or []
        self.subgraph_ids = {str(sg.get("id")) for sg in subgraphs if isinstance(sg, Mapping)}
        self.infos: dict[str, NodeClassInfo] = {}

    # -- indexing ---------------------------------------------------------------------------------

    def _index_nodes(self) -> dict[str, Mapping[str, Any]]:
        nodes: dict[str, Mapping[str, Any]] = {}
        raw = self.ui.get("nodes")
        if not isinstance(raw, list):
            raise WorkflowError(f"{self.source}: 'nodes' must be a list")
        for position, node in enumerate(raw):
            if not isinstance(node, Mapping) or "id" not in node:
                raise WorkflowError(f"{self.source}: nodes[{position}] is not a node object with an 'id'")
            node_id = str(node["id"])
            if node_id in nodes:
                raise WorkflowError(f"{self.source}: node id {node_id} appears twice")
            nodes[node_id] = node
        return nodes

    def _index_links(self) -> dict[str, _Link]:
        links: dict[str, _Link] = {}
        for position, raw in enumerate(self.ui.get("links") or []):
            try:
                if isinstance(raw, Mapping):  # schema 1 saves links as objects
                    link_id = raw["id"]
                    link = _Link(str(raw["origin_id"]), int(raw["origin_slot"]), str(raw["target_id"]),
                                 int(raw["target_slot"]), raw.get("type"))
                else:
                    link_id, origin, origin_slot, target, target_slot = raw[:5]
                    link = _Link(str(origin), int(origin_slot), str(target), int(target_slot),
                                 raw[5] if len(raw) > 5 else None)
            except (KeyError, TypeError, ValueError, IndexError):
                raise WorkflowError(f"{self.source}: links[{position}] is malformed: {raw!r}") from None
            links[str(link_id)] = link
        return links

    # -- conversion ---------------------------------------------------------------------------------

    def convert(self) -> dict[str, dict[str, Any]]:
        output: dict[str, dict[str, Any]] = {}
        for node_id, node in sorted(self.nodes.items(), key=lambda kv: _order_key(kv[0], kv[1])):
            class_type = node.get("type")
            if not isinstance(class_type, str):
                self.issues.append(ValidationIssue(node_id, None, None, "UI node has no 'type'"))
                continue
            if class_type in VIRTUAL_TYPES or node.get("mode", 0) in (MODE_MUTED, MODE_BYPASS):
                continue
            info = self._info(node_id, class_type)
            if info is None:
                continue
            try:
                inputs = self._widget_inputs(node_id, node, info)
                self._link_inputs(node_id, node, info, inputs)
            except _Abort:
                continue
            title = node.get("title") or self.display_names.get(class_type) or class_type
            output[node_id] = {"inputs": inputs, "class_type": class_type, "_meta": {"title": title}}
        if self.issues:
            raise WorkflowValidationError(self.issues, source=self.source)
        for node in output.values():
            inputs = node["inputs"]
            for name in [k for k, v in inputs.items() if is_link(v) and v[0] not in output]:
                del inputs[name]  # fed by a node that is not emitted (muted, unresolvable)
        return output

    def _info(self, node_id: str, class_type: str) -> NodeClassInfo | None:
        if class_type in self.subgraph_ids:
            self._issue(node_id, class_type, None, "is a subgraph instance; subgraphs are not supported headless "
                        "(unpack the subgraph in ComfyUI or export the API format)")
            return None
        if class_type.startswith("workflow>") or class_type.startswith("workflow/"):
            self._issue(node_id, class_type, None, "is a legacy group node; group nodes are not supported headless "
                        "(convert it back to nodes in ComfyUI or export the API format)")
            return None
        cls = self.registry.get(class_type)
        if cls is None:
            self._issue(node_id, class_type, None, f"unknown node type '{class_type}'")
            return None
        if class_type not in self.infos:
            try:
                self.infos[class_type] = NodeClassInfo(class_type, cls)
            except Exception as exc:
                self._issue(node_id, class_type, None, f"class cannot be read: {type(exc).__name__}: {exc}")
                return None
        return self.infos[class_type]

    def _issue(self, node_id: str, class_type: str | None, input_name: str | None, message: str) -> None:
        self.issues.append(ValidationIssue(node_id, class_type, input_name, message))

    # -- widgets ------------------------------------------------------------------------------------------

    def _widget_inputs(self, node_id: str, node: Mapping[str, Any], info: NodeClassInfo) -> dict[str, Any]:
        widgets = [s for s in info.visible_inputs() if s.is_widget]
        values = node.get("widgets_values")
        inputs: dict[str, Any] = {}
        if isinstance(values, Mapping):  # some packs save widgets by name
            for spec in widgets:
                value = values[spec.name] if spec.name in values else _default(spec)
                if value is not _MISSING:
                    inputs[spec.name] = _coerce(spec, value)
            return inputs
        values = list(values or [])
        layout = self._choose_layout(node_id, info, len(values))
        seen: set[str] = set()
        for slot, value in zip(layout, values):
            if slot.spec is not None:
                inputs[slot.spec.name] = _coerce(slot.spec, value)
                seen.add(slot.spec.name)
        for spec in widgets:  # a file saved before the class grew a widget: the frontend uses defaults
            if spec.name not in seen:
                value = _default(spec)
                if value is not _MISSING:
                    inputs[spec.name] = _coerce(spec, value)
        return inputs

    def _choose_layout(self, node_id: str, info: NodeClassInfo, count: int) -> list[_WidgetSlot]:
        full: list[_WidgetSlot] = []
        bare: list[_WidgetSlot] = []
        legacy: list[_WidgetSlot] = []  # saves that kept a slot for forceInput inputs
        for spec in info.visible_inputs():
            if spec.options.get("forceInput"):
                legacy.append(_WidgetSlot(None))
                continue
            if not spec.is_widget:
                continue
            for layout in (full, bare, legacy):
                layout.append(_WidgetSlot(spec))
            extras = int(spec.has_control_widget) + int(spec.has_upload_widget)
            for _ in range(extras):
                full.append(_WidgetSlot(None))
                legacy.append(_WidgetSlot(None))
        for layout in (full, bare, legacy):
            if count == len(layout):
                return layout
        if count < len(full):
            return full  # positional, as the frontend assigns them; the rest keep defaults
        self._issue(node_id, info.class_type, None,
                    f"has {count} widget values but the class declares {len(bare)} widgets "
                    f"({len(full)} with UI-only values); the file does not match this node class")
        raise _Abort

    # -- links ------------------------------------------------------------------------------------------

    def _link_inputs(self, node_id: str, node: Mapping[str, Any], info: NodeClassInfo, inputs: dict[str, Any]) -> None:
        for index, ui_input in enumerate(node.get("inputs") or []):
            if not isinstance(ui_input, Mapping) or ui_input.get("link") is None:
                continue
            name = str(ui_input.get("name"))
            resolved = self._resolve_input(node_id, index, None, set())
            if resolved is None:
                continue  # nothing real upstream: the widget value (if any) stays
            if isinstance(resolved, _Value):
                spec = info.declared(name)
                if ui_input.get("widget") is not None or (spec is not None and spec.is_widget):
                    if resolved.value is not _MISSING:
                        inputs[name] = _coerce(spec, resolved.value) if spec else _wrap(resolved.value)
                continue
            inputs[name] = [resolved.node_id, resolved.slot]

    def _link(self, node_id: str, index: int) -> _Link | None:
        node = self.nodes[node_id]
        ui_inputs = node.get("inputs") or []
        if index >= len(ui_inputs):
            return None
        ui_input = ui_inputs[index]
        link_id = ui_input.get("link") if isinstance(ui_input, Mapping) else None
        if link_id is None:
            return None
        link = self.links.get(str(link_id))
        if link is None:
            self._issue(node_id, node.get("type"), str(ui_input.get("name")),
                        f"uses link {link_id}, which is not in the workflow's links list (dangling link)")
            raise _Abort
        if link.origin_id not in self.nodes:
            self._issue(node_id, node.get("type"), str(ui_input.get("name")),
                        f"link {link_id} comes from node {link.origin_id}, which does not exist (dangling link)")
            raise _Abort
        return link

    def _resolve_input(self, node_id: str, index: int, want_type: Any, visited: set[tuple[str, str, int]]) -> _Output | _Value | None:
        key = (node_id, "in", index)
        if key in visited:
            raise WorkflowError(f"{self.source}: links loop through node {node_id} (reroute/bypass cycle)")
        visited.add(key)
        link = self._link(node_id, index)
        if link is None:
            return None
        if want_type is None:
            want_type = (self.nodes[node_id].get("inputs") or [])[index].get("type")
        return self._resolve_output(link.origin_id, link.origin_slot, want_type, visited)

    def _resolve_output(self, node_id: str, slot: int, want_type: Any, visited: set[tuple[str, str, int]]) -> _Output | _Value | None:
        key = (node_id, "out", slot)
        if key in visited:
            raise WorkflowError(f"{self.source}: links loop through node {node_id} (reroute/bypass cycle)")
        visited.add(key)
        node = self.nodes[node_id]
        class_type = node.get("type")
        if node.get("mode", 0) == MODE_BYPASS:
            index = _bypass_input_index(node, slot, want_type)
            return None if index < 0 else self._resolve_input(node_id, index, None, visited)
        if class_type == "PrimitiveNode":
            values = node.get("widgets_values")
            return _Value(values[0] if isinstance(values, list) and values else _MISSING)
        if class_type in NOTE_TYPES:
            return None
        if class_type == "Reroute" or class_type in VIRTUAL_TYPES:
            if slot < len(node.get("inputs") or []):
                return self._resolve_input(node_id, slot, want_type, visited)
            return None
        return _Output(node_id, slot)


class _Abort(Exception):
    """Internal: this node has a reported issue; skip the rest of it."""


_MISSING = object()


def _order_key(node_id: str, node: Mapping[str, Any]) -> tuple[float, float, str]:
    order = node.get("order")
    order_f = float(order) if isinstance(order, (int, float)) and not isinstance(order, bool) else math.inf
    try:
        numeric = float(node_id)
    except ValueError:
        numeric = math.inf
    return order_f, numeric, node_id


def _default(spec: InputSpec) -> Any:
    if "default" in spec.options:
        return spec.options["default"]
    options = spec.combo_options
    if options:
        return options[0]
    return _MISSING


def _coerce(spec: InputSpec | None, value: Any) -> Any:
    """Numbers as the input's type says (JSON writes 1.0 as 1); lists wrapped as constants."""
    if spec is not None and not isinstance(value, bool):
        if spec.type == "INT" and isinstance(value, float) and value.is_integer():
            value = int(value)
        elif spec.type == "FLOAT" and isinstance(value, int):
            value = float(value)
    return _wrap(value)


def _wrap(value: Any) -> Any:
    return {"__value__": value} if isinstance(value, list) else value


def _valid_connection(a: Any, b: Any) -> bool:
    """litegraph's connection rule: equal, a wildcard, or overlapping comma-separated unions."""
    a = 0 if a in ("", "*") else a
    b = 0 if b in ("", "*") else b
    if not a or not b or a == b:
        return True
    a, b = str(a).lower(), str(b).lower()
    if "," not in a and "," not in b:
        return a == b
    return any(x == y for x in a.split(",") for y in b.split(","))


def _bypass_input_index(node: Mapping[str, Any], slot: int, want_type: Any) -> int:
    """Which input a bypassed node passes through to output ``slot`` (the frontend's rule)."""
    inputs = [i for i in (node.get("inputs") or []) if isinstance(i, Mapping)]
    outputs = node.get("outputs") or []
    output_type = outputs[slot].get("type") if slot < len(outputs) and isinstance(outputs[slot], Mapping) else None
    if want_type in ("*", "", None):
        return slot if len(inputs) > slot else (0 if inputs else -1)
    if slot < len(inputs):
        same = inputs[slot].get("type")
        if _valid_connection(same, output_type) and _valid_connection(same, want_type):
            return slot
    for index, ui_input in enumerate(inputs):
        if ui_input.get("type") == want_type:
            return index
    for index, ui_input in enumerate(inputs):
        t = ui_input.get("type")
        if _valid_connection(t, output_type) and _valid_connection(t, want_type):
            return index
    return -1
