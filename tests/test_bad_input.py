"""Bad input gets a clear error before any node runs: workflow values, links and messages.

Each test reproduces one class found by the adversarial probe (issue 12, items 6 and 9).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import workflow_fakes as fakes
from PIL import Image

from lingbot_core import stage_inputs as checks
from lingbot_core import stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.prompt import PromptEmbeds, caption_to_text
from lingbot_core.workflow import Engine, WorkflowValidationError, load_workflow
from lingbot_core.workflow.cache import SignatureBuilder
from lingbot_nodes import NODE_CLASS_MAPPINGS

API = Path(__file__).resolve().parents[1] / "workflows" / "api"
T2V = json.loads((API / "lingbot_t2v_dense.json").read_text())


def _node_of(prompt: dict, class_type: str) -> str:
    return next(nid for nid, n in prompt.items() if n["class_type"] == class_type)


def _invalid(prompt: dict) -> WorkflowValidationError:
    outputs = [nid for nid, n in prompt.items() if n["class_type"] in ("LingBotSaveVideo", "LingBotRelease",
                                                                        "LingBotMemoryReport")]
    with pytest.raises(WorkflowValidationError) as info:
        Engine(NODE_CLASS_MAPPINGS).validate(copy.deepcopy(prompt), outputs=outputs)
    return info.value


def test_constant_for_a_link_only_input_is_refused():
    prompt = copy.deepcopy(T2V)
    denoise = _node_of(prompt, "LingBotDenoise")
    prompt[denoise]["inputs"]["pipe"] = "../../somewhere"
    err = _invalid(prompt)
    assert any(i.node_id == denoise and i.input_name == "pipe" and "must be connected" in i.message
               for i in err.issues), str(err)


def test_constant_for_an_any_type_input_is_refused():
    prompt = copy.deepcopy(T2V)
    prompt["90"] = {"class_type": "LingBotRelease", "inputs": {"pipe": ["2", 0], "value": 5, "what": "all"}}
    err = _invalid(prompt)
    assert any(i.node_id == "90" and i.input_name == "value" for i in err.issues), str(err)


@pytest.mark.parametrize("value", [["1", 0], 7])
def test_undeclared_inputs_are_refused(value):
    prompt = copy.deepcopy(T2V)
    denoise = _node_of(prompt, "LingBotDenoise")
    prompt[denoise]["inputs"]["stepz"] = value
    err = _invalid(prompt)
    assert any(i.input_name == "stepz" and "no input of this name" in i.message for i in err.issues), str(err)


def test_hidden_inputs_cannot_be_set_by_the_workflow():
    prompt = copy.deepcopy(T2V)
    save = _node_of(prompt, "LingBotSaveVideo")
    prompt[save]["inputs"]["prompt"] = {"forged": True}
    err = _invalid(prompt)
    assert any(i.input_name == "prompt" and "hidden" in i.message for i in err.issues), str(err)


@pytest.mark.parametrize("class_type", ["LingBotRelease", "LingBotMemoryReport"])
def test_release_and_memory_report_keep_the_engines_checks(class_type):
    prompt = copy.deepcopy(T2V)
    inputs = {"pipe": ["2", 0], "value": ["4", 0]}
    if class_type == "LingBotRelease":
        inputs["what"] = "everything please"  # not one of the combo's options
    else:
        inputs["pipe"] = ["4", 0]  # a LATENT into a LINGBOT_PIPE input
    prompt["90"] = {"class_type": class_type, "inputs": inputs}
    err = _invalid(prompt)
    assert any(i.node_id == "90" for i in err.issues), str(err)


def test_wrong_link_type_into_release_value_is_fine_but_pipe_is_checked():
    prompt = copy.deepcopy(T2V)
    prompt["90"] = {"class_type": "LingBotRelease", "inputs": {"pipe": ["2", 0], "value": ["4", 0], "what": "all"}}
    Engine(NODE_CLASS_MAPPINGS).validate(copy.deepcopy(prompt), outputs=["90"])  # any type into `value`
    prompt["90"]["inputs"]["pipe"] = ["4", 0]
    err = _invalid(prompt)
    assert any(i.input_name == "pipe" and "type mismatch" in i.message for i in err.issues), str(err)


def test_messages_do_not_echo_huge_values():
    prompt = copy.deepcopy(T2V)
    denoise = _node_of(prompt, "LingBotDenoise")
    prompt[denoise]["inputs"]["seed"] = "9" * 200_000 + "x"
    prompt[denoise]["inputs"]["stepz"] = "y" * 200_000
    prompt["x" * 100_000] = {"class_type": "z" * 100_000, "inputs": {}}
    err = _invalid(prompt)
    assert len(str(err)) < 5_000
    assert "more characters" in str(err) or "..." in str(err)


def test_an_integer_too_long_to_print_is_reported_not_raised():
    prompt = copy.deepcopy(T2V)
    denoise = _node_of(prompt, "LingBotDenoise")
    prompt[denoise]["inputs"]["steps"] = 10 ** 5000
    err = _invalid(prompt)
    assert any(i.input_name == "steps" and "digits" in i.message for i in err.issues), str(err)


def test_many_issues_are_counted_but_listed_briefly():
    prompt = copy.deepcopy(T2V)
    denoise = _node_of(prompt, "LingBotDenoise")
    for i in range(500):
        prompt[denoise]["inputs"][f"extra{i}"] = i
    err = _invalid(prompt)
    assert len(err.issues) >= 500 and "more" in str(err) and len(str(err)) < 20_000


def test_signatures_are_linear_in_chain_length(monkeypatch):
    """A 2,000-node chain: each node's sources are read a bounded number of times (it was quadratic)."""
    n = 2000
    prompt = {"0": {"class_type": "Number", "inputs": {"value": 1}}}
    for i in range(1, n):
        prompt[str(i)] = {"class_type": "Add", "inputs": {"a": [str(i - 1), 0], "b": [str(i - 1), 0]}}
    prompt[str(n)] = {"class_type": "Show", "inputs": {"value": [str(n - 1), 0]}}
    calls = 0
    original = SignatureBuilder._linked_sources

    def counting(self, node_id):
        nonlocal calls
        calls += 1
        return original(self, node_id)

    monkeypatch.setattr(SignatureBuilder, "_linked_sources", counting)
    engine = Engine(fakes.REGISTRY)
    keys = engine._signatures(engine._plan(prompt, None))
    assert len(set(keys.values())) == n + 1  # every node distinct
    assert calls <= 2 * (n + 1), calls


