"""Reading what a ComfyUI node class declares: inputs, widgets, outputs, link types.

Two kinds of class are read: V3 (``define_schema()`` returning a schema of typed inputs and
outputs, classmethod ``execute``, hidden values on ``cls.hidden``) and classic V1 (``INPUT_TYPES``,
``FUNCTION``, hidden values as keyword arguments). Both end up as the same :class:`NodeClassInfo`,
so the UI converter, the validator and the engine agree on one reading (which inputs are widgets,
which are lazy, what a COMBO is) and one way to call the node. V3 schemas are read by duck typing
(``inputs[i].id``, ``.optional``, ``.get_io_type()``, ``.as_dict()``, ...), which ComfyUI's
``comfy_api`` objects and the pack's own stand-ins both answer; nothing here imports ComfyUI.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
SEED_NAMES = ("seed", "noise_seed")
UPLOAD_OPTIONS = ("image_upload", "video_upload", "audio_upload")


@dataclass(frozen=True)
class InputSpec:
    """One declared input: its name, type (a string or a COMBO list), category and options."""

    name: str
    type: Any
    category: str  # "required", "optional" or "hidden"
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def combo_options(self) -> list[Any] | None:
        """The allowed values if this input is a COMBO (old list form or ``"COMBO"`` + options)."""
        if isinstance(self.type, (list, tuple)):
            return list(self.type)
        if self.type == "COMBO":
            opts = self.options.get("options")
            return list(opts) if isinstance(opts, (list, tuple)) else None
        return None

    @property
    def is_widget(self) -> bool:
        """Whether the frontend draws a widget for it (and so stores a value in ``widgets_values``)."""
        if self.category == "hidden" or self.options.get("forceInput"):
            return False
        return isinstance(self.type, (list, tuple)) or self.type in WIDGET_TYPES

    @property
    def lazy(self) -> bool:
        return bool(self.options.get("lazy"))

    @property
    def has_control_widget(self) -> bool:
        """Whether the frontend adds a ``control_after_generate`` widget right after this one."""
        flag = self.options.get("control_after_generate")
        if self.type == "INT":
            # An explicit option wins; otherwise the legacy naming convention applies.
            return bool(flag) if flag is not None else self.name in SEED_NAMES
        if self.combo_options is not None:
            return bool(flag)
        return False

    @property
    def has_upload_widget(self) -> bool:
        """Whether an upload button widget follows (its value is saved but never sent)."""
        return any(self.options.get(key) for key in UPLOAD_OPTIONS)

    def type_name(self) -> str:
        return "COMBO" if self.combo_options is not None else str(self.type)


# Methods every V3 base class defines; only a subclass's own definition counts as the node's.
_V3_BASES = frozenset({"ComfyNode", "_ComfyNodeBaseInternal", "_ComfyNodeInternal"})


def is_v3(cls: type) -> bool:
    """A V3 node class: a ``define_schema`` classmethod and a classmethod ``execute``."""
    return callable(getattr(cls, "define_schema", None)) and callable(getattr(cls, "execute", None))


def v3_override(cls: type, name: str) -> Callable[..., Any] | None:
    """The class's own ``validate_inputs``/``fingerprint_inputs``/``check_lazy_status``, or None
    when only the base class's placeholder exists (as ComfyUI's ``first_real_override``)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return None if klass.__name__ in _V3_BASES else getattr(cls, name)
    return None


def class_problem(cls: type) -> str | None:
    """Why a registered class cannot be run, or None."""
    if is_v3(cls):
        return None
    if not callable(getattr(cls, "INPUT_TYPES", None)):
        return "is neither a V3 node (define_schema/execute) nor a V1 node (INPUT_TYPES)"
    function = getattr(cls, "FUNCTION", None)
    if not isinstance(function, str) or not callable(getattr(cls, function, None)):
        return f"declares FUNCTION={function!r} but has no such method"
    if not isinstance(getattr(cls, "RETURN_TYPES", ()), (tuple, list)):
        return "has a RETURN_TYPES that is not a tuple"
    return None


