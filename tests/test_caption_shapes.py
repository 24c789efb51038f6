"""Captions in the model's own shapes: video, and the image (t2i) shape with its own value lists.

The check runs on every shipped workflow's caption and on the reference's example captions, whose
structure (field names, camera values, timestamps, which actions have text) is recorded in
``fixtures/caption_shapes/upstream_examples.json`` with the prose replaced by placeholders.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lingbot_core.caption_schema import (
    CAMERA_FIELDS,
    IMAGE_CAMERA_DEFAULTS,
    IMAGE_CAMERA_FIELDS,
    caption_notes,
    caption_problems,
)
from lingbot_core.rewrite import instructions
from lingbot_nodes.caption import CAMERA_CHOICES, LingBotCaption

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = json.loads((Path(__file__).parent / "fixtures" / "caption_shapes" / "upstream_examples.json").read_text())
REF_CASES = Path(os.environ.get("LINGBOT_REF_DIR") or "/nonexistent") / "assets" / "cases"


def _duration(document: dict, task: str) -> float | None:
    return None if task == "t2i" else document.get("duration")


def _shipped_captions() -> list[tuple[str, str, dict]]:
    found = []
    for path in sorted((ROOT / "workflows" / "api").glob("*.json")):
        for node in json.loads(path.read_text()).values():
            prompt = node["inputs"].get("prompt") if node.get("class_type") == "LingBotTextEncode" else None
            if isinstance(prompt, str) and prompt.lstrip().startswith("{"):
                found.append((path.stem, node["inputs"]["task"], json.loads(prompt)))
    return found


def test_every_shipped_caption_passes_the_strict_check():
    captions = _shipped_captions()
    assert {task for _, task, _ in captions} >= {"t2v", "t2i", "ti2v"}
    for name, task, document in captions:
        duration = _duration(document, task)
        assert task == "t2i" or duration, f"{name}: a video caption states its duration"
        assert caption_problems(document, duration) == [], name
        assert caption_notes(document, duration) == [], name
    still = [doc for _, task, doc in captions if task == "t2i"]
    assert all(isinstance(doc["caption"]["comprehensive_description"], str) for doc in still)


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_upstream_example_captions_are_accepted_with_notes_at_most(name):
    document = UPSTREAM[name]
    task = name.split("/")[0]
    assert caption_problems(document, _duration(document, task), strict=False) == []


def test_image_examples_keep_the_image_lists_and_off_list_values_are_notes():
    for name, document in UPSTREAM.items():
        if name.startswith("t2i/"):
            assert caption_problems(document, None) == [] and caption_notes(document, None) == []
    # The reference's own first-frame examples use values outside the video lists and actions without text:
    # a user's caption may, the rewriter's own output may not.
    for name, values in {"ti2v/example_1": ("Macro", "Studio lighting", "no 'action' text"),
                         "ti2v/example_2": ("White",), "t2v/example_3": ("camera_movement_description",), "ti2v/example_4": ("Natural", "Bright sunlight")}.items():
        document = UPSTREAM[name]
        notes = caption_notes(document, document["duration"])
        strict = caption_problems(document, document["duration"])
        for value in values:
            assert any(value in note for note in notes) and any(value in p for p in strict), (name, value)


def test_image_lists_are_their_own():
    assert "White" in IMAGE_CAMERA_FIELDS["color"] and "White" not in CAMERA_FIELDS["color"]
    assert set(IMAGE_CAMERA_FIELDS) == set(CAMERA_FIELDS)
    assert all(IMAGE_CAMERA_DEFAULTS[f] in IMAGE_CAMERA_FIELDS[f] for f in IMAGE_CAMERA_FIELDS)
    still = UPSTREAM["t2i/example_6"]
    dutch = json.loads(json.dumps(still))
    dutch["caption"]["camera_info"]["shot_type_angle"] = "Dutch angle"  # a video value, not an image one
    assert any("shot_type_angle" in p for p in caption_problems(dutch, None))
    assert caption_problems(dutch, None, strict=False) == []


def test_shape_follows_the_kind():
    video, still = UPSTREAM["t2v/example_3"], UPSTREAM["t2i/example_1"]
    # The image shape for a video is refused in either mode.
    assert any("not an object" in p for p in caption_problems(still, 5.0, strict=False))
    # The video shape for a still image: a user's is read (note), the rewriter's own is refused.
    as_still = json.loads(json.dumps(video))
    for element in as_still["caption"]["prominent_elements"]:
        element.pop("actions")
    assert caption_problems(as_still, None, strict=False) == []
    assert any("one string" in n for n in caption_notes(as_still, None))
    assert any("one string" in p for p in caption_problems(as_still, None))
    # Missing camera fields stay problems for a user's caption too.
    bare = json.loads(json.dumps(still))
    del bare["caption"]["camera_info"]["lighting"]
    assert any("camera_info.lighting" in p for p in caption_problems(bare, None, strict=False))


def test_rewriter_shapes_pass_the_strict_check():
    for task, duration in (("t2i", 0.0), ("t2v", 5.0)):
        shape = json.loads(instructions._example(task, duration))
        assert caption_problems(shape, duration or None) == [], task
        system, _ = instructions.map_messages("A teapot.", task, duration)
        colours = (IMAGE_CAMERA_FIELDS if task == "t2i" else CAMERA_FIELDS)["color"]
        assert "- color: " + " | ".join(colours) + "\n" in system, task
    assert isinstance(json.loads(instructions._example("t2i", 0.0))["caption"]["comprehensive_description"], str)


def _node(**overrides):
    values = {i.id: i.default for i in LingBotCaption.define_schema().inputs}
    values.update(overrides)
    return values


def test_caption_node_writes_the_image_shape_and_holds_each_kind_to_its_list():
    assert CAMERA_CHOICES["color"][-1] == "White"
    text, frames = LingBotCaption.execute(**_node(elements="teapot: Round, blue glaze.", duration=0.0,
                                                  color="White")).args
    document = json.loads(text)
    assert frames == 1 and isinstance(document["caption"]["comprehensive_description"], str)
    assert caption_problems(document, None) == []
    with pytest.raises(ValueError, match="color: 'White' is not a color value for a video"):
        LingBotCaption.execute(**_node(color="White"))
    with pytest.raises(ValueError, match="shot_type_angle: 'Dutch angle' is not a shot_type_angle value for a still"):
        LingBotCaption.execute(**_node(elements="teapot: Round.", duration=0.0, shot_type_angle="Dutch angle"))
    assert caption_problems(json.loads(LingBotCaption.execute(**_node()).args[0]), 5.0) == []


@pytest.mark.skipif(not REF_CASES.is_dir(), reason="needs the reference repository's example cases (LINGBOT_REF_DIR)")
def test_every_reference_example_caption_is_accepted():
    for path in sorted(REF_CASES.glob("*/*/prompt.json")):
        document = json.loads(path.read_text())
        task = path.parent.parent.name
        assert caption_problems(document, _duration(document, task), strict=False) == [], path


def test_text_encode_reads_a_users_caption_as_written_with_a_note_at_most(fixtures_root):
    from lingbot_core.handle import PipelineHandle
    from lingbot_nodes.conditioning import LingBotTextEncode, caption_note

    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    off_list = json.dumps(UPSTREAM["ti2v/example_4"])  # 'Natural', 'Bright sunlight': the reference's own values
    out = LingBotTextEncode.execute(handle, off_list, encode_negative=False)
    (text,) = out.ui.as_dict()["text"]
    assert "used as written" in text and "'Natural'" in text and "'Bright sunlight'" in text
    for _, task, document in _shipped_captions():
        assert caption_note(json.dumps(document), task) is None
    assert caption_note(json.dumps(UPSTREAM["t2i/example_1"]), "t2i") is None
    assert caption_note("a boat on a canal", "t2v") is None and caption_note("{not json", "t2v") is None