def test_equal_subgraphs_share_a_signature_and_differences_propagate():
    def chain(value: int) -> dict:
        return {"0": {"class_type": "Number", "inputs": {"value": value}},
                "1": {"class_type": "Add", "inputs": {"a": ["0", 0], "b": ["0", 0]}},
                "2": {"class_type": "Show", "inputs": {"value": ["1", 0]}}}

    engine = Engine(fakes.REGISTRY)
    a = engine._signatures(engine._plan(chain(1), None))
    b = engine._signatures(engine._plan(chain(1), None))
    c = engine._signatures(engine._plan(chain(2), None))
    assert a == b
    assert all(a[k] != c[k] for k in a)


def test_a_workflow_file_with_bad_link_shapes_names_the_json_path(tmp_path):
    from workflows import build

    ui = json.loads(build.ui_path("lingbot_t2v_dense").read_text())
    ui["links"][0] = [1, 2]  # too short
    path = tmp_path / "w.json"
    path.write_text(json.dumps(ui))
    with pytest.raises(Exception) as info:
        load_workflow(path, NODE_CLASS_MAPPINGS)
    assert "links[0]" in str(info.value) and str(path) in str(info.value)
    assert type(info.value).__name__ == "WorkflowError"


# -- stage inputs (items 4, 7, 9): a clear ValueError before any model work -------------------------


SMALL = dict(height=32, width=32, num_frames=5, steps=2)


@pytest.fixture
def dense_handle(fixtures_root):
    return PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")


@pytest.fixture
def moe_handle(fixtures_root):
    return PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")


def _cond() -> stages.Conditioning:
    embeds = PromptEmbeds(torch.zeros(1, 4, 32), torch.ones(1, 4, dtype=torch.int64), torch.zeros(1, 4))
    return stages.Conditioning(embeds, embeds, prompt="a boat")


