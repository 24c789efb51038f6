"""LingBot Caption: the structured caption, its checks, the 4n+1 frame count; Text Encode's prose warning."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from lingbot_core.prompt import caption_to_text
from lingbot_core.workflow import Engine, WorkflowValidationError
from lingbot_nodes import NODE_CLASS_MAPPINGS
from lingbot_nodes.caption import CAMERA_FIELDS, LingBotCaption, frames_for

# A checkout of the reference repository (LINGBOT_REF_DIR), for its example captions; skipped without one.
REF_CASES = Path(os.environ.get("LINGBOT_REF_DIR") or "/nonexistent") / "assets" / "cases"


def _caption(**overrides):
    schema = LingBotCaption.define_schema()
    values = {i.id: i.default if i.default is not None else i.options[0] for i in schema.inputs}
    values.update(overrides)
    return values


def test_frames_follow_the_reference_rule():
    assert frames_for(5, 24) == 121  # the reference docs' 5 s at 24 fps
    assert frames_for(0, 24) == 1
    for seconds in (0.2, 1, 2.5, 3.3, 10):
        frames = frames_for(seconds, 24)
        assert (frames - 1) % 4 == 0 and frames >= seconds * 24 and frames - seconds * 24 < 5


def test_caption_has_the_reference_shape_and_text_encode_reads_it():
    text, frames = LingBotCaption.execute(**_caption(
        elements="boat: A red paper boat.\n  0-2.5: drifts forward\n  2.5-5: turns\nbridge: An arched bridge.",
        duration=5.0, fps=24)).args
    data = json.loads(text)
    assert set(data) == {"caption", "duration"} and data["duration"] == 5 and frames == 121
    caption = data["caption"]
    assert set(caption) == {"comprehensive_description", "camera_info", "world_knowledge", "prominent_elements"}
    assert set(caption["camera_info"]) == set(CAMERA_FIELDS)
    boat, bridge = caption["prominent_elements"]
    assert boat["actions"] == [{"timestamp": "[0.0s - 2.5s]", "action": "drifts forward"},
                               {"timestamp": "[2.5s - 5.0s]", "action": "turns"}]
    assert bridge == {"name": "bridge", "description": "An arched bridge."}
    # What the encoder sees is the compact caption, exactly as for a reference prompt file.
    assert caption_to_text(text) == json.dumps(caption, ensure_ascii=False, separators=(",", ":"))


@pytest.mark.skipif(not REF_CASES.is_dir(), reason="needs the reference repository's example cases (set LINGBOT_REF_DIR to its checkout)")
def test_caption_keys_match_the_reference_examples():
    example = json.loads(next(REF_CASES.glob("t2v/*/prompt.json")).read_text())
    ours = json.loads(LingBotCaption.execute(**_caption()).args[0])
    assert set(ours) == set(example)
    assert set(ours["caption"]) <= set(example["caption"])
    assert set(ours["caption"]["camera_info"]) == set(example["caption"]["camera_info"])
    assert set(ours["caption"]["comprehensive_description"]) == set(example["caption"]["comprehensive_description"])


def test_still_image_caption_has_no_timing():
    text, frames = LingBotCaption.execute(**_caption(elements="teapot: Round, blue glaze.", duration=0.0)).args
    data = json.loads(text)
    assert frames == 1 and data["duration"] is None
    assert isinstance(data["caption"]["comprehensive_description"], str)  # the model's image shape


def _validate(**overrides):
    prompt = {"1": {"class_type": "LingBotCaption", "inputs": _caption(**overrides)},
              "2": {"class_type": "LingBotMemoryReport", "inputs": {"pipe": ["3", 0], "value": ["1", 0]}},
              "3": {"class_type": "LingBotLoader", "inputs": {"checkpoint": "tiny (built-in dense)", "variant": "auto",
                                                             "dtype": "auto", "attention": "default"}}}
    Engine(NODE_CLASS_MAPPINGS).validate(prompt)


def test_bad_elements_are_refused_on_that_input_and_late_actions_when_the_node_runs():
    _validate(elements="boat: b\n  0-5: drifts", duration=5.0)
    with pytest.raises(WorkflowValidationError) as err:
        _validate(elements="boat: b\n  drifts without a time", duration=5.0)
    assert [i.input_name for i in err.value.issues] == ["elements"] and "line 2" in err.value.issues[0].message
    with pytest.raises(ValueError, match=r"duration: the last action ends at 6.5 s, after the 5 s duration"):
        LingBotCaption.execute(**_caption(elements="boat: b\n  0-3: drifts\n  3-6.5: turns", duration=5.0))


def test_text_encode_warns_once_on_prose(caplog, monkeypatch):
    from lingbot_nodes import conditioning

    monkeypatch.setattr(conditioning, "_warned_prose", False)
    with caplog.at_level(logging.WARNING, logger="lingbot_nodes"):
        assert conditioning.warn_if_prose("a boat on a canal")
        assert conditioning.warn_if_prose("another plain prompt")
        assert not conditioning.warn_if_prose('{"caption": {}}')
    assert sum("structured JSON" in r.message for r in caplog.records) == 1