class HiddenValues:
    """What a V3 node reads as ``cls.hidden.<name>``; values a run does not have are None."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def __getattr__(self, _name: str) -> Any:
        return None


class NodeClassInfo:
    """The declarations of one node class, read once per use (``INPUT_TYPES`` and schemas may be
    dynamic, e.g. a combo of the files found on disk)."""

    def __init__(self, class_type: str, cls: type) -> None:
        self.class_type = class_type
        self.cls = cls
        self.v3 = is_v3(cls)
        self.inputs: dict[str, InputSpec] = {}
        if self.v3:
            self._read_schema()
            return
        raw = cls.INPUT_TYPES()
        if not isinstance(raw, Mapping):
            raise TypeError(f"INPUT_TYPES() returned {type(raw).__name__}, expected a dict")
        for category in ("required", "optional", "hidden"):
            for name, entry in (raw.get(category) or {}).items():
                if name in self.inputs:
                    continue  # ComfyUI looks up required, then optional, then hidden
                self.inputs[name] = _parse_entry(name, entry, category)
        self.return_types: tuple[Any, ...] = tuple(getattr(cls, "RETURN_TYPES", ()))
        self.return_names: tuple[str, ...] = tuple(getattr(cls, "RETURN_NAMES", None) or self.return_types)
        self._output_node = getattr(cls, "OUTPUT_NODE", False) is True
        self._not_idempotent = bool(getattr(cls, "NOT_IDEMPOTENT", False))
        self.input_is_list = getattr(cls, "INPUT_IS_LIST", False) is True
        self.output_is_list = tuple(getattr(cls, "OUTPUT_IS_LIST", ()) or ())
        self.description = str(getattr(cls, "DESCRIPTION", "") or "")
        self.enable_expand = True

    def _read_schema(self) -> None:
        schema = self.cls.define_schema()
        finalize = getattr(schema, "finalize", None)
        if callable(finalize):
            finalize()  # output nodes gain the hidden prompt/workflow, outputs get ids
        for item in schema.inputs or []:
            name = str(item.id)
            if name in self.inputs:
                raise TypeError(f"input id {name!r} is declared twice")
            options = dict(item.as_dict())
            options.pop("optional", None)
            category = "optional" if getattr(item, "optional", False) else "required"
            self.inputs[name] = InputSpec(name, item.get_io_type(), category, options)
        for hidden in schema.hidden or []:
            name, kind = str(getattr(hidden, "name", hidden)), str(getattr(hidden, "value", hidden))
            self.inputs.setdefault(name, InputSpec(name, kind, "hidden", {}))
        outputs = list(schema.outputs or [])
        self.return_types = tuple(o.get_io_type() if callable(getattr(o, "get_io_type", None)) else o.io_type
                                  for o in outputs)
        self.return_names = tuple(str(o.display_name or o.io_type) for o in outputs)
        self._output_node = bool(schema.is_output_node)
        self._not_idempotent = bool(getattr(schema, "not_idempotent", False))
        self.input_is_list = bool(getattr(schema, "is_input_list", False))
        self.output_is_list = tuple(bool(getattr(o, "is_output_list", False)) for o in outputs)
        self.description = str(getattr(schema, "description", "") or "")
        self.enable_expand = bool(getattr(schema, "enable_expand", False))
        self.schema = schema

    @property
    def output_node(self) -> bool:
        return self._output_node

    @property
    def not_idempotent(self) -> bool:
        return self._not_idempotent

    @property
    def hidden_values(self) -> dict[str, str]:
        """Hidden input name -> what it asks for (``UNIQUE_ID``, ``PROMPT``, ...)."""
        return {s.name: str(s.type) for s in self.inputs.values() if s.category == "hidden"}

    @property
    def wants_unique_id(self) -> bool:
        return "UNIQUE_ID" in self.hidden_values.values()

    def declared(self, name: str) -> InputSpec | None:
        """The spec of a required/optional/hidden input, or None if the class does not declare it."""
        return self.inputs.get(name)

    def visible_inputs(self) -> list[InputSpec]:
        """Required then optional inputs, each in declaration order (the order the editor creates
        widgets in; a V3 schema may interleave them, ComfyUI lists them like this)."""
        return ([s for s in self.inputs.values() if s.category == "required"]
                + [s for s in self.inputs.values() if s.category == "optional"])

    # -- the node's own functions, V1 or V3 ----------------------------------------------------------

    @property
    def validator(self) -> Callable[..., Any] | None:
        """``validate_inputs`` (V3) or ``VALIDATE_INPUTS`` (V1); None if the class has neither."""
        if self.v3:
            return v3_override(self.cls, "validate_inputs")
        return getattr(self.cls, "VALIDATE_INPUTS", None)

    @property
    def fingerprint(self) -> Callable[..., Any] | None:
        """``fingerprint_inputs`` (V3) or ``IS_CHANGED`` (V1): joins the cache signature."""
        if self.v3:
            return v3_override(self.cls, "fingerprint_inputs")
        return getattr(self.cls, "IS_CHANGED", None)

    def validate_inputs_params(self) -> tuple[set[str], bool] | None:
        """Parameter names of the validator and whether it takes ``**kwargs``; None if absent."""
        fn = self.validator
        if fn is None:
            return None
        params: set[str] = set()
        has_kwargs = False
        for p in inspect.signature(fn).parameters.values():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                has_kwargs = True
            elif p.kind is not inspect.Parameter.VAR_POSITIONAL:
                params.add(p.name)
        return params, has_kwargs

    def run_validator(self, kwargs: Mapping[str, Any], hidden: Mapping[str, Any]) -> Any:
        """Call the validator with ``kwargs``; a V3 one sees ``hidden`` (kind -> value) on ``cls.hidden``."""
        if self.v3:
            _, attrs = self.hidden_kwargs(hidden)
            return self.bound(self.cls, attrs).validate_inputs(**kwargs)
        return self.cls.VALIDATE_INPUTS(**kwargs)

    def new_object(self) -> Any:
        """What runs the node: a V1 instance (reused between runs, as ComfyUI does), or the V3 class."""
        return self.cls if self.v3 else self.cls()

    def bound(self, obj: Any, hidden: Mapping[str, Any]) -> Any:
        """``obj`` ready to call: for V3 a subclass whose ``hidden`` holds this execution's values
        (ComfyUI runs V3 nodes on a fresh class clone too, so nothing leaks between executions)."""
        if not self.v3:
            return obj
        return type(self.cls.__name__, (self.cls,), {"hidden": HiddenValues(**hidden), "__module__": self.cls.__module__})

    def function(self, obj: Any) -> Callable[..., Any]:
        return obj.execute if self.v3 else getattr(obj, self.cls.FUNCTION)

    def lazy_checker(self, obj: Any) -> Callable[..., Any] | None:
        if self.v3:
            return obj.check_lazy_status if v3_override(self.cls, "check_lazy_status") is not None else None
        return getattr(obj, "check_lazy_status", None)

    def hidden_kwargs(self, values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Split hidden values (keyed by kind, e.g. ``UNIQUE_ID``) into (keyword arguments for a
        V1 function, attributes of ``cls.hidden`` for a V3 one)."""
        by_name = {name: values.get(kind) for name, kind in self.hidden_values.items()}
        return ({}, by_name) if self.v3 else (by_name, {})

    def split_result(self, result: Any) -> tuple[Any, Any, Any]:
        """(values, ui, expand) from what the node returned: a tuple, ``{"ui", "result"}``, or a
        V3 ``NodeOutput`` (``.args``, ``.ui``, ``.expand``; its ``ui`` may be an object with ``as_dict()``)."""
        if self.v3 and hasattr(result, "args") and hasattr(result, "ui"):
            ui = result.ui
            if ui is not None and callable(getattr(ui, "as_dict", None)):
                ui = ui.as_dict()
            if getattr(result, "block_execution", None) is not None:
                raise ValueError(f"blocked execution: {result.block_execution}")
            return tuple(result.args), ui, getattr(result, "expand", None)
        if isinstance(result, Mapping):
            ui = result.get("ui")
            if ui is not None and callable(getattr(ui, "as_dict", None)):
                ui = ui.as_dict()
            return result.get("result", () if not self.return_types else None), ui, result.get("expand")
        if result is None and (self.v3 or not self.return_types):
            return (), None, None
        return result, None, None


