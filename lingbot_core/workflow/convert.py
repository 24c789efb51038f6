"""UI ("workflow") format -> API ("prompt") format, following the frontend's ``graphToPrompt``.

The rules, in the frontend's terms:
- virtual nodes (Note, MarkdownNote, Reroute, PrimitiveNode) and muted (mode 2) or bypassed
  (mode 4) nodes are not emitted;
- ``widgets_values`` is positional over the class's widget inputs (required, then optional); a
  ``control_after_generate`` value after a seed and an upload-button value after the last required widget
  are saved there but never sent (:func:`saved_widget_slots`, which ``workflows/build.py`` writes the
  shipped editor files from). Whether a file has those extra entries is decided by counting;
- a link wins over the widget value of the same input (a "converted widget");
- links are resolved through Reroutes and through bypassed nodes (first input of a matching
  type); a PrimitiveNode's value is written into the widget it feeds;
- inputs that point at nodes which were not emitted (muted, for example) are dropped;
- list constants are wrapped as ``{"__value__": [...]}`` so they are not read as links.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ValidationIssue, WorkflowError, WorkflowValidationError, brief
from .nodeinfo import InputSpec, NodeClassInfo, is_link
from .values import check_nesting, id_text, json_path

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


CONTROL = "control_after_generate"  # the seed control's value, saved right after its seed
UPLOAD = "upload"  # an upload button's value, saved after the node's last required widget
FORCED = "forceInput"  # a slot older frontends kept for a forceInput input
UPLOAD_VALUE = "image"  # what the frontend saves for an image or video upload button (an audio one: "")


@dataclass(frozen=True)
class WidgetSlot:
    """One position of a node's saved ``widgets_values``: a widget's value, or a value the editor
    saves but never sends (``ui_only`` names which: :data:`CONTROL`, :data:`UPLOAD`, :data:`FORCED`)."""

    spec: InputSpec | None
    ui_only: str | None = None


def saved_widget_slots(inputs: Iterable[InputSpec], *, legacy: bool = False) -> list[WidgetSlot]:
    """The layout of ``widgets_values`` the frontend saves for a node with these inputs (required, then
    optional, as :meth:`NodeClassInfo.visible_inputs` gives them): each widget's value in order, a seed's
    control value right after it, and the upload buttons' values after the last required widget (the
    frontend adds the button as the last required input). ``legacy`` also keeps a slot for each
    forceInput input, as saves of older frontends do.

    The one statement of this rule: the converter reads editor files with it and ``workflows/build.py``
    writes the shipped ones with it."""
    slots: list[WidgetSlot] = []
    uploads = 0
    for spec in [*inputs, None]:
        if uploads and (spec is None or spec.category != "required"):
            slots += [WidgetSlot(None, UPLOAD)] * uploads
            uploads = 0
        if spec is None:
            break
        if spec.options.get("forceInput"):
            if legacy:
                slots.append(WidgetSlot(None, FORCED))
            continue
        if not spec.is_widget:
            continue
        slots.append(WidgetSlot(spec))
        if spec.has_control_widget:
            slots.append(WidgetSlot(None, CONTROL))
        uploads += int(spec.has_upload_widget)
    return slots


_PLAIN_TYPES = {"INT": (int,), "FLOAT": (int, float), "STRING": (str,), "BOOLEAN": (bool,)}


def _fits(layout: list[WidgetSlot], values: list[Any]) -> bool:
    """Whether each value could be its slot's widget value (combo choice, number, text, flag); UI-only
    slots take anything. Only used to tell two layouts of the same length apart."""
    for slot, value in zip(layout, values):
        spec = slot.spec
        if spec is None:
            continue
        choices = spec.combo_options
        if choices is not None:
            if value not in choices:
                return False
            continue
        kinds = _PLAIN_TYPES.get(str(spec.type))
        if kinds is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            return False
    return True


def ui_to_api(
    ui: Mapping[str, Any],
    registry: Mapping[str, type],
    *,
    display_names: Mapping[str, str] | None = None,
    source: str = "<workflow>",
) -> dict[str, dict[str, Any]]:
    """Convert an editor save to the API dict the frontend would queue.

    Nodes come out in the saved execution ``order`` (then id), so the result is deterministic.
    Problems (unknown classes, dangling links, unsupported subgraphs, malformed entries) are
    collected and raised together as :class:`WorkflowValidationError`; a file whose top-level
    shape is wrong raises :class:`WorkflowError` naming the JSON path.
    """
    if not isinstance(ui, Mapping):
        raise WorkflowError(f"{source}: a UI workflow must be a JSON object, got {type(ui).__name__}")
    check_nesting(ui, source)
    return _Converter(ui, registry, display_names or {}, source).convert()


@dataclass(frozen=True)
class _UIInput:
    """One entry of a UI node's ``inputs`` list, checked."""

    name: str
    type: Any
    link: str | None  # the link id as a key, or None when unconnected
    widget: bool  # a converted widget (``widget: {name}``)


