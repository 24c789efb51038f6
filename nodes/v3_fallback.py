"""The part of ComfyUI's V3 node API (`comfy_api.latest`) that our nodes use, for hosts without it.

Imported only when `comfy_api` cannot be (headless runs, CI, the CLI). Constructor keywords,
attribute names and `as_dict()` keys follow ComfyUI 0.3.64, so one node definition works in both:
`lingbot_core.workflow.nodeinfo` reads these schemas exactly as it reads ComfyUI's own.

Like ComfyUI's `io.ComfyNode`, a node class also answers the classic V1 questions
(`INPUT_TYPES()`, `RETURN_TYPES`, `CATEGORY`, ...), computed from its schema; that is what tests,
`workflows/build.py` and a `/object_info`-style listing read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction
from typing import Any

__all__ = ["ComfyExtension", "InputImpl", "Types", "io", "ui"]


def _pruned(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


class _IOType(str):
    """A type name compared as ComfyUI compares V3 types: "*" matches anything, and "A,B" matches
    a type set it contains or is contained in."""

    def __ne__(self, other: object) -> bool:
        if self == "*" or other == "*":
            return False
        if not isinstance(other, str):
            return True
        mine, theirs = frozenset(self.split(",")), frozenset(other.split(","))
        return not (mine <= theirs or theirs <= mine)

    __hash__ = str.__hash__


class _classproperty:
    def __init__(self, getter):
        self.getter = getter

    def __get__(self, _obj, owner):
        return self.getter(owner)


# -- types and their inputs/outputs --------------------------------------------------------------


class _Input:
    """One declared input. `io_type` comes from the type class the input belongs to."""

    io_type: Any = None
    _keys: dict[str, str] = {}  # constructor keyword -> V1 option name

    def __init__(self, id: str, display_name: str | None = None, optional: bool = False,
                 tooltip: str | None = None, lazy: bool | None = None, **extra: Any) -> None:
        unknown = set(extra) - set(self._keys)
        if unknown:
            raise TypeError(f"{type(self).__qualname__}() got unexpected keyword(s) {sorted(unknown)}")
        self.id = id
        self.display_name = display_name
        self.optional = optional
        self.tooltip = tooltip
        self.lazy = lazy
        for key in self._keys:
            setattr(self, key, extra.get(key))

    def get_io_type(self) -> Any:
        return self.io_type

    def as_dict(self) -> dict[str, Any]:
        base = _pruned({"display_name": self.display_name, "optional": self.optional, "tooltip": self.tooltip,
                        "lazy": self.lazy})
        values = {name: getattr(self, key) for key, name in self._keys.items()}
        if isinstance(values.get("display"), Enum):
            values["display"] = values["display"].value
        return base | _pruned(values)


class _Output:
    io_type: Any = None

    def __init__(self, id: str | None = None, display_name: str | None = None, tooltip: str | None = None,
                 is_output_list: bool = False) -> None:
        self.id = id
        self.display_name = display_name
        self.tooltip = tooltip
        self.is_output_list = is_output_list

    def get_io_type(self) -> Any:
        return self.io_type

    def as_dict(self) -> dict[str, Any]:
        return _pruned({"display_name": self.display_name, "tooltip": self.tooltip,
                        "is_output_list": self.is_output_list})


_WIDGET = {"default": "default", "socketless": "socketless", "force_input": "forceInput"}
_NUMBER = {"min": "min", "max": "max", "step": "step", "display_mode": "display"}


def _io_type(name: str, input_keys: dict[str, str] | None = None, with_output: bool = True) -> type:
    """A type namespace like `io.Int`: `.io_type`, `.Input` and (usually) `.Output`."""
    name = _IOType(name)
    input_cls = type("Input", (_Input,), {"io_type": name, "_keys": input_keys or {}})
    attrs: dict[str, Any] = {"io_type": name, "Input": input_cls}
    if with_output:
        attrs["Output"] = type("Output", (_Output,), {"io_type": name})
    return type(name.title(), (), attrs)


class UploadType(str, Enum):
    """What a combo's upload button takes (`io.UploadType`): its value is the option that asks for it."""

    image = "image_upload"
    audio = "audio_upload"
    video = "video_upload"
    model = "file_upload"


