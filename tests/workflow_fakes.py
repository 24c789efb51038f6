"""Fake ComfyUI V1 node classes for the workflow-engine tests.

Every node appends ``(class name, node id)`` to ``CALLS`` when its function runs, so a test can
see exactly which nodes executed; the node id comes from the engine's context variable.
"""

from __future__ import annotations

from typing import Any

from lingbot_core.workflow import Interrupted, current_node_id, report_progress

CALLS: list[tuple[str, str | None]] = []


def reset() -> None:
    CALLS.clear()
    Volatile.token = "v1"
    Stopper.stop = False
    Flaky.calls = 0


def ran() -> list[str]:
    """Node ids that executed, in order."""
    return [nid for _, nid in CALLS if nid is not None]


class AnyType(str):
    """ComfyUI's "any type" idiom: a plain "*" is no wildcard for the server's link check."""

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = str.__hash__


ANY = AnyType("*")


class _Node:
    CATEGORY = "tests"
    FUNCTION = "run"

    def _record(self) -> None:
        CALLS.append((type(self).__name__, current_node_id()))


class Number(_Node):
    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"value": ("INT", {"default": 0, "min": -100, "max": 100, "step": 1})}}

    RETURN_TYPES = ("INT",)
    RETURN_NAMES = ("value",)

    def run(self, value: int) -> tuple[int]:
        self._record()
        return (value,)


class Add(_Node):
    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {"a": ("INT", {"forceInput": True}), "b": ("INT", {"forceInput": True})},
            "optional": {"bias": ("INT", {"default": 0, "min": -10, "max": 10})},
        }

    RETURN_TYPES = ("INT",)

    def run(self, a: int, b: int, bias: int = 0) -> tuple[int]:
        self._record()
        return (a + b + bias,)


class Scale(_Node):
    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"x": ("INT", {"forceInput": True}),
                             "factor": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 10.0, "step": 0.5})}}

    RETURN_TYPES = ("FLOAT",)

    def run(self, x: int, factor: float) -> tuple[float]:
        self._record()
        return (x * factor,)


class Sampler(_Node):
    """Widgets in the order a real sampler has them: a seed (with its UI-only control value),
    a combo that legitimately contains "fixed", an INT that asks for a control widget itself,
    and an optional FLOAT."""

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "value": ("INT", {"forceInput": True}),
                "seed": ("INT", {"default": 0, "min": 0, "max": 2**64 - 1}),
                "mode": (["fast", "fixed", "slow"],),
                "steps": ("INT", {"default": 4, "min": 1, "max": 50, "control_after_generate": True}),
            },
            "optional": {"strength": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 2.0, "step": 0.25})},
        }

    RETURN_TYPES = ("STRING",)

    def run(self, value: int, seed: int, mode: str, steps: int, strength: float = 1.0) -> tuple[str]:
        self._record()
        return (f"{value}|{seed}|{mode}|{steps}|{strength}",)


class Text(_Node):
    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"text": ("STRING", {"default": "", "multiline": True, "dynamicPrompts": False})}}

    RETURN_TYPES = ("STRING",)

    def run(self, text: str) -> tuple[str]:
        self._record()
        return (text,)


class Show(_Node):
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"value": (ANY,)}}

    RETURN_TYPES = ()

    def run(self, value: Any) -> dict[str, Any]:
        self._record()
        return {"ui": {"text": [repr(value)]}}


class ImageSource(_Node):
    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"name": ("STRING", {"default": "img"})}}

    RETURN_TYPES = ("IMAGE",)

    def run(self, name: str) -> tuple[list[str]]:
        self._record()
        return ([name],)


class LoadImage(_Node):
    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"image": (["a.png", "b.png"], {"image_upload": True})}}

    RETURN_TYPES = ("IMAGE", "MASK")

    def run(self, image: str) -> tuple[list[str], str]:
        self._record()
        return ([image], "mask")


class Blur(_Node):
    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"strength": ("FLOAT", {"forceInput": True}), "image": ("IMAGE",),
                             "radius": ("INT", {"default": 1, "min": 0, "max": 9})}}

    RETURN_TYPES = ("IMAGE",)

    def run(self, strength: float, image: list[str], radius: int) -> tuple[list[str]]:
        self._record()
        return ([*image, f"blur{radius}"],)


class Switch(_Node):
    """Evaluates only the branch it picks, like ComfyUI's lazy switch."""

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"cond": ("BOOLEAN", {"default": True}),
                             "on_true": (ANY, {"lazy": True}), "on_false": (ANY, {"lazy": True})}}

    RETURN_TYPES = (ANY,)
    lazy_calls: list[tuple[Any, Any]] = []

    def check_lazy_status(self, cond: bool, on_true: Any = None, on_false: Any = None) -> list[str]:
        Switch.lazy_calls.append((on_true, on_false))
        if cond:
            return ["on_true"] if on_true is None else []
        return ["on_false"] if on_false is None else []

    def run(self, cond: bool, on_true: Any = None, on_false: Any = None) -> tuple[Any]:
        self._record()
        return (on_true if cond else on_false,)