@dataclass(frozen=True)
class _UINode:
    """A UI node with every field the converter reads checked and in a known shape."""

    id: str
    type: str | None
    mode: Any
    order: Any
    title: str | None
    inputs: list[_UIInput | None]  # None: an entry that is not an object (kept for slot positions)
    output_types: list[Any]
    widgets: Any  # a list, a dict (saved by name) or None


class _Converter:
    def __init__(self, ui: Mapping[str, Any], registry: Mapping[str, type], display_names: Mapping[str, str], source: str) -> None:
        self.ui = ui
        self.registry = registry
        self.display_names = display_names
        self.source = source
        self.issues: list[ValidationIssue] = []
        self.nodes = self._index_nodes()
        self.links = self._index_links()
        self.subgraph_ids = self._subgraph_ids()
        self.infos: dict[str, NodeClassInfo] = {}

    # -- indexing: every field read later is checked here --------------------------------------------

    def _fail(self, path: tuple[Any, ...], message: str) -> WorkflowError:
        return WorkflowError(f"{self.source}: {json_path(path)} {message}")

    def _index_nodes(self) -> dict[str, _UINode]:
        nodes: dict[str, _UINode] = {}
        raw = self.ui.get("nodes")
        if not isinstance(raw, list):
            raise self._fail(("nodes",), "must be a list")
        for position, node in enumerate(raw):
            where = ("nodes", position)
            if not isinstance(node, Mapping) or "id" not in node:
                raise self._fail(where, "is not a node object with an 'id'")
            node_id = id_text(node["id"])
            if node_id is None:
                raise self._fail(where + ("id",), f"must be an integer or a short string, got {brief(node['id'], 40)}")
            if node_id in nodes:
                raise self._fail(where + ("id",), f"repeats node id {node_id}")
            nodes[node_id] = self._read_node(node_id, node, where)
        return nodes

    def _read_node(self, node_id: str, node: Mapping[str, Any], where: tuple[Any, ...]) -> _UINode:
        class_type = node.get("type")
        raw_inputs = node.get("inputs")
        if raw_inputs is None:
            raw_inputs = []
        if not isinstance(raw_inputs, list):
            raise self._fail(where + ("inputs",), f"must be a list (node {node_id})")
        inputs: list[_UIInput | None] = []
        for index, entry in enumerate(raw_inputs):
            if not isinstance(entry, Mapping):
                inputs.append(None)
                continue
            name = entry.get("name", "")
            if not isinstance(name, str):
                raise self._fail(where + ("inputs", index, "name"), f"must be a string (node {node_id})")
            link = entry.get("link")
            link_key = None if link is None else id_text(link)
            if link is not None and link_key is None:
                raise self._fail(where + ("inputs", index, "link"),
                                 f"must be a link id or null, got {brief(link, 40)} (node {node_id})")
            inputs.append(_UIInput(name, entry.get("type"), link_key, entry.get("widget") is not None))
        raw_outputs = node.get("outputs")
        if raw_outputs is None:
            raw_outputs = []
        if not isinstance(raw_outputs, list):
            raise self._fail(where + ("outputs",), f"must be a list (node {node_id})")
        output_types = [o.get("type") if isinstance(o, Mapping) else None for o in raw_outputs]
        widgets = node.get("widgets_values")
        if widgets is not None and not isinstance(widgets, (list, Mapping)):
            raise self._fail(where + ("widgets_values",), f"must be a list or an object (node {node_id})")
        title = node.get("title")
        return _UINode(node_id, class_type if isinstance(class_type, str) else None, node.get("mode", 0),
                       node.get("order"), title if isinstance(title, str) and title else None,
                       inputs, output_types, widgets)

    def _index_links(self) -> dict[str, _Link]:
        links: dict[str, _Link] = {}
        raw_links = self.ui.get("links")
        if raw_links is None:
            raw_links = []
        if not isinstance(raw_links, list):
            raise self._fail(("links",), "must be a list")
        for position, raw in enumerate(raw_links):
            if isinstance(raw, Mapping):  # schema 1 saves links as objects
                fields = [raw.get(k) for k in ("id", "origin_id", "origin_slot", "target_id", "target_slot")]
                kind = raw.get("type")
            elif isinstance(raw, list) and len(raw) >= 5:
                fields = list(raw[:5])
                kind = raw[5] if len(raw) > 5 else None
            else:
                raise self._fail(("links", position), f"is malformed: {brief(raw)}")
            link_id, origin, target = id_text(fields[0]), id_text(fields[1]), id_text(fields[3])
            slots = [_slot(fields[2]), _slot(fields[4])]
            if link_id is None or origin is None or target is None or None in slots:
                raise self._fail(("links", position), "is malformed (expected [id, origin_id, origin_slot, "
                                 f"target_id, target_slot, type] with integer slots): {brief(raw)}")
            links[link_id] = _Link(origin, slots[0], target, slots[1], kind)
        return links

    def _subgraph_ids(self) -> set[str]:
        definitions = self.ui.get("definitions")
        subgraphs = definitions.get("subgraphs") if isinstance(definitions, Mapping) else None
        if not isinstance(subgraphs, list):
            return set()
        ids = (id_text(sg.get("id")) for sg in subgraphs if isinstance(sg, Mapping))
        return {i for i in ids if i is not None}

    # -- conversion ---------------------------------------------------------------------------------

    def convert(self) -> dict[str, dict[str, Any]]:
        output: dict[str, dict[str, Any]] = {}
        for node_id, node in sorted(self.nodes.items(), key=lambda kv: _order_key(kv[0], kv[1].order)):
            class_type = node.type
            if class_type is None:
                self.issues.append(ValidationIssue(node_id, None, None, "UI node has no 'type'"))
                continue
            if class_type in VIRTUAL_TYPES or _mode_is(node.mode, MODE_MUTED, MODE_BYPASS):
                continue
            info = self._info(node_id, class_type)
            if info is None:
                continue
            try:
                inputs = self._widget_inputs(node_id, node, info)
                self._link_inputs(node_id, node, info, inputs)
            except _Abort:
                continue
            title = node.title or self.display_names.get(class_type) or class_type
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
            self._issue(node_id, class_type, None, f"unknown node type {brief(class_type)}")
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

    def _widget_inputs(self, node_id: str, node: _UINode, info: NodeClassInfo) -> dict[str, Any]:
        widgets = [s for s in info.visible_inputs() if s.is_widget]
        values = node.widgets
        inputs: dict[str, Any] = {}
        if isinstance(values, Mapping):  # some packs save widgets by name
            for spec in widgets:
                value = values[spec.name] if spec.name in values else _default(spec)
                if value is not _MISSING:
                    inputs[spec.name] = _coerce(spec, value)
            return inputs
        values = list(values or [])
        layout = self._choose_layout(node_id, info, len(values), values)
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

    def _choose_layout(self, node_id: str, info: NodeClassInfo, count: int,
                       values: list[Any] | None = None) -> list[WidgetSlot]:
        full = saved_widget_slots(info.visible_inputs())
        bare = [slot for slot in full if slot.spec is not None]  # saved without the UI-only values
        legacy = saved_widget_slots(info.visible_inputs(), legacy=True)  # saves that kept a slot for forceInput inputs
        if count < len(full) and count == len(bare) and values is not None \
                and not _fits(bare, values) and _fits(full, values):
            return full  # an older save with its seed control values, as many as the widgets are now
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

    def _link_inputs(self, node_id: str, node: _UINode, info: NodeClassInfo, inputs: dict[str, Any]) -> None:
        for index, ui_input in enumerate(node.inputs):
            if ui_input is None or ui_input.link is None:
                continue
            resolved = self._resolve(node_id, index)
            if resolved is None:
                continue  # nothing real upstream: the widget value (if any) stays
            name = ui_input.name
            if isinstance(resolved, _Value):
                spec = info.declared(name)
                if ui_input.widget or (spec is not None and spec.is_widget):
                    if resolved.value is not _MISSING:
                        inputs[name] = _coerce(spec, resolved.value) if spec else _wrap(resolved.value)
                continue
            inputs[name] = [resolved.node_id, resolved.slot]

    def _link(self, node_id: str, index: int) -> _Link | None:
        node = self.nodes[node_id]
        if index >= len(node.inputs) or node.inputs[index] is None:
            return None
        ui_input = node.inputs[index]
        if ui_input.link is None:
            return None
        link = self.links.get(ui_input.link)
        if link is None:
            self._issue(node_id, node.type, ui_input.name,
                        f"uses link {ui_input.link}, which is not in the workflow's links list (dangling link)")
            raise _Abort
        if link.origin_id not in self.nodes:
            self._issue(node_id, node.type, ui_input.name,
                        f"link {ui_input.link} comes from node {link.origin_id}, which does not exist (dangling link)")
            raise _Abort
        return link

    def _resolve(self, node_id: str, index: int) -> _Output | _Value | None:
        """Follow input ``index`` of a node upstream through Reroutes and bypassed nodes.

        A loop, not recursion: a chain of thousands of Reroutes is legal JSON and must not
        exhaust Python's stack.
        """
        visited: set[tuple[str, str, int]] = set()
        want_type: Any = None
        while True:
            if (node_id, "in", index) in visited:
                raise WorkflowError(f"{self.source}: links loop through node {node_id} (reroute/bypass cycle)")
            visited.add((node_id, "in", index))
            link = self._link(node_id, index)
            if link is None:
                return None
            if want_type is None:
                want_type = self.nodes[node_id].inputs[index].type
            node_id, slot = link.origin_id, link.origin_slot
            if (node_id, "out", slot) in visited:
                raise WorkflowError(f"{self.source}: links loop through node {node_id} (reroute/bypass cycle)")
            visited.add((node_id, "out", slot))
            node = self.nodes[node_id]
            if _mode_is(node.mode, MODE_BYPASS):
                index = _bypass_input_index(node, slot, want_type)
                if index < 0:
                    return None
                want_type = None  # from here on, the bypassed node's input type is what is wanted
                continue
            if node.type == "PrimitiveNode":
                values = node.widgets
                return _Value(values[0] if isinstance(values, list) and values else _MISSING)
            if node.type in NOTE_TYPES:
                return None
            if node.type in VIRTUAL_TYPES:  # a Reroute passes its one input through
                if slot < len(node.inputs):
                    index = slot
                    continue
                return None
            return _Output(node_id, slot)


