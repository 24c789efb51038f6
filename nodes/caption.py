"""LingBot Caption: builds the structured JSON caption LingBot-Video was trained on, from widgets.

The shape is the reference's prompt file, ``{"caption": {...}, "duration": seconds}``, where the
caption holds ``comprehensive_description`` (for video the scene and the camera movement; for a
still image, duration 0, one string, the model's image shape), ``camera_info`` (seven categorical
fields, from the video or the image value lists), ``world_knowledge`` and ``prominent_elements``
(name, description and, for video, actions with ``"[a.as - b.bs]"`` timestamps that must lie within
the duration). Text Encode takes the result as it is.

Elements are written one per paragraph in a small text format (or as a JSON list)::

    paper boat: A folded red paper boat.
      0-3: floats forward with the current
      3-5: turns slowly toward the bridge
    stone bridge: An old arched bridge in the background.
"""

from __future__ import annotations

import json
import re
from typing import Any

from lingbot_core.caption_schema import CAMERA_DEFAULTS as DEFAULTS
from lingbot_core.caption_schema import CAMERA_FIELDS, IMAGE_CAMERA_FIELDS, camera_fields, timestamp

from .types import CATEGORY, Choice, InputProblems
from .v3 import io

TEMPORAL = 4  # the VAE's temporal compression: frame counts are 4n+1

_ACTION = re.compile(r"^\s*\[?\s*(\d+(?:\.\d+)?)\s*s?\s*-\s*(\d+(?:\.\d+)?)\s*s?\s*\]?\s*:\s*(.*)$")

EXAMPLE_ELEMENTS = ("paper boat: A small folded red paper boat.\n"
                    "  0-3: floats forward with the current\n"
                    "  3-5: turns slowly toward the stone bridge")


CAMERA_CHOICES: dict[str, list[str]] = {
    field: values + [v for v in IMAGE_CAMERA_FIELDS.get(field, []) if v not in values]
    for field, values in CAMERA_FIELDS.items()}
"""Each camera widget's options: the video list, then the values only the image list has (White)."""


