"""Reading what a ComfyUI V1 node class declares: inputs, widgets, outputs, link types.

Kept apart from the engine so that the UI converter, the validator and the engine agree on one
reading of ``INPUT_TYPES`` (which inputs are widgets, which are lazy, what a COMBO is).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
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


class NodeClassInfo:
    """The declarations of one node class, read once per use (``INPUT_TYPES`` may be dynamic)."""

    def __init__(self, class_type: str, cls: type) -> None:
        self.class_type = class_type
        self.cls = cls
        raw = cls.INPUT_TYPES()
        if not isinstance(raw, Mapping):
            raise TypeError(f"INPUT_TYPES() returned {type(raw).__name__}, expected a dict")
        self.inputs: dict[str, InputSpec] = {}
        for category in ("required", "optional", "hidden"):
            for name, entry in (raw.get(category) or {}).items():
                if name in self.inputs:
                    continue  # ComfyUI looks up required, then optional, then hidden
                self.inputs[name] = _parse_entry(name, entry, category)
        return_types = getattr(cls, "RETURN_TYPES", ())
        self.return_types: tuple[Any, ...] = tuple(return_types)

    @property
    def output_node(self) -> bool:
        return getattr(self.cls, "OUTPUT_NODE", False) is True

    @property
    def not_idempotent(self) -> bool:
        return bool(getattr(self.cls, "NOT_IDEMPOTENT", False))

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
        """Required then optional inputs, in declaration order (the order widgets are created in)."""
        return [s for s in self.inputs.values() if s.category != "hidden"]

    def validate_inputs_params(self) -> tuple[set[str], bool] | None:
        """Parameter names of ``VALIDATE_INPUTS`` and whether it takes ``**kwargs``; None if absent."""
        fn = getattr(self.cls, "VALIDATE_INPUTS", None)
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