@pytest.mark.parametrize("overrides,pattern", [
    (dict(seed=True), "seed must be an integer"),
    (dict(seed=-1), "seed must be an integer"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(seed=2 ** 64), "seed must be an integer"),
    (dict(shift=float("nan")), "shift must be a positive number"),
    (dict(shift=0.0), "shift must be a positive number"),
    (dict(negative_prompt=5), "negative_prompt must be a string"),
    (dict(negative_prompt={"a": 1}), "negative_prompt must be a string"),
    (dict(height=4096, width=4096, num_frames=1025), r"GiB.*limit"),  # the largest the limits allow
    (dict(height=4096, width=4096, num_frames=513), r"GiB.*limit"),
    (dict(height=16384, width=16384, num_frames=1025), r"height must be at most"),  # stage_inputs.LIMITS
    (dict(height=4096, width=4096, num_frames=4097), r"num_frames must be at most"),
])
def test_generate_refuses_before_any_model_work(dense_handle, overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        stages.generate(dense_handle, "a boat", **{**SMALL, **overrides})
    assert not dense_handle.shared.loaded, "a component loaded before the input was refused"


def test_the_size_limit_names_what_fits(dense_handle):
    with pytest.raises(ValueError) as info:
        stages.generate(dense_handle, "a boat", height=4096, width=4096, num_frames=1025, steps=2)
    assert "fits" in str(info.value) or "fewer frames" in str(info.value)


@pytest.mark.parametrize("prompt", [{"caption": None}, {"caption": 5}, {"caption": True}, '{"caption": null}'])
def test_a_caption_that_is_not_text_is_refused(dense_handle, prompt):
    with pytest.raises(ValueError, match="caption"):
        caption_to_text(prompt)
    with pytest.raises(ValueError, match="caption"):
        stages.generate(dense_handle, prompt, **SMALL)
    assert not dense_handle.shared.loaded


@pytest.mark.parametrize("image,pattern", [
    (Image.new("RGB", (0, 0)), "at least one pixel"),
    (torch.zeros(1, 0, 32, 3), "empty"),
    (np.zeros((0, 0, 3), dtype=np.uint8), "empty"),
    (torch.full((32, 32, 3), float("nan")), "NaN"),
    (torch.full((32, 32, 3), 200.0), "0..255"),
    (torch.full((32, 32, 3), -3.0), r"\[0, 1\]"),
    (torch.full((32, 32, 3), 300, dtype=torch.int64), r"\[0, 255\]"),
    (torch.ones(32, 32, 3, dtype=torch.bool), "not an image"),
    (np.array([[object()]]), "not an image"),
])
def test_bad_first_frames_are_refused_before_loading(dense_handle, image, pattern):
    with pytest.raises(ValueError, match=pattern):
        stages.generate(dense_handle, "a boat", mode="ti2v", image=image, **SMALL)
    assert not dense_handle.shared.loaded


def test_integer_0_255_pixels_are_read_as_0_255_not_clamped_white():
    from lingbot_core.image import load_image

    pixels = torch.full((8, 8, 3), 100, dtype=torch.int64)
    picture = load_image(checks.checked_image(pixels))
    assert np.asarray(picture)[0, 0].tolist() == [100, 100, 100]


def test_raw_pixels_for_text_encode_are_checked_before_the_encoder_loads(dense_handle):
    pixels = torch.full((1, 3, 1, 32, 32), float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        stages.encode_prompt(dense_handle, "a boat", image=pixels, mode="ti2v")
    with pytest.raises(ValueError, match=r"\(1,3,1,H,W\)"):
        stages.encode_prompt(dense_handle, "a boat", image=torch.zeros(3, 32, 32), mode="ti2v")
    with pytest.raises(ValueError, match="negative_prompt"):
        stages.encode_prompt(dense_handle, "a boat", 42)
    assert not dense_handle.shared.loaded


@pytest.mark.parametrize("latents,pattern", [
    (torch.zeros(1, 15, 2, 4, 4), r"\(1,16,T,h,w\)"),
    (torch.zeros(1, 16, 0, 4, 4), r"T, h, w >= 1"),
    (torch.zeros(16, 2, 4, 4), r"\(1,16,T,h,w\)"),
    (torch.full((1, 16, 2, 4, 4), float("nan")), "NaN"),
    (torch.zeros(1, 16, 2, 4, 4, dtype=torch.int64), "floating point"),
    (torch.zeros(1, 16, 1, 1, 1).expand(1, 16, 4097, 2048, 2048), r"GiB.*limit"),
    ("latents", "must be a tensor"),
])
def test_bad_latents_are_refused_before_the_vae_loads(dense_handle, latents, pattern):
    for decode in (stages.decode, stages.decode_vae_latents):
        with pytest.raises(ValueError, match=pattern):
            decode(dense_handle, latents)
    assert not dense_handle.shared.loaded


def test_denoise_checks_given_latents_and_sizes_before_the_dit_loads(dense_handle):
    shape = (1, 16, 2, 4, 4)
    with pytest.raises(ValueError, match="NaN"):
        stages.denoise(dense_handle, _cond(), **SMALL, seed=1, latents=torch.full(shape, float("nan")))
    with pytest.raises(ValueError, match="cond_latent"):
        stages.denoise(dense_handle, _cond(), **SMALL, seed=1, cond_latent=torch.zeros(1, 16, 1, 3, 3))
    with pytest.raises(ValueError, match=r"GiB.*limit"):
        stages.denoise(dense_handle, _cond(), height=4096, width=4096, num_frames=1025, steps=2, seed=1)
    with pytest.raises(ValueError, match="seed"):
        stages.denoise(dense_handle, _cond(), **SMALL, seed=True)
    assert not dense_handle.shared.loaded


def test_refine_on_a_dense_handle_refuses_before_releasing_the_base(dense_handle):
    sentinel = torch.nn.Linear(1, 1)
    dense_handle.shared.loaded["transformer"] = sentinel
    frames = torch.rand(5, 32, 32, 3)
    with pytest.raises(ValueError, match="refiner"):
        stages.refine(dense_handle, frames, _cond(), release_base=True)
    assert dense_handle.shared.loaded.get("transformer") is sentinel, "the base was dropped before the refusal"


@pytest.mark.parametrize("overrides,pattern", [
    (dict(t_thresh=float("nan")), "t_thresh"),
    (dict(tail_steps=-1), "tail_steps"),
    (dict(seed=True), "seed"),
    (dict(shift=float("nan")), "shift"),
    (dict(height=40), "multiples of 16"),
    (dict(first_frame=Image.new("RGB", (0, 0))), "first_frame"),
])
def test_refine_arguments_are_checked_before_anything_is_released(moe_handle, overrides, pattern):
    sentinel = torch.nn.Linear(1, 1)
    moe_handle.shared.loaded["transformer"] = sentinel
    frames = torch.rand(5, 32, 32, 3)
    with pytest.raises(ValueError, match=pattern):
        stages.refine(moe_handle, frames, _cond(), **{"height": 32, "width": 32, **overrides}, release_base=True)
    assert moe_handle.shared.loaded.get("transformer") is sentinel
    assert "refiner" not in moe_handle.shared.loaded


def test_refine_frames_must_be_pixels(moe_handle):
    for frames, pattern in ((torch.full((5, 32, 32, 3), float("nan")), "NaN"),
                            (torch.full((5, 32, 32, 3), 255.0), "0..255")):
        with pytest.raises(ValueError, match=pattern):
            stages.refine(moe_handle, frames, _cond(), height=32, width=32)
    assert not moe_handle.shared.loaded


def test_an_over_long_caption_is_cut_with_a_warning(fixtures_root, caplog):
    from lingbot_core.checkpoints.loading import load_component
    from lingbot_core.prompt import MAX_TEXT_TOKENS, build_text_inputs

    processor = load_component(fixtures_root / "models" / "tiny-dense", "processor")
    with caplog.at_level("WARNING", logger="lingbot_core.prompt"):
        inputs = build_text_inputs(processor, "boat " * (MAX_TEXT_TOKENS + 100))
    assert inputs["input_ids"].shape[-1] == MAX_TEXT_TOKENS
    assert any("cut at" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="lingbot_core.prompt"):
        build_text_inputs(processor, "a short boat")
    assert not any("cut at" in r.getMessage() for r in caplog.records)
