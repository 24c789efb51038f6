"""The structured caption LingBot-Video was trained on: its fields, vocabulary and a validator.

One home for the schema facts, read by the Caption node (its widgets), the prompt rewriter (its
instructions and its check of what a model wrote) and the tests. A caption file is
``{"caption": {...}, "duration": seconds}``; the caption holds

* ``comprehensive_description``: for video an object with ``scene_content_description`` and
  ``camera_movement_description``; for a still image (the model's image shape) one string;
* ``camera_info``: the seven categorical fields of :data:`CAMERA_FIELDS` (video) or
  :data:`IMAGE_CAMERA_FIELDS` (image), each with its own value list;
* ``world_knowledge``: a list of strings;
* ``prominent_elements``: objects with ``name``, ``description`` and, for video, ``actions``
  (``timestamp`` written ``"[0.0s - 0.5s]"``, ``action``), every action within the duration.

Two levels of checking: ``strict`` (the rewriter's own output, and the Caption node) keeps the value
lists; a caption a user brings (``strict=False``) is judged on its shape only, and values outside the
lists come back from :func:`caption_notes` as notes (the reference's own example captions use such
values, e.g. ``Macro`` or ``Studio lighting``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import surrogate_problem

__all__ = ["CAMERA_FIELDS", "CAMERA_DEFAULTS", "IMAGE_CAMERA_FIELDS", "IMAGE_CAMERA_DEFAULTS", "RELATIVE_SIZES",
           "TIMESTAMP_PATTERN", "camera_fields", "caption_notes", "caption_problems", "caption_window", "parse_timestamp",
           "timed_actions", "timestamp"]

CAMERA_FIELDS: dict[str, list[str]] = {
    "color": ["Warm", "Cool", "Mixed", "Saturated", "Desaturated", "Black and White", "Red", "Orange", "Yellow",
              "Green", "Cyan", "Blue", "Magenta", "Pink"],
    "frame_size": ["Extreme Wide", "Wide", "Medium Wide", "Medium", "Medium Close Up", "Close Up",
                   "Extreme Close Up"],
    "shot_type_angle": ["Eye level", "High angle", "Low angle", "Dutch angle", "Overhead", "Aerial"],
    "lens_size": ["Medium", "Ultra Wide / Fisheye", "Wide", "Long Lens", "Telephoto"],
    "composition": ["Center", "Balanced", "Symmetrical", "Left heavy", "Right heavy", "Short side"],
    "lighting": ["Soft light", "Hard light", "High contrast", "Low contrast", "Side light", "Top light",
                 "Underlight", "Backlight", "Edge light", "Silhouette"],
    "lighting_type": ["Daylight", "Sunny", "Overcast", "Moonlight", "Artificial light", "Practical light",
                      "Tungsten", "Fluorescent", "Firelight", "Mixed light"],
}
"""camera_info fields and the values the reference's caption schema lists for them (video captions)."""

CAMERA_DEFAULTS: dict[str, str] = {
    "color": "Warm", "frame_size": "Medium", "shot_type_angle": "Eye level", "lens_size": "Medium",
    "composition": "Center", "lighting": "Soft light", "lighting_type": "Daylight"}

IMAGE_CAMERA_FIELDS: dict[str, list[str]] = {
    "color": ["Warm", "Cool", "Mixed", "Saturated", "Desaturated", "White", "Green", "Blue", "Red", "Cyan"],
    "frame_size": ["Extreme Close Up", "Close Up", "Medium Close Up", "Medium", "Medium Wide", "Wide", "Extreme Wide"],
    "shot_type_angle": ["Eye level", "Low angle", "High angle", "Overhead", "Aerial"],
    "lens_size": ["Ultra Wide / Fisheye", "Wide", "Medium", "Long Lens", "Telephoto"],
    "composition": ["Center", "Balanced", "Symmetrical", "Left heavy", "Right heavy"],
    "lighting": ["Soft light", "Hard light", "Top light", "Underlight", "Backlight"],
    "lighting_type": ["Daylight", "Artificial light"],
}
"""camera_info fields and the values the reference's image (t2i) rewriter lists for them: a list of its
own, not a subset of the video one (``White`` is an image colour only)."""

IMAGE_CAMERA_DEFAULTS: dict[str, str] = {field: CAMERA_DEFAULTS[field] for field in IMAGE_CAMERA_FIELDS}