class Fail(_Node):
    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"value": ("INT", {"forceInput": True}), "boom": ("BOOLEAN", {"default": False})}}

    RETURN_TYPES = ("INT",)

    def run(self, value: int, boom: bool) -> tuple[int]:
        self._record()
        if boom:
            raise ValueError("boom requested")
        return (value,)


class Stopper(_Node):
    """Raises the engine's Interrupted while ``stop`` is set (a cancel arriving mid-node)."""

    stop = False

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"value": ("INT", {"forceInput": True})}}

    RETURN_TYPES = ("INT",)

    def run(self, value: int) -> tuple[int]:
        self._record()
        if Stopper.stop:
            raise Interrupted("user cancelled")
        return (value,)


class InterruptProcessingException(Exception):  # noqa: N818 - ComfyUI's name, matched by the engine
    """Stands in for comfy.model_management.InterruptProcessingException."""


class ComfyStop(_Node):
    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"value": ("INT", {"forceInput": True})}}

    RETURN_TYPES = ("INT",)

    def run(self, value: int) -> tuple[int]:
        self._record()
        raise InterruptProcessingException()


class Volatile(_Node):
    """IS_CHANGED returns ``token``: equal tokens keep the cache, a new token re-runs."""

    token: Any = "v1"
    is_changed_calls = 0

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"value": ("INT", {"default": 1})}}

    @classmethod
    def IS_CHANGED(cls, value: int) -> Any:
        cls.is_changed_calls += 1
        return cls.token

    RETURN_TYPES = ("INT",)

    def run(self, value: int) -> tuple[int]:
        self._record()
        return (value,)


class Picky(_Node):
    """Validates ``path`` itself; also names ``choice`` so its combo membership is its own job."""

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"path": ("STRING", {"default": "ok"}), "choice": (["a", "b"],)}}

    @classmethod
    def VALIDATE_INPUTS(cls, path: str | None, choice: str | None) -> bool | str:
        # Linked inputs arrive as None: they are not computed yet when validation runs.
        if path is not None and not path.startswith("ok"):
            return f"path {path!r} must start with 'ok'"
        if choice is not None and choice not in ("a", "b", "custom"):
            return f"choice {choice!r} unknown"
        return True

    RETURN_TYPES = ("STRING",)

    def run(self, path: str, choice: str) -> tuple[str]:
        self._record()
        return (f"{path}:{choice}",)


class Progressing(_Node):
    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"value": ("INT", {"forceInput": True})}}

    RETURN_TYPES = ("INT",)

    def run(self, value: int) -> tuple[int]:
        self._record()
        for step in range(1, 4):
            report_progress(step, 3)
        return (value,)


class WithId(_Node):
    """Takes the hidden UNIQUE_ID, which ties its cache entry to its node id (as in ComfyUI)."""

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"value": ("INT", {"default": 0})}, "hidden": {"uid": "UNIQUE_ID"}}

    RETURN_TYPES = ("STRING",)

    def run(self, value: int, uid: str) -> tuple[str]:
        self._record()
        return (f"{uid}:{value}",)


class Flaky(_Node):
    """Returns the wrong number of outputs."""

    calls = 0

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {}}

    RETURN_TYPES = ("INT", "INT")

    def run(self) -> tuple[int]:
        self._record()
        return (1,)


class Choice(_Node):
    """Outputs a COMBO-typed value (a list RETURN_TYPE, as loaders' filename outputs are)."""

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {}}

    RETURN_TYPES = (["a", "b"],)

    def run(self) -> tuple[str]:
        self._record()
        return ("b",)


class Meta(_Node):
    """Takes ComfyUI's hidden PROMPT and EXTRA_PNGINFO, as a saving node does for metadata."""

    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"value": (ANY,)}, "hidden": {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"}}

    RETURN_TYPES = ("STRING",)

    def run(self, value: Any, prompt: dict[str, Any], extra_pnginfo: dict[str, Any] | None) -> dict[str, Any]:
        self._record()
        has_workflow = extra_pnginfo is not None and "nodes" in extra_pnginfo["workflow"]
        return {"ui": {"text": [str(value)]}, "result": (f"{sorted(prompt)}|{has_workflow}",)}


REGISTRY: dict[str, type] = {
    cls.__name__: cls
    for cls in (Number, Add, Scale, Sampler, Text, Show, ImageSource, LoadImage, Blur, Switch, Fail, Stopper,
                ComfyStop, Volatile, Picky, Progressing, WithId, Flaky, Choice, Meta)
}
