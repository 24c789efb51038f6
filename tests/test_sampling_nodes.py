"""Node side of few-step sampling: the sampler inputs, the profile workflows, a student DiT in the Loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lingbot_core import sampling
from lingbot_core.workflow import Engine, apply_overrides, load_workflow
from lingbot_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from lingbot_nodes.sampling import SAMPLERS

API = Path(__file__).resolve().parents[1] / "workflows" / "api"
DENOISE = NODE_CLASS_MAPPINGS["LingBotDenoise"]


@pytest.fixture(autouse=True)
def _output_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LINGBOT_OUTPUT_DIR", str(tmp_path / "out"))


def _load(name, overrides=()):
    prompt = load_workflow(API / f"{name}.json", NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS)
    return apply_overrides(prompt, list(overrides), NODE_CLASS_MAPPINGS) if overrides else prompt


def _node(prompt, class_type):
    return next(nid for nid, n in prompt.nodes.items() if n["class_type"] == class_type)


def test_the_node_lists_every_sampler():
    assert SAMPLERS == list(sampling.SAMPLERS)
    (combo,) = [i for i in DENOISE.define_schema().inputs if i.id == "sampler"]
    assert list(combo.options) == SAMPLERS


def test_bad_sigma_requests_fail_before_any_work():
    for overrides, pattern in ((["4.sampler=dmd_student", '4.sigmas="0.9, 0.5"'], "fixed sigma grid"),
                               (['4.sigmas="0.9, x"'], "numbers separated"),
                               (['4.sigmas="0.5, 0.9"'], "strictly decreasing")):
        prompt = _load("lingbot_t2v_dense", overrides)
        engine = Engine(NODE_CLASS_MAPPINGS)
        handle = engine.run(prompt, outputs=["1"]).output("1")
        with pytest.raises(Exception, match=pattern):
            engine.run(prompt)
        assert "transformer" not in handle.shared.loaded


class Count:
    def __init__(self, module):
        self.n = 0
        self.hook = module.register_forward_pre_hook(lambda *_: setattr(self, "n", self.n + 1))


@pytest.mark.parametrize("name, dit_calls", [("lingbot_t2v_dense_dmd8", 8), ("lingbot_t2v_moe_lightlingbot4", 4)])
def test_profile_workflows_run_cfg_free(name, dit_calls):
    prompt = _load(name)
    engine = Engine(NODE_CLASS_MAPPINGS)
    loader = _node(prompt, "LingBotLoader")
    handle = engine.run(prompt, outputs=[loader]).output(loader)
    dit = Count(handle.component("transformer"))
    text = Count(handle.component("text_encoder").model)
    try:
        engine.run(prompt)
    finally:
        dit.hook.remove()
        text.hook.remove()
    assert (dit.n, text.n) == (dit_calls, 1)  # one DiT call per step, and no negative encoded


def test_custom_sigmas_set_the_steps():
    prompt = _load("lingbot_t2v_dense", ["4.sampler=euler", '4.sigmas="1.0, 0.9, 0.75, 0.5"', "4.cfg=1.0"])
    engine = Engine(NODE_CLASS_MAPPINGS)
    handle = engine.run(prompt, outputs=["1"]).output("1")
    dit = Count(handle.component("transformer"))
    try:
        engine.run(prompt)
    finally:
        dit.hook.remove()
    assert dit.n == 4


def test_loader_takes_a_student_transformer(tmp_path, fixtures_root):
    from safetensors.torch import load_file, save_file

    from lingbot_core.tiny import ensure_tiny_checkpoint

    tiny = ensure_tiny_checkpoint("dense")
    student = tmp_path / "student" / "transformer"
    student.mkdir(parents=True)
    (student / "config.json").write_text((tiny / "transformer" / "config.json").read_text())
    weights = load_file(tiny / "transformer" / "diffusion_pytorch_model.safetensors")
    save_file({k: v * 0.5 if v.is_floating_point() else v for k, v in weights.items()},
              student / "diffusion_pytorch_model.safetensors")
    base = Engine(NODE_CLASS_MAPPINGS).run(_load("lingbot_t2v_dense_dmd8"))
    swapped_prompt = _load("lingbot_t2v_dense_dmd8", [f'1.transformer_path="{student.parent}"'])
    swapped = Engine(NODE_CLASS_MAPPINGS).run(swapped_prompt)
    decode = _node(swapped_prompt, "LingBotDecode")
    assert not torch.equal(base.output(decode), swapped.output(decode))
    with pytest.raises(Exception, match="holds no transformer"):
        Engine(NODE_CLASS_MAPPINGS).run(_load("lingbot_t2v_dense_dmd8", [f'1.transformer_path="{tmp_path}"']))


@pytest.mark.parametrize("overrides, where, pattern", [
    (["4.sampler=dmd_student", '4.sigmas="0.9, 0.5"'], "sigmas", "fixed sigma grid"),
    (['4.sigmas="0.9, 0.6, 0.3"', "4.denoise=0.6"], "sigmas", "denoise below 1"),
    (['4.sigmas="0.9, 0.6, 0.3"', "4.step_cache=first_block"], "sigmas", "more than"),
    (['4.sigmas="0.9, x"'], "sigmas", "numbers separated"),
])
def test_sigma_problems_are_refused_when_the_prompt_is_validated(overrides, where, pattern):
    """ComfyUI's /prompt (and the engine's validation) refuses them, not Denoise after the text encoder ran."""
    from lingbot_core.workflow.errors import WorkflowValidationError

    prompt = _load("lingbot_t2v_dense", overrides)
    with pytest.raises(WorkflowValidationError, match=pattern) as refused:
        Engine(NODE_CLASS_MAPPINGS).validate(prompt)
    assert where in str(refused.value)


def test_the_inputs_denoise_checks_itself_keep_their_choices_and_range():
    """Named in validate_inputs, ComfyUI no longer checks them: Denoise does."""
    for kwargs, where in (({"sampler": "ddim"}, "sampler"), ({"step_cache": "always"}, "step_cache"),
                          ({"denoise": 1.5}, "denoise"), ({"denoise": 0.0}, "denoise")):
        result = DENOISE.validate_inputs(**kwargs)
        assert result is not True and list(result.per_input) == [where], (kwargs, result)
    assert DENOISE.validate_inputs(sigmas="1.0, 0.5", sampler="euler", denoise=1.0, step_cache="off") is True
    assert DENOISE.validate_inputs(sigmas="1.0, 0.5", sampler=None, denoise=None, step_cache=None) is True  # linked