RELATIVE_SIZES = ["dominant", "large", "medium", "small"]
"""``relative_size`` of an image caption's element (the reference's image rewriter asks for one of these)."""


def camera_fields(video: bool) -> dict[str, list[str]]:
    """The camera_info value lists for a video or a still-image caption."""
    return CAMERA_FIELDS if video else IMAGE_CAMERA_FIELDS


TIMESTAMP_PATTERN = re.compile(r"^\[(\d+(?:\.\d+)?)s - (\d+(?:\.\d+)?)s\]$")
"""An action's timestamp, e.g. ``[0.0s - 0.5s]`` (seconds, one space either side of the dash)."""

END_TOLERANCE = 0.05
"""Seconds the last action's end may differ from the duration (one decimal place of rounding)."""


def timestamp(start: float, end: float) -> str:
    return f"[{start:.1f}s - {end:.1f}s]"


def parse_timestamp(text: Any) -> tuple[float, float] | None:
    """(start, end) seconds of a well-formed timestamp, else None."""
    match = TIMESTAMP_PATTERN.match(text.strip()) if isinstance(text, str) else None
    return (float(match.group(1)), float(match.group(2))) if match else None


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def caption_problems(document: Any, duration: float | None, *, strict: bool = True) -> list[str]:
    """Everything wrong with a caption file for a clip of ``duration`` seconds (0 or None: a still
    image), one plain sentence each; an empty list means the caption is valid.

    ``document`` is the parsed ``{"caption": {...}, "duration": ...}`` (a bare caption object is
    accepted too). For video, the last action must end at the duration. ``strict`` (the rewriter's
    own output) also holds camera_info to its value lists, a still image to the string description
    and every action to a text; without it those are :func:`caption_notes`.
    """
    return _review(document, duration, strict)[0]


def caption_notes(document: Any, duration: float | None) -> list[str]:
    """What a caption a user brings does differently from the value lists (values outside a list, an
    image description written as an object, an empty camera movement, an action without text): worth a note, not a refusal."""
    return _review(document, duration, False)[1]


def _review(document: Any, duration: float | None, strict: bool) -> tuple[list[str], list[str]]:
    """(problems, notes): with ``strict`` every note is a problem too."""
    video = bool(duration) and float(duration) > 0
    if not isinstance(document, dict):
        return [f"the output must be a JSON object, got {type(document).__name__}"], []
    surrogate = surrogate_problem(json.dumps(document, ensure_ascii=False, default=str), "the caption")
    if surrogate:  # a tokenizer refuses it late with a raw TypeError; a file or metadata write after the video
        return [surrogate], []
    caption = document.get("caption", document)
    if not isinstance(caption, dict):
        return ["'caption' must be a JSON object"], []
    problems: list[str] = []
    notes: list[str] = []
    soft = problems if strict else notes  # off the lists: a problem for our own output, a note for a user's
    description = caption.get("comprehensive_description")
    if video:
        if not isinstance(description, dict):
            problems.append("'comprehensive_description' is missing or not an object (a video caption holds "
                            "scene_content_description and camera_movement_description)")
        else:
            if not _text(description.get("scene_content_description")):
                problems.append("'comprehensive_description.scene_content_description' is missing or empty")
            movement = description.get("camera_movement_description")
            if not isinstance(movement, str):
                problems.append("'comprehensive_description.camera_movement_description' is missing")
            elif not movement.strip():  # the reference's own examples leave it empty for a still camera
                soft.append("'comprehensive_description.camera_movement_description' is empty")
    elif isinstance(description, dict):
        if not _text(description.get("scene_content_description")):
            problems.append("'comprehensive_description.scene_content_description' is missing or empty")
        soft.append("'comprehensive_description' is an object; an image caption writes it as one string")
    elif not _text(description):
        problems.append("'comprehensive_description' is missing or empty (an image caption writes it as one "
                        "string)")
    camera = caption.get("camera_info")
    if not isinstance(camera, dict):
        problems.append("'camera_info' is missing or not an object")
    else:
        for field, allowed in camera_fields(video).items():
            value = camera.get(field)
            if not _text(value):
                problems.append(f"'camera_info.{field}' is {value!r}; use one of: {', '.join(allowed)}")
            elif value not in allowed:
                soft.append(f"'camera_info.{field}' is {value!r}, outside its list: {', '.join(allowed)}")
    knowledge = caption.get("world_knowledge")
    if not isinstance(knowledge, list) or not all(isinstance(k, str) for k in knowledge):
        problems.append("'world_knowledge' must be a list of strings (it may be empty)")
    elements = caption.get("prominent_elements")
    last_end = 0.0
    if not isinstance(elements, list) or not elements:
        problems.append("'prominent_elements' must be a non-empty list of objects")
        elements = []
    for i, element in enumerate(elements):
        where = f"'prominent_elements[{i}]'"
        if not isinstance(element, dict):
            problems.append(f"{where} must be an object")
            continue
        for key in ("name", "description"):
            if not _text(element.get(key)):
                problems.append(f"{where}.{key} is missing or empty")
        actions = element.get("actions", [])
        if not video:
            if actions:
                problems.append(f"{where} has actions, but a still image has no timed actions")
            continue
        if not isinstance(actions, list):
            problems.append(f"{where}.actions must be a list")
            continue
        for j, action in enumerate(actions):
            spot = f"{where}.actions[{j}]"
            if not isinstance(action, dict):
                problems.append(f"{spot} must be an object with a timestamp and an action text")
                continue
            if not _text(action.get("action")):
                soft.append(f"{spot} has no 'action' text")
            span = parse_timestamp(action.get("timestamp"))
            if span is None:
                problems.append(f"{spot}.timestamp is {action.get('timestamp')!r}; write it like '[0.0s - 2.5s]'")
                continue
            start, end = span
            if end <= start:
                problems.append(f"{spot} ends ({end:g}s) before it starts ({start:g}s)")
            if end > float(duration) + END_TOLERANCE:
                problems.append(f"{spot} ends at {end:g}s, after the {float(duration):g}s duration")
            last_end = max(last_end, end)
    if video and elements and not problems and abs(last_end - float(duration)) > END_TOLERANCE:
        problems.append(f"the last action ends at {last_end:g}s; the clip lasts {float(duration):g}s, so the last "
                        "action must end exactly at the duration")
    declared = document.get("duration") if "caption" in document else None
    if "caption" in document and video and (not isinstance(declared, (int, float)) or
                                            abs(float(declared) - float(duration)) > END_TOLERANCE):
        problems.append(f"'duration' is {declared!r}; it must be {float(duration):g}")
    return problems, notes


