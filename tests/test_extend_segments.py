"""Extension leftovers: per-segment prompts (lines, a JSON list, a caption's timed actions cut by
segment), the overlap dropped or cross-faded, and ComfyUI's core VIDEO wherever a video goes in."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch

from lingbot_core import caption_schema, stages
from lingbot_core import extend as ext
from lingbot_core.errors import RefusedInput
from tests import test_extend
from tests.test_extend import SIZE, _video

dense = test_extend.dense  # the tiny dense handle and a prompt (a module-scoped fixture)

RUN = dict(steps=2, shift=3.0, guidance_scale=1.0, seed=5)


def _caption(*actions: tuple[float, float, str], duration: float) -> dict:
    return {"caption": {"comprehensive_description": {"scene_content_description": "A dog in a park.",
                                                      "camera_movement_description": "Static camera."},
                        "camera_info": dict(caption_schema.CAMERA_DEFAULTS), "world_knowledge": [],
                        "prominent_elements": [
                            {"name": "dog", "description": "A brown dog.",
                             "actions": [{"timestamp": caption_schema.timestamp(a, b), "action": what}
                                         for a, b, what in actions]},
                            {"name": "bench", "description": "A wooden bench."}]},
            "duration": duration}


def _actions(prompt: str) -> list[tuple[str, str]]:
    elements = json.loads(prompt)["caption"]["prominent_elements"]
    assert elements[1] == {"name": "bench", "description": "A wooden bench."}  # kept whole in every segment
    return [(a["timestamp"], a["action"]) for a in elements[0]["actions"]]


# -- per-segment prompts ------------------------------------------------------------------------------

def test_segment_spans_step_by_the_new_frames():
    spans = ext.segment_spans(3, 121, 1)
    step = (121 - ext.overlap_frames(1)) / ext.MODEL_FPS
    assert spans[0] == (0.0, 120 / ext.MODEL_FPS)
    assert [round(b[0] - a[0], 9) for a, b in zip(spans, spans[1:])] == [round(step, 9)] * 2
    later = ext.segment_spans(2, 121, 2)  # k=2: each segment starts 4(k-1)+1 frames before the last one ends
    assert later[1][0] == pytest.approx(later[0][1] - (ext.overlap_frames(2) - 1) / ext.MODEL_FPS)


def test_a_timed_caption_gives_each_segment_the_actions_in_its_span():
    (_, first_end), (second_start, second_end), (third_start, _end) = ext.segment_spans(3, 121, 1)
    caption = _caption((0, first_end, "walks"), (first_end, second_start + 2, "sniffs"),
                       (second_start + 2, third_start + 5, "runs"), duration=third_start + 5)
    prompts = ext.segment_prompts(json.dumps(caption), segments=3, num_frames=121, k=1)
    length = round(first_end, 1)
    assert [json.loads(p)["duration"] for p in prompts] == [length] * 3
    assert _actions(prompts[0]) == [(caption_schema.timestamp(0, length), "walks")]
    assert _actions(prompts[1]) == [(caption_schema.timestamp(0, 2), "sniffs"),
                                    (caption_schema.timestamp(2, length), "runs")]  # cut at the segment's end
    assert _actions(prompts[2]) == [(caption_schema.timestamp(0, length), "runs")]
    for prompt in prompts:  # each is a video caption of its own segment's length
        assert caption_schema.caption_problems(json.loads(prompt), length, strict=False) == []


def test_a_caption_from_the_caption_node_is_split():
    from lingbot_nodes.caption import LingBotCaption

    out = LingBotCaption.execute("A dog in a park.", "Static camera.", "Warm", "Medium", "Eye level", "Medium",
                                 "Center", "Soft light", "Daylight",
                                 "dog: A brown dog.\n  0-5: walks\n  5-10: sits down", 10.0, 24)
    text = out.args[0] if hasattr(out, "args") else out[0]
    prompts = ext.segment_prompts(text, segments=2, num_frames=121, k=1)
    assert [[a["action"] for a in json.loads(p)["caption"]["prominent_elements"][0]["actions"]] for p in prompts] == \
        [["walks"], ["sits down"]]


def test_a_caption_that_ends_before_a_segment_is_refused_in_one_line():
    caption = _caption((0, 5, "walks"), duration=5)
    with pytest.raises(RefusedInput) as err:
        ext.segment_prompts(json.dumps(caption), segments=2, num_frames=121, k=1)
    assert "segment 2 runs from 5.0 s" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("text, expected", [
    ("", []),
    ("a boat\n\n  a ship \n", ["a boat", "a ship"]),
    ('["a boat", {"caption": {"x": 1}}]', ["a boat", '{"caption":{"x":1}}']),
    (json.dumps(_caption(duration=5)), [json.dumps(_caption(duration=5))]),  # no timed action: one for all
])
def test_lines_lists_and_one_caption(text, expected):
    assert ext.segment_prompts(text, segments=2, num_frames=9, k=1) == expected


@pytest.mark.parametrize("text, words", [("a\nb\nc", "3 lines for 2 segments"),
                                         ('["a", "b", "c"]', "3 list items for 2 segments"),
                                         ('["a", ""]', "non-empty")])
def test_too_many_or_empty_prompts_are_refused(text, words):
    with pytest.raises(RefusedInput, match=words):
        ext.segment_prompts(text, segments=2, num_frames=9, k=1)


def test_the_node_encodes_each_segments_window(dense, monkeypatch):
    from lingbot_nodes.extend import LingBotExtendVideo

    handle, cond = dense
    spans = ext.segment_spans(2, 9, 1)
    caption = json.dumps(_caption((0, round(spans[0][1], 1), "walks"), (round(spans[0][1], 1), 1.0, "sits"),
                                  duration=1.0))
    encoded = []
    real = stages.encode_prompt
    monkeypatch.setattr(stages, "encode_prompt", lambda pipe, text, neg: encoded.append(text) or real(pipe, text, neg))
    LingBotExtendVideo.execute(handle, cond, _video(9), 2, 1, 9, 1, 1.0, 3.0, 1, prompts=caption, save_segments=False)
    assert encoded == ext.segment_prompts(caption, segments=2, num_frames=9, k=1)
    assert [a for _t, a in _actions(encoded[0])] == ["walks"] and [a for _t, a in _actions(encoded[1])] == ["sits"]


def test_headless_flag_and_jobs_field_reach_the_node(tmp_path):
    from lingbot_core.workflow import ApiPrompt, apply_overrides
    from lingbot_nodes import NODE_CLASS_MAPPINGS
    from lingbot_nodes.cli import resolve_workflow, video_overrides
    from lingbot_nodes.jobs import JOB_FIELDS, Job, job_overrides

    path = resolve_workflow("extend")
    nodes = json.loads(path.read_text())
    prompt = ApiPrompt(nodes=nodes, source=str(path))
    extend_id = next(nid for nid, n in nodes.items() if n["class_type"] == "LingBotExtendVideo")
    file = tmp_path / "segments.txt"
    file.write_text("a boat\na ship\n")
    for given, expected in [("a dog\na cat", "a dog\na cat"), (f"@{file}", "a boat\na ship\n")]:
        overrides = video_overrides(prompt, path, video=None, segments=None, segment_prompts=given)
        done = apply_overrides(prompt, overrides, NODE_CLASS_MAPPINGS)
        assert done.nodes[extend_id]["inputs"]["prompts"] == expected
    assert "segment_prompts" in JOB_FIELDS
    job = Job("j", 1, {"segment_prompts": ["a dog", "a cat"]})
    done = apply_overrides(prompt, job_overrides(nodes, job), NODE_CLASS_MAPPINGS)
    assert ext.segment_prompts(done.nodes[extend_id]["inputs"]["prompts"], segments=2, num_frames=9, k=1) == \
        ["a dog", "a cat"]


def test_segment_prompts_on_a_workflow_without_extend_are_refused(tmp_path, capsys):
    from lingbot_nodes.cli import main

    assert main(["t2v", "--output", str(tmp_path), "--segment-prompts", "a\nb"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--segment-prompts given" in err and len(err.splitlines()) == 1


# -- the overlap: dropped or cross-faded ----------------------------------------------------------------

def test_join_drops_or_cross_fades_linearly():
    before = torch.zeros(6, 2, 2, 3)
    segment = torch.ones(9, 2, 2, 3)
    n = ext.overlap_frames(2)
    dropped = ext.join_segment(before, segment, n, "drop")
    blended = ext.join_segment(before, segment, n, "blend")
    assert dropped.shape[0] == blended.shape[0] == 6 + 9 - n
    assert torch.equal(dropped[:6], before) and torch.equal(dropped[6:], segment[n:])
    ramp = blended[6 - n:6, 0, 0, 0]  # old frames 0, segment frames 1: the weights themselves
    assert torch.equal(ramp, ext.to_8bit(torch.arange(1, n + 1) / (n + 1)))
    assert (ramp[1:] - ramp[:-1]).sub(1 / (n + 1)).abs().max() <= 1 / 255  # linear
    assert torch.equal(blended[:6 - n], before[:6 - n]) and torch.equal(blended[6:], segment[n:])
    with pytest.raises(ValueError, match="drop, blend"):
        ext.join_segment(before, segment, n, "fade")


def test_blend_keeps_the_length_and_crossfades_the_redecoded_frames(dense, tmp_path):
    handle, cond = dense
    first = _video(9)
    k, n = 2, ext.overlap_frames(2)
    dropped = ext.extend_video(handle, first, cond, segments=1, k=k, num_frames=9, folder=tmp_path, keep=True, **RUN)
    calls = []
    blended = ext.extend_video(handle, first, cond, segments=1, k=k, num_frames=9, folder=tmp_path,
                               overlap_mode="blend", callback=lambda *a: calls.append(a), **RUN)
    assert calls == []  # the saved segment (all its frames) serves either mode
    assert dropped.shape == blended.shape == (ext.extended_length(9, 1, 9, k), SIZE, SIZE, 3)
    assert torch.equal(blended[:9 - n], first[:9 - n]) and torch.equal(blended[9:], dropped[9:])
    segment = ext.segment_frames(handle, cond, first, k=k, height=SIZE, width=SIZE, num_frames=9, all_frames=True,
                                 **RUN)
    weight = (torch.arange(1, n + 1, dtype=torch.float32) / (n + 1)).view(-1, 1, 1, 1)
    expected = first[-n:] + weight * (segment[:n] - first[-n:])  # one 8-bit level of rounding apart at most
    assert (blended[9 - n:9] - expected).abs().max() <= 0.5 / 255 + 1e-6
    assert not torch.equal(blended[9 - n:9], first[-n:])
    with pytest.raises(ValueError, match="overlap_mode must be one of drop, blend"):
        ext.extend_video(handle, first, cond, segments=1, k=1, num_frames=9, overlap_mode="fade", **RUN)


def test_node_lists_mirror_the_core():
    from lingbot_nodes.extend import OVERLAP_MODES, LingBotExtendVideo

    assert tuple(OVERLAP_MODES) == ext.OVERLAP_MODES
    inputs = LingBotExtendVideo.INPUT_TYPES()
    assert inputs["optional"]["overlap_mode"][1]["default"] == ext.OVERLAP_MODES[0]
    assert list(inputs["optional"])[-1] == "overlap_mode"  # appended last: saved workflows keep their widgets


# -- ComfyUI's core VIDEO -----------------------------------------------------------------------------------

class FakeVideo:
    """ComfyUI's VideoInput as far as the pack reads it: `get_components()` (images [F,H,W,3], audio,
    frame_rate) and the metadata getters."""

    def __init__(self, images: torch.Tensor, rate: float = 24.0, size: tuple[int, int] | None = None,
                 seconds: float | None = None) -> None:
        from lingbot_nodes.v3 import Types

        self.components = Types.VideoComponents(images=images, frame_rate=Fraction(rate), audio=None)
        self.size, self.seconds, self.decoded = size, seconds, 0

    def get_components(self):
        self.decoded += 1
        return self.components

    def get_dimensions(self) -> tuple[int, int]:
        return self.size or (int(self.components.images.shape[2]), int(self.components.images.shape[1]))

    def get_duration(self) -> float:
        return self.seconds if self.seconds is not None else self.components.images.shape[0] / 24.0

    def get_frame_rate(self) -> Fraction:
        return self.components.frame_rate


def test_every_video_input_takes_image_or_video():
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    for node, name in [("LingBotExtendVideo", "video"), ("LingBotDenoise", "video"), ("LingBotRefine", "images")]:
        spec = NODE_CLASS_MAPPINGS[node].INPUT_TYPES()
        kind = (spec["required"].get(name) or spec["optional"][name])[0]
        assert set(kind.split(",")) == {"IMAGE", "VIDEO"}, node


def test_extend_node_takes_a_core_video_as_its_frames(dense):
    from lingbot_nodes.extend import LingBotExtendVideo

    handle, cond = dense
    args = (2, 1, 9, 2, 1.0, 3.0, 1)
    video = FakeVideo(_video(9))
    got = LingBotExtendVideo.execute(handle, cond, video, *args, save_segments=False).args[0]
    want = LingBotExtendVideo.execute(handle, cond, _video(9), *args, save_segments=False).args[0]
    assert video.decoded == 1 and torch.equal(got, want)


def test_denoise_node_takes_a_core_video(dense):
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    handle, cond = dense
    denoise = NODE_CLASS_MAPPINGS["LingBotDenoise"]
    frames = torch.rand(5, SIZE, SIZE, 3, generator=torch.Generator().manual_seed(4))
    got = denoise.execute(handle, cond, SIZE, SIZE, 5, 4, 1.0, 3.0, 7, video=FakeVideo(frames), denoise=0.5)
    want = denoise.execute(handle, cond, SIZE, SIZE, 5, 4, 1.0, 3.0, 7, video=frames, denoise=0.5)
    assert torch.equal(got.args[0]["samples"], want.args[0]["samples"])


@pytest.mark.parametrize("size, seconds, words", [((9000, 16), 1.0, "9000x16"), ((64, 64), 7200.0, "7200 s"),
                                                  ((1920, 1080), 1800.0, "GiB decoded")])
def test_a_video_too_big_to_decode_is_refused_before_decoding(size, seconds, words):
    from lingbot_nodes.video_input import video_frames

    video = FakeVideo(_video(2), size=size, seconds=seconds)
    with pytest.raises(ValueError, match=words) as err:
        video_frames(video)
    assert video.decoded == 0 and "\n" not in str(err.value)


def test_not_a_video_is_refused_in_one_line():
    from lingbot_nodes.video_input import video_frames

    with pytest.raises(ValueError, match="must be frames .IMAGE. or a VIDEO, got str"):
        video_frames("clip.mp4")
    with pytest.raises(ValueError, match=r"frames must be \[F,H,W,3\]"):
        video_frames(FakeVideo(torch.rand(2, 8, 8)))


# -- python -m lingbot_core --extend ---------------------------------------------------------------------

def _frame_count(path) -> int:
    import av

    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))


def test_core_command_extends_a_file(tmp_path, capsys):
    from lingbot_core.__main__ import main as core_main
    from lingbot_core.video import save_mp4

    clip = save_mp4(torch.rand(13, 32, 32, 3, generator=torch.Generator().manual_seed(4)), tmp_path / "in.mp4")
    out = tmp_path / "out"
    assert core_main(["--output", str(out), "--quiet", "--extend", str(clip), "--segments", "2", "--steps", "1",
                      "--cfg", "1", "--overlap-mode", "blend", "--segment-prompts", "a dog\na cat"]) == 0
    made = capsys.readouterr().out.strip().splitlines()[-1]
    assert _frame_count(made) == ext.extended_length(13, 2, 9, 1)  # the tiny default: 9-frame segments
    assert not any((out / "lingbot" / "extend_segments").iterdir())  # finished: no segment files left
    for argv, words in [(["--extend", str(clip), "--video", str(clip)], "leave out --video"),
                        (["--extend", str(clip), "--mode", "ti2v", "--image", "x.png"], "leave out --image, --mode ti2v"),
                        (["--segments", "2"], "--segments belong to extending a video"),
                        (["--overlap-mode", "blend"], "add --extend VIDEO"),
                        (["--extend", str(clip), "--overlap-mode", "fade"], "--overlap-mode must be one of drop, blend"),
                        (["--extend", str(clip), "--k", "3"], "--extend: overlap (condition latent frames k)"),
                        (["--extend", str(tmp_path / "none.mp4")], "--extend: cannot read 'none.mp4'"),
                        (["--extend", str(clip), "--segments", "2", "--segment-prompts", "a\nb\nc"], "3 lines for 2"),
                        (["--extend", str(clip), "--segment-prompts", f"@{tmp_path / 'none.txt'}"], "cannot read it")]:
        assert core_main(["--output", str(out), "--quiet", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_seam_bench_quick(capsys):
    """bench/extend_seam.py at its smallest: one row per k and overlap mode, the joined lengths, and the
    steps it measures."""
    from bench import extend_seam

    threads = torch.get_num_threads()
    try:
        result = extend_seam.main(["--quick", "--threads", "1", "--steps", "1", "--segments", "1"])
    finally:
        torch.set_num_threads(threads)
    rows = result["rows"]
    assert [(r["k"], r["mode"]) for r in rows] == [(k, m) for k in (1, 2) for m in ext.OVERLAP_MODES]
    assert [r["frames"] for r in rows] == [ext.extended_length(9, 1, 9, r["k"]) for r in rows]
    assert all(r["seam"] > 0 and r["inner"] > 0 and r["input"] > 0 for r in rows)
    assert "seam / inner" in capsys.readouterr().out