class FolderType(str, Enum):
    """Which of ComfyUI's folders an upload goes to (`io.FolderType`)."""

    input = "input"
    output = "output"
    temp = "temp"


class _ComboInput(_Input):
    io_type = _IOType("COMBO")
    _keys = {**_WIDGET, "options": "options", "control_after_generate": "control_after_generate",
             "upload": "upload", "image_folder": "image_folder"}

    def __init__(self, id: str, options: list[Any] | type[Enum] | None = None, **kwargs: Any) -> None:
        if isinstance(options, type) and issubclass(options, Enum):
            options = [member.value for member in options]
        super().__init__(id, options=list(options or []), **kwargs)

    def as_dict(self) -> dict[str, Any]:
        spec = super().as_dict() | {"multiselect": False}
        upload = spec.pop("upload", None)
        if upload is not None:  # ComfyUI's form: the upload kind's own key set to true
            spec[UploadType(upload).value] = True
        if spec.get("image_folder") is not None:
            spec["image_folder"] = FolderType(spec["image_folder"]).value
        return spec


class _MultiTypeInput(_Input):
    """An input that takes several types, "A,B" (`io.MultiType.Input`); given an input instead of an id,
    that input's widget and options come first and its type leads the list."""

    def __init__(self, id: str | _Input, types: list[Any], display_name: str | None = None, optional: bool = False,
                 tooltip: str | None = None, lazy: bool | None = None, extra_dict: dict | None = None) -> None:
        self.input_override = None
        if isinstance(id, _Input):
            self.input_override = copy.copy(id)
            optional = id.optional or optional
            tooltip = id.tooltip if id.tooltip is not None else tooltip
            display_name = id.display_name if id.display_name is not None else display_name
            lazy = id.lazy if id.lazy is not None else lazy
            id = id.id
        super().__init__(id, display_name, optional, tooltip, lazy)
        self._io_types = list(types)

    def get_io_type(self) -> Any:
        names = [t.io_type for t in self._io_types]
        if self.input_override is not None:
            names.insert(0, self.input_override.get_io_type())
        return _IOType(",".join(dict.fromkeys(names)))

    def as_dict(self) -> dict[str, Any]:
        base = self.input_override.as_dict() if self.input_override is not None else {}
        return base | super().as_dict()


class _Namespace:
    """`io`: the types, the schema, the node base class."""

    Int = _io_type("INT", {**_WIDGET, **_NUMBER, "control_after_generate": "control_after_generate"})
    Float = _io_type("FLOAT", {**_WIDGET, **_NUMBER, "round": "round"})
    String = _io_type("STRING", {**_WIDGET, "multiline": "multiline", "placeholder": "placeholder",
                                 "dynamic_prompts": "dynamicPrompts"})
    Boolean = _io_type("BOOLEAN", {**_WIDGET, "label_on": "label_on", "label_off": "label_off"})
    Combo = type("Combo", (), {"io_type": "COMBO", "Input": _ComboInput})
    UploadType = UploadType
    FolderType = FolderType
    Image = _io_type("IMAGE")
    Latent = _io_type("LATENT")
    Video = _io_type("VIDEO")
    AnyType = _io_type("*")
    MultiType = type("MultiType", (), {"Type": Any, "Input": _MultiTypeInput})

    @staticmethod
    def Custom(io_type: str) -> type:  # noqa: N802 - ComfyUI's spelling
        return _io_type(io_type)


io = _Namespace()


class Hidden(str, Enum):
    unique_id = "UNIQUE_ID"
    prompt = "PROMPT"
    extra_pnginfo = "EXTRA_PNGINFO"