# -- a part of a video caption's timeline ---------------------------------------------------------


def _caption_of(document: Any) -> dict | None:
    caption = document.get("caption", document) if isinstance(document, dict) else None
    return caption if isinstance(caption, dict) else None


def timed_actions(document: Any) -> list[tuple[float, float]]:
    """The (start, end) seconds of every well-formed timed action in a caption document (or a bare
    caption), in element order; empty for a caption without any."""
    caption = _caption_of(document)
    spans = []
    for element in (caption or {}).get("prominent_elements") or []:
        actions = element.get("actions") if isinstance(element, dict) else None
        for action in actions if isinstance(actions, list) else []:
            span = parse_timestamp(action.get("timestamp")) if isinstance(action, dict) else None
            if span is not None:
                spans.append(span)
    return spans


def caption_window(document: Any, start: float, end: float) -> dict[str, Any]:
    """The caption of the clip from `start` to `end` seconds of a longer video's caption: every
    element is kept (its name and description hold for the whole video); its actions are those that
    overlap the window, cut to it and timed from the window's start (0.1 s steps, as timestamps are
    written; an action that rounds to nothing is left out). Returns ``{"caption": ..., "duration":
    end - start}``; the input is not changed."""
    caption = _caption_of(document)
    if caption is None:
        raise ValueError("a caption to split by time must be a JSON object")
    length = round(end - start, 1)
    elements = []
    for element in caption.get("prominent_elements") or []:
        if not isinstance(element, dict):
            continue
        kept = []
        actions = element.get("actions")
        for action in actions if isinstance(actions, list) else []:
            span = parse_timestamp(action.get("timestamp")) if isinstance(action, dict) else None
            if span is None:
                continue
            begin, finish = round(max(span[0], start) - start, 1), round(min(span[1], end) - start, 1)
            if finish > begin:
                kept.append({**action, "timestamp": timestamp(max(begin, 0.0), min(finish, length))})
        elements.append({**element, "actions": kept} if isinstance(actions, list) else dict(element))
    return {"caption": {**caption, "prominent_elements": elements}, "duration": length}