def _parse_entry(name: str, entry: Any, category: str) -> InputSpec:
    if isinstance(entry, str):  # hidden inputs are usually declared as a bare string
        return InputSpec(name, entry, category, {})
    if isinstance(entry, (tuple, list)) and entry:
        options = entry[1] if len(entry) > 1 and isinstance(entry[1], Mapping) else {}
        return InputSpec(name, entry[0], category, dict(options))
    raise TypeError(f"input '{name}' has an unreadable declaration {entry!r}")


def is_link(value: Any) -> bool:
    """An API-format input that points at another node's output: ``[node_id, output_index]``."""
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], (str, int))
        and not isinstance(value[0], bool)
        and isinstance(value[1], int)
        and not isinstance(value[1], bool)
    )


def unwrap_constant(value: Any) -> Any:
    """Undo the frontend's ``{"__value__": [...]}`` wrapping of list constants."""
    if isinstance(value, Mapping) and "__value__" in value and len(value) == 1:
        return value["__value__"]
    return value


def link_types_compatible(received: Any, declared: Any) -> bool:
    """Whether an output of type ``received`` may feed an input declared as ``declared``.

    Follows ComfyUI's backend rule (equal, or comma-separated unions that overlap). A plain ``"*"``
    is not a wildcard there (only the editor treats it as one): a real server rejects "*" -> LATENT
    with "Return type mismatch". Custom type objects that override ``__ne__`` (the "any type" trick)
    are honoured, and VALIDATE_INPUTS taking ``input_types`` skips the check. A COMBO input accepts
    a COMBO output or a list.
    """
    if not (received != declared):
        return True
    declared_is_combo = isinstance(declared, (list, tuple)) or declared == "COMBO"
    if declared_is_combo:
        return isinstance(received, (list, tuple)) or received == "COMBO"
    if not isinstance(received, str) or not isinstance(declared, str):
        return False
    got = {t.strip() for t in received.split(",")}
    want = {t.strip() for t in declared.split(",")}
    return bool(got & want)