class HiddenHolder:
    """Hidden values of one execution, read as `cls.hidden.unique_id`; absent ones are None."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def __getattr__(self, _name: str) -> Any:
        return None


@dataclass
class Schema:
    node_id: str
    display_name: str | None = None
    category: str = "sd"
    inputs: list[Any] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    hidden: list[Hidden] = field(default_factory=list)
    description: str = ""
    is_input_list: bool = False
    is_output_node: bool = False
    not_idempotent: bool = False
    enable_expand: bool = False

    def finalize(self) -> None:
        """As ComfyUI: output nodes see the prompt and the workflow; outputs get ids."""
        self.hidden = list(self.hidden or [])
        if self.is_output_node:
            self.hidden += [h for h in (Hidden.prompt, Hidden.extra_pnginfo) if h not in self.hidden]
        for i, output in enumerate(self.outputs or []):
            if output.id is None:
                output.id = f"_{i}_{output.io_type}_"

    def validate(self) -> None:
        ids = [i.id for i in self.inputs or []] + [o.id for o in self.outputs or []]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"{self.node_id}: input/output ids must be unique, {dupes} are not")


class NodeOutput:
    def __init__(self, *args: Any, ui: Any = None, expand: dict | None = None,
                 block_execution: str | None = None) -> None:
        self.args = args
        self.ui = ui
        self.expand = expand
        self.block_execution = block_execution

    @property
    def result(self) -> tuple[Any, ...] | None:
        return self.args or None

    def __getitem__(self, index: int) -> Any:
        return self.args[index]


class ComfyNode:
    """Base class of a V3 node: classmethods only, no instance state."""

    hidden: HiddenHolder = HiddenHolder()

    @classmethod
    def define_schema(cls) -> Schema:
        raise NotImplementedError

    @classmethod
    def execute(cls, **kwargs: Any) -> NodeOutput:
        raise NotImplementedError

    @classmethod
    def validate_inputs(cls, **kwargs: Any) -> bool | str:
        raise NotImplementedError

    @classmethod
    def fingerprint_inputs(cls, **kwargs: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def check_lazy_status(cls, **kwargs: Any) -> list[str]:
        return [name for name, value in kwargs.items() if value is None]

    @classmethod
    def GET_SCHEMA(cls) -> Schema:  # noqa: N802 - ComfyUI's name
        schema = cls.define_schema()
        schema.finalize()
        schema.validate()
        return schema

    # -- the V1 view, as ComfyUI's own V3 base class offers it --------------------------------------
    # Enough for a ComfyUI without the V3 API (before 0.3.48) to run these classes as V1 nodes.

    FUNCTION = "run_v1"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # V1 hosts look for VALIDATE_INPUTS / IS_CHANGED, with the same parameter names.
        if "validate_inputs" in vars(cls):
            cls.VALIDATE_INPUTS = cls.validate_inputs
        if "fingerprint_inputs" in vars(cls):
            cls.IS_CHANGED = cls.fingerprint_inputs

    def run_v1(self, **kwargs: Any) -> dict[str, Any]:
        """V1 entry point: hidden values arrive as keyword arguments; V3 code reads `cls.hidden`."""
        cls = type(self)
        names = {h.name for h in cls.GET_SCHEMA().hidden or []}
        hidden = {name: kwargs.pop(name) for name in list(kwargs) if name in names}
        clone = type(cls.__name__, (cls,), {"hidden": HiddenHolder(**hidden), "__module__": cls.__module__})
        out = clone.execute(**kwargs)
        if not isinstance(out, NodeOutput):
            out = NodeOutput(*(out or ()))
        ui_value = out.ui.as_dict() if callable(getattr(out.ui, "as_dict", None)) else out.ui
        return {"ui": ui_value, "result": tuple(out.args)} if ui_value is not None else {"result": tuple(out.args)}

    @classmethod
    def INPUT_TYPES(cls, include_hidden: bool = True) -> dict[str, dict[str, tuple]]:  # noqa: N802
        schema = cls.GET_SCHEMA()
        spec: dict[str, dict[str, tuple]] = {"required": {}}
        for item in schema.inputs or []:
            options = item.as_dict()
            options.pop("optional", None)
            spec.setdefault("optional" if item.optional else "required", {})[item.id] = (item.get_io_type(), options)
        if include_hidden and schema.hidden:
            spec["hidden"] = {h.name: (h.value,) for h in schema.hidden}
        return spec

    RETURN_TYPES = _classproperty(lambda c: tuple(o.get_io_type() for o in c.GET_SCHEMA().outputs or []))
    RETURN_NAMES = _classproperty(lambda c: tuple(o.display_name or o.io_type for o in c.GET_SCHEMA().outputs or []))
    OUTPUT_TOOLTIPS = _classproperty(lambda c: tuple(o.tooltip for o in c.GET_SCHEMA().outputs or []))
    OUTPUT_IS_LIST = _classproperty(lambda c: tuple(o.is_output_list for o in c.GET_SCHEMA().outputs or []))
    CATEGORY = _classproperty(lambda c: c.GET_SCHEMA().category)
    DESCRIPTION = _classproperty(lambda c: c.GET_SCHEMA().description)
    OUTPUT_NODE = _classproperty(lambda c: c.GET_SCHEMA().is_output_node)
    INPUT_IS_LIST = _classproperty(lambda c: c.GET_SCHEMA().is_input_list)
    NOT_IDEMPOTENT = _classproperty(lambda c: c.GET_SCHEMA().not_idempotent)


# The `io` namespace exposes these under their comfy_api names (io.Schema, io.ComfyNode, ...).
for _exported in (Schema, ComfyNode, NodeOutput, Hidden, HiddenHolder):
    setattr(io, _exported.__name__, _exported)


class ComfyExtension:
    async def on_load(self) -> None:
        return None

    async def get_node_list(self) -> list[type[ComfyNode]]:
        raise NotImplementedError


# -- UI outputs ----------------------------------------------------------------------------------


class _UI:
    class PreviewText:
        def __init__(self, value: str, **_: Any) -> None:
            self.value = value

        def as_dict(self) -> dict[str, Any]:
            return {"text": (self.value,)}


ui = _UI()


# -- VIDEO ---------------------------------------------------------------------------------------


@dataclass
class VideoComponents:
    images: Any
    frame_rate: Fraction
    audio: Any = None
    metadata: dict | None = None


class VideoFromComponents:
    """A stand-in for ComfyUI's VIDEO value: frames [T,H,W,3] in 0..1 plus a frame rate."""

    def __init__(self, components: VideoComponents) -> None:
        self._components = components

    def get_components(self) -> VideoComponents:
        c = self._components
        return VideoComponents(images=c.images, frame_rate=c.frame_rate, audio=c.audio, metadata=c.metadata)

    def get_dimensions(self) -> tuple[int, int]:
        images = self._components.images
        return int(images.shape[2]), int(images.shape[1])

    def get_duration(self) -> float:
        return float(self._components.images.shape[0] / self._components.frame_rate)

    def save_to(self, path: str, format: str = "auto", codec: str = "auto", metadata: dict | None = None) -> None:
        import json

        from lingbot_core.video import save_mp4

        if str(getattr(format, "value", format)) not in ("auto", "mp4") or \
                str(getattr(codec, "value", codec)) not in ("auto", "h264"):
            raise ValueError("only mp4/h264 is supported")
        tags = {k: json.dumps(v) for k, v in (metadata or {}).items()}
        save_mp4(self._components.images, path, float(self._components.frame_rate), metadata=tags)


class InputImpl:
    VideoFromComponents = VideoFromComponents


class Types:
    VideoComponents = VideoComponents