class _Abort(Exception):
    """Internal: this node has a reported issue; skip the rest of it."""


_MISSING = object()


def _order_key(node_id: str, order: Any) -> tuple[float, float, str]:
    try:
        order_f = float(order) if isinstance(order, (int, float)) and not isinstance(order, bool) else math.inf
    except OverflowError:
        order_f = math.inf
    if math.isnan(order_f):
        order_f = math.inf
    try:
        numeric = float(node_id)
    except (ValueError, OverflowError):
        numeric = math.inf
    if math.isnan(numeric):
        numeric = math.inf
    return order_f, numeric, node_id


def _slot(value: Any) -> int | None:
    """A slot index from a link entry: a small non-negative integer (JSON may write it as 1.0)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 16:
        return value
    return None


def _mode_is(mode: Any, *wanted: int) -> bool:
    return isinstance(mode, int) and not isinstance(mode, bool) and mode in wanted


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
    if not isinstance(a, str) or not isinstance(b, str):
        return False
    a, b = a.lower(), b.lower()
    if "," not in a and "," not in b:
        return a == b
    return any(x == y for x in a.split(",") for y in b.split(","))


def _bypass_input_index(node: _UINode, slot: int, want_type: Any) -> int:
    """Which input a bypassed node passes through to output ``slot`` (the frontend's rule).

    The index is into the node's whole ``inputs`` list (entries that are not objects keep their
    positions but are never chosen).
    """
    inputs = [(i, entry) for i, entry in enumerate(node.inputs) if entry is not None]
    output_type = node.output_types[slot] if slot < len(node.output_types) else None
    if not isinstance(want_type, str) or want_type in ("*", ""):
        if not inputs:
            return -1
        return slot if slot < len(node.inputs) and node.inputs[slot] is not None else inputs[0][0]
    if slot < len(node.inputs) and node.inputs[slot] is not None:
        same = node.inputs[slot].type
        if _valid_connection(same, output_type) and _valid_connection(same, want_type):
            return slot
    for index, ui_input in inputs:
        if ui_input.type == want_type:
            return index
    for index, ui_input in inputs:
        if _valid_connection(ui_input.type, output_type) and _valid_connection(ui_input.type, want_type):
            return index
    return -1
