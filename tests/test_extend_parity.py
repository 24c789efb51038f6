"""An extension segment against the reference: the dense pipeline sampled with a k-frame `cond_latent`
(cond_t = k) written into the first latent frames before the loop and after every step.

The case (tests/fixtures/lingbot-extend) was recorded with the reference pipeline at 316da87; its
README says what was called.
"""

from __future__ import annotations

import pytest
import torch
from parity_cases import Case, discover
from test_pipeline_parity import DiTRecorder, _check_run

from lingbot_core import extend as ext
from lingbot_core import stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.latents import latent_shape

CASES = discover(sets=("lingbot-extend",), extra=False)


def test_the_extension_case_is_present():
    assert "t2v-dense-cond2" in {c.name for c in CASES}
    assert all(c.spec["condition"]["cond_t"] > 1 for c in CASES)  # k = 1 is the TI2V cases' condition


def _inputs(case: Case):
    spec, e = case.spec, case.expected()
    handle = PipelineHandle.open(case.model_dir, device="cpu")
    cond = stages.encode_prompt(handle, spec["prompt"], spec["negative_prompt"], mode="t2v")
    return spec, e, handle, cond


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_k_frame_condition_matches_reference(case):
    spec, e, handle, cond = _inputs(case)
    h, w, f, k = spec["height"], spec["width"], spec["num_frames"], spec["condition"]["cond_t"]
    case.check("prompt_input_ids", cond.positive.input_ids, e)
    case.check("prompt_embeds", cond.positive.embeds, e)
    case.check("prompt_mask", cond.positive.mask, e)
    case.check("negative_input_ids", cond.negative.input_ids, e)
    case.check("negative_prompt_embeds", cond.negative.embeds, e)
    case.check("negative_prompt_mask", cond.negative.mask, e)

    # The reference's RNG order: the condition's posterior sample, then the noise.
    g = torch.Generator("cpu").manual_seed(spec["seed"])
    video = e["cond_video"].float() / 255
    assert video.shape[0] == ext.overlap_frames(k)
    cond_latent = ext.condition_latent(handle, video, k=k, height=h, width=w, generator=g)
    case.check("cond_latent", cond_latent, e)
    noise = stages.prepare_latents(latent_shape(h, w, f), g)
    case.check("initial_latents", noise, e)

    recorder = DiTRecorder(handle.component("transformer"))
    trace: dict = {}
    try:
        latents = stages.denoise(handle, cond, height=h, width=w, num_frames=f, steps=spec["num_inference_steps"],
                                 guidance_scale=spec["guidance_scale"], shift=spec["shift"], latents=noise.clone(),
                                 cond_latent=cond_latent, generator=g, trace=trace)
    finally:
        recorder.close()
    case.check("timesteps", trace["run"].timesteps, e)
    case.check("sigmas", trace["run"].sigmas, e)
    _check_run(case, e, recorder.calls, cfg=True)
    case.check("final_latents", latents, e)
    assert torch.equal(latents[:, :, :k], cond_latent)  # pinned, not denoised


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_segment_path_draws_in_the_reference_order(case):
    """What `segment_frames` runs (one generator: the condition's sample, then denoise's own noise)
    lands on the reference's final latents."""
    spec, e, handle, cond = _inputs(case)
    h, w, f, k = spec["height"], spec["width"], spec["num_frames"], spec["condition"]["cond_t"]
    g = torch.Generator("cpu").manual_seed(spec["seed"])
    cond_latent = ext.condition_latent(handle, e["cond_video"].float() / 255, k=k, height=h, width=w, generator=g)
    latents = stages.denoise(handle, cond, height=h, width=w, num_frames=f, steps=spec["num_inference_steps"],
                             guidance_scale=spec["guidance_scale"], shift=spec["shift"], generator=g,
                             cond_latent=cond_latent)
    case.check("final_latents", latents, e)
