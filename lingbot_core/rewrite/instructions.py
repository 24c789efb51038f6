"""What the rewriter asks a model, in two stages: expand the request, then map it onto the caption schema.

Our own wording, built from the schema facts in :mod:`lingbot_core.caption_schema` (the field list,
the camera vocabulary, the timestamp format, the rule that the last action ends at the duration).
Change :data:`VERSION` whenever a text here changes: it is part of the cache key.
"""

from __future__ import annotations

import json
from typing import Any

from ..caption_schema import CAMERA_DEFAULTS, IMAGE_CAMERA_DEFAULTS, RELATIVE_SIZES, camera_fields, timestamp

VERSION = "1"
TASKS = ("t2v", "ti2v", "t2i")
"""What the caption is for: text to video, first frame + text to video, text to image."""


def _seconds(duration: float) -> str:
    return f"{duration:g} seconds"


def expand_messages(prompt: str, task: str, duration: float) -> tuple[str, str]:
    """(system, user) for stage 1: one detailed paragraph, in time order for video."""
    if task == "t2i":
        system = ("You turn a short request for a still picture into one detailed English paragraph for an image "
                  "generator. Describe what is visible: every subject with its look, colour, material and place in "
                  "the frame; the setting; the light; the framing and lens. Keep everything the request asks for "
                  "and invent nothing that contradicts it. Write the paragraph only, no headings and no lists.")
        return system, f"Request: {prompt}"
    frame = ("An image is attached: it is the exact first frame of the clip. Start from what it shows (subjects, "
             "setting, light, framing) and describe how the scene moves on from it. " if task == "ti2v" else "")
    system = ("You turn a short request for a video clip into one detailed English paragraph for a video "
              "generator. " + frame + "Name each subject with its look, colour and material; the setting; the "
              "light; the framing, lens and how the camera moves. Then tell what happens in time order, giving "
              "each event a span in seconds from the clip start, and let the events fill the whole clip. Keep "
              "everything the request asks for and invent nothing that contradicts it. Write the paragraph "
              "only, no headings and no lists, under 1000 characters.")
    return system, f"Request: {prompt}\nClip length: {_seconds(duration)}."


def _example(task: str, duration: float) -> str:
    """The caption's shape with placeholders: the video shape, or the model's image shape (the
    description one string, elements placed and sized in the frame)."""
    video = task != "t2i"
    half = round(duration / 2, 1)
    element: dict = {"name": "<short name>", "description": "<look, colour, material>"}
    if video:
        element["actions"] = [{"timestamp": timestamp(0.0, half), "action": "<what it does>"},
                              {"timestamp": timestamp(half, duration), "action": "<what it does next>"}]
        description: Any = {"scene_content_description": "<the scene: subjects, setting, light, atmosphere>",
                            "camera_movement_description": "<how the camera moves over the clip>"}
    else:
        element.update(location="<where it sits in the frame>", relative_size=RELATIVE_SIZES[2])
        description = "<one paragraph on the whole picture: subjects, their look and arrangement, setting, light>"
    caption = {"comprehensive_description": description,
               "camera_info": dict(CAMERA_DEFAULTS if video else IMAGE_CAMERA_DEFAULTS),
               "world_knowledge": ["<a fact the picture relies on, or none>"], "prominent_elements": [element]}
    return json.dumps({"caption": caption, "duration": duration if video else None}, ensure_ascii=False)


def map_messages(detail: str, task: str, duration: float) -> tuple[str, str]:
    """(system, user) for stage 2: the detailed text as one caption JSON object."""
    video = task != "t2i"
    vocabulary = "\n".join(f"- {field}: {' | '.join(values)}" for field, values in camera_fields(video).items())
    rules = [
        "Reply with one JSON object and nothing else: no code fence, no comment before or after it.",
        "Take every fact from the description; where it is silent about a camera_info field, choose the value "
        "that fits the scene best.",
        "camera_info holds exactly these seven fields, each one value copied from its list:\n" + vocabulary,
        "world_knowledge is a list of short strings (it may be empty).",
        "prominent_elements lists every important subject or object: name and description.",
    ]
    if video:
        rules += [
            "Each element has an actions list; each action has a timestamp written like "
            f"\"{timestamp(0.0, 0.5)}\" (seconds from the clip start, one decimal) and an action text.",
            f"Every action lies within 0 to {duration:g} seconds and the last action ends exactly at {duration:g}s.",
            f"duration is {duration:g}.",
        ]
    else:
        rules += ["This is a still image: comprehensive_description is one string (not an object), no camera "
                  "movement, no actions, duration null.",
                  "Each element also has a location in the frame and a relative_size, one of: "
                  + " | ".join(RELATIVE_SIZES) + "."]
    system = ("You write structured captions for a " + ("video" if video else "image") + " generator. "
              "Turn the description you are given into the caption JSON shown below.\n\nShape:\n"
              + _example(task, duration) + "\n\nRules:\n" + "\n".join(f"{i}. {r}" for i, r in enumerate(rules, 1)))
    user = f"Description:\n{detail}\n" + (f"Clip length: {_seconds(duration)}.\n" if video else "") + "JSON:"
    return system, user


def repair_messages(detail: str, task: str, duration: float, produced: str,
                    problems: list[str]) -> tuple[str, str]:
    """(system, user) for the one repair pass: the stage-2 rules, what was produced, what is wrong."""
    system, _ = map_messages(detail, task, duration)
    listing = "\n".join(f"- {p}" for p in problems)
    user = (f"Description:\n{detail}\n\nYour previous JSON:\n{produced}\n\nIt has these problems:\n{listing}\n\n"
            "Write the corrected JSON object only.")
    return system, user