def frames_for(duration: float, fps: int) -> int:
    """Frames for a clip of `duration` seconds: duration x fps rounded up to 4n+1, by the reference
    CLI's rule (5 s at 24 fps -> 121); a still image (duration 0) is one frame."""
    if duration <= 0:
        return 1
    count = int(duration * fps)
    return ((count - 1) // TEMPORAL + 1) * TEMPORAL + 1


def parse_elements(text: str, video: bool) -> list[dict[str, Any]]:
    """The elements widget -> prominent_elements; ValueError names the line that is wrong."""
    text = (text or "").strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON list is not valid at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
        if not isinstance(value, list) or not all(isinstance(e, dict) and e.get("name") for e in value):
            raise ValueError("a JSON list of elements must hold objects with a 'name'")
        return value
    elements: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line[0].isspace():
            if not elements:
                raise ValueError(f"line {number}: an action needs an element line above it")
            match = _ACTION.match(line)
            if match is None:
                raise ValueError(f"line {number}: write an action as '  START-END: what happens' (seconds), "
                                 f"got {line.strip()!r}")
            if not video:
                raise ValueError(f"line {number}: a still image (duration 0) has no timed actions")
            start, end = float(match.group(1)), float(match.group(2))
            if end <= start:
                raise ValueError(f"line {number}: the action ends ({end}s) before it starts ({start}s)")
            elements[-1].setdefault("actions", []).append(
                {"timestamp": timestamp(start, end), "action": match.group(3).strip(), "_end": end})
        else:
            name, _, description = line.partition(":")
            if not name.strip():
                raise ValueError(f"line {number}: an element line is 'name: description'")
            elements.append({"name": name.strip(), "description": description.strip()})
    return elements


def _last_end(elements: list[dict[str, Any]]) -> float:
    ends = [0.0]
    for element in elements:
        for action in element.get("actions") or []:
            if "_end" in action:
                ends.append(action["_end"])
            else:
                found = re.findall(r"(\d+(?:\.\d+)?)\s*s", str(action.get("timestamp", "")))
                if found:
                    ends.append(float(found[-1]))
    return max(ends)


def caption_problems(elements: str, duration: float, scene: str | None = None,
                     camera: dict[str, str] | None = None) -> dict[str, str]:
    """One message per wrong input: the elements text, the duration against the last action, a
    camera value outside the list of the caption's kind (video, or a still image at duration 0)."""
    problems: dict[str, str] = {}
    if scene is not None and not scene.strip():
        problems["scene_description"] = "describe the scene (it is the core of the caption)"
    if duration is None or elements is None:
        return problems
    video = float(duration) > 0
    for field, value in (camera or {}).items():
        allowed = camera_fields(video).get(field)
        if allowed is not None and value not in allowed:
            kind = "a video" if video else "a still image (duration 0)"
            problems[field] = f"{value!r} is not a {field} value for {kind}; use one of: {', '.join(allowed)}"
    try:
        parsed = parse_elements(elements, video=float(duration) > 0)
    except ValueError as exc:
        problems["elements"] = str(exc)
        return problems
    last = _last_end(parsed)
    if last > float(duration) + 1e-6:
        problems["duration"] = (f"the last action ends at {last:g} s, after the {float(duration):g} s duration; "
                                f"raise the duration to {last:g} or end the actions earlier")
    return problems


def build_caption(scene: str, camera_movement: str, camera: dict[str, str], elements: str,
                  duration: float) -> dict[str, Any]:
    video = duration > 0
    parsed = parse_elements(elements, video)
    for element in parsed:
        for action in element.get("actions") or []:
            action.pop("_end", None)
    description: Any = scene.strip()  # a still image: one string, the model's image shape
    if video:
        description = {"scene_content_description": scene.strip(),
                       "camera_movement_description": camera_movement.strip() or "Static camera."}
    caption = {"comprehensive_description": description, "camera_info": dict(camera), "world_knowledge": [],
               "prominent_elements": parsed}
    duration_value: float | int | None = None
    if video:
        duration_value = int(duration) if float(duration).is_integer() else float(duration)
    return {"caption": caption, "duration": duration_value}


class LingBotCaption(io.ComfyNode):
    """Structured caption builder: widgets in, the prompt STRING (and the frame count) out."""

    @classmethod
    def define_schema(cls):
        camera = [Choice(name, options=options, default=DEFAULTS[name],
                         tooltip=f"camera_info.{name} of the caption"
                                 + ("" if options == IMAGE_CAMERA_FIELDS[name] == CAMERA_FIELDS[name] else
                                    f" (a still image takes: {', '.join(IMAGE_CAMERA_FIELDS[name])})"))
                  for name, options in CAMERA_CHOICES.items()]
        return io.Schema(
            node_id="LingBotCaption",
            display_name="LingBot Caption",
            category=CATEGORY,
            description="Builds the structured JSON caption LingBot-Video was trained on (prose prompts follow "
                        "less well): scene, camera movement, camera info, prominent elements with timed actions, "
                        "and the duration. Checks that every action ends within the duration, and gives the "
                        "frame count for that duration (4n+1). Wire `prompt` to LingBot Text Encode.",
            inputs=[
                io.String.Input("scene_description", multiline=True, dynamic_prompts=False,
                                default="A small red paper boat drifts along a narrow canal at dawn. Soft mist "
                                        "hangs over the water and a stone bridge arches in the background.",
                                tooltip="What is in the scene: subjects, setting, lighting, atmosphere, "
                                        "interactions (not the camera)"),
                io.String.Input("camera_movement", multiline=True, dynamic_prompts=False,
                                default="The camera tracks slowly to the right, keeping the boat centered.",
                                tooltip="How the camera moves over the clip (ignored for a still image)"),
                *camera,
                io.String.Input("elements", multiline=True, dynamic_prompts=False, default=EXAMPLE_ELEMENTS,
                                tooltip="Prominent elements, one per line as 'name: description', each followed "
                                        "by indented '  START-END: action' lines in seconds; or a JSON list"),
                io.Float.Input("duration", default=5.0, min=0.0, max=60.0, step=0.5,
                               tooltip="Clip length in seconds; 0 makes an image caption (no actions, no camera "
                                       "movement)"),
                io.Int.Input("fps", default=24, min=1, max=120,
                             tooltip="Frame rate used for the frame count (LingBot-Video is trained at 24)"),
            ],
            outputs=[io.String.Output(display_name="prompt", tooltip="The caption JSON, for LingBot Text Encode"),
                     io.Int.Output(display_name="frames",
                                   tooltip="duration x fps rounded to 4n+1 (for LingBot Denoise)")],
        )

    @classmethod
    def validate_inputs(cls, elements=None):
        """The elements text parses (one input per validator, so the message lands on `elements`;
        timing against the duration is checked when the node runs, before anything downstream)."""
        if not isinstance(elements, str):
            return True
        try:
            parse_elements(elements, video=True)
        except ValueError as exc:
            return InputProblems({"elements": str(exc).replace(" (duration 0)", "")})
        return True

    @classmethod
    def execute(cls, scene_description, camera_movement, color, frame_size, shot_type_angle, lens_size,
                composition, lighting, lighting_type, elements, duration, fps):
        camera = dict(color=color, frame_size=frame_size, shot_type_angle=shot_type_angle, lens_size=lens_size,
                      composition=composition, lighting=lighting, lighting_type=lighting_type)
        problems = caption_problems(elements, duration, scene_description, camera)
        if problems:
            raise ValueError(str(InputProblems(problems)))
        caption = build_caption(scene_description, camera_movement, camera, elements, float(duration))
        text = json.dumps(caption, ensure_ascii=False, separators=(",", ":"))
        return io.NodeOutput(text, frames_for(float(duration), int(fps)))
