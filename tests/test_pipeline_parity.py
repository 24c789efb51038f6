"""Every pipeline case (t2v, t2i, ti2v, refine; shared and LINGBOT_PARITY_DIRS) through the stages and `generate`.

Each recorded intermediate is compared with the case's tolerance: embeddings and masks, the sigma
table, the initial noise, the TI2V condition latent, every DiT input/timestep/prediction, the final
latents and the frames.
"""

from __future__ import annotations

import pytest
import torch
from parity_cases import Case, discover

from lingbot_core import sampling, stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.latents import latent_shape, vae_to_dit

CASES = discover({"t2v", "t2i", "ti2v"}, sets=("lingbot", "lingbot-dmd"))
REFINE_CASES = discover({"refine"})


def test_shared_pipeline_cases_are_present():
    assert {"t2v-dense", "t2i-dense", "ti2v-dense", "t2v-moe", "t2v-dense-dmd", "ti2v-dense-dmd"} <= {
        c.name for c in CASES}
    assert "refine-moe" in {c.name for c in REFINE_CASES}


def _sampler(case: Case):
    """The sampler a case's `scheduler` block names (none: flow-UniPC, the checkpoint's scheduler).

    A block naming a scheduler we do not implement fails the case: it must never run as flow-UniPC.
    """
    block = case.spec.get("scheduler")
    if block is None:
        return sampling.get_sampler("flow_unipc")
    try:
        return sampling.from_scheduler_block(block)
    except ValueError as err:
        pytest.fail(f"{case.name}: {err}; the case is not run as flow-UniPC")


def _check_schedule(case: Case, e: dict, handle, trace: dict) -> None:
    """Timesteps and sigmas of the run, and for stochastic samplers the draws and stds."""
    run = trace["run"]
    case.check("timesteps", run.timesteps, e)
    case.check("sigmas", run.sigmas, e)
    if "scheduler" not in case.spec:  # flow-UniPC: the run is the checkpoint's scheduler
        case.check("timesteps", handle.component("scheduler").timesteps, e)
    if "ancestral_std" in e:
        case.check("ancestral_std", torch.stack(run.trace["std"]), e)
        case.check("scheduler_noise", torch.stack(run.trace["noise"]), e)
        case.check("scheduler_noise_steps", torch.tensor(run.trace["noise_steps"], dtype=torch.int64), e)


class DiTRecorder:
    """Forward hooks on a DiT: what it received and returned, call by call."""

    def __init__(self, module: torch.nn.Module):
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._hook = module.register_forward_hook(self._record, with_kwargs=False)

    def _record(self, module, args, output):
        out = output[0] if isinstance(output, tuple) else output.sample
        self.calls.append((args[0].detach().clone(), args[1].detach().clone(), args[2].detach().clone(), out.detach().clone()))

    def close(self):
        self._hook.remove()


def _check_run(case: Case, expected: dict, calls: list, cfg: bool) -> None:
    per_step = 2 if cfg else 1
    steps = len(calls) // per_step
    assert len(calls) == steps * per_step == expected["timesteps"].shape[0] * per_step
    case.check("dit_input_latents", torch.stack([calls[i * per_step][0] for i in range(steps)]), expected)
    case.check("transformer_timesteps", torch.stack([calls[i * per_step][1][0] for i in range(steps)]), expected)
    case.check("noise_pred_cond", torch.stack([calls[i * per_step][3] for i in range(steps)]), expected)
    if cfg and "noise_pred_uncond" in expected:
        case.check("noise_pred_uncond", torch.stack([calls[i * per_step + 1][3] for i in range(steps)]), expected)


def _image(case: Case):
    return case.path / case.spec["image"] if "image" in case.spec else None


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_stages_match_reference(case):
    e = case.expected()
    spec = case.spec
    handle = PipelineHandle.open(case.model_dir, device="cpu")
    h, w, f = spec["height"], spec["width"], spec["num_frames"]
    cfg = spec["guidance_scale"] > 1

    image_cond = None
    if spec["mode"] == "ti2v":
        image_cond = stages.encode_image(handle, _image(case), h, w)
        case.check("image_pixels", image_cond.pixels, e)
        assert list(image_cond.vision_image.size) == spec["vlm_image_size_wh"]
        case.check("cond_latent_mean", vae_to_dit(image_cond.latent_mean, image_cond.vae_config), e)

    cond = stages.encode_prompt(handle, spec["prompt"], spec["negative_prompt"] if cfg else None,
                                image=image_cond, mode=spec["mode"])
    case.check("prompt_input_ids", cond.positive.input_ids, e)
    case.check("prompt_embeds", cond.positive.embeds, e)
    case.check("prompt_mask", cond.positive.mask, e)
    if spec["negative_prompt_used"]:
        case.check("negative_input_ids", cond.negative.input_ids, e)
        case.check("negative_prompt_embeds", cond.negative.embeds, e)
        case.check("negative_prompt_mask", cond.negative.mask, e)

    # The reference's RNG order, reproduced stage by stage.
    g = torch.Generator("cpu").manual_seed(spec["seed"])
    cond_latent = None
    if image_cond is not None:
        cond_latent = image_cond.sample_latent(g)
        case.check("cond_latent", cond_latent, e)
    noise = stages.prepare_latents(latent_shape(h, w, f), g)
    case.check("initial_latents", noise, e)

    if not cfg:
        assert cond.negative is None  # guidance 1: the negative is never encoded
    recorder = DiTRecorder(handle.component("transformer"))
    trace: dict = {}
    try:
        # The same generator goes on: a stochastic sampler's step noise follows the initial noise.
        latents = stages.denoise(handle, cond, height=h, width=w, num_frames=f, steps=spec["num_inference_steps"],
                                 guidance_scale=spec["guidance_scale"], shift=spec["shift"], latents=noise.clone(),
                                 cond_latent=cond_latent, generator=g, sampler=_sampler(case), trace=trace)
    finally:
        recorder.close()
    _check_schedule(case, e, handle, trace)
    _check_run(case, e, recorder.calls, cfg)
    case.check("final_latents", latents, e)
    case.check("frames", stages.decode(handle, latents), e)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_generate_matches_reference_and_stages_alone(case):
    e = case.expected()
    spec = case.spec
    handle = PipelineHandle.open(case.model_dir, device="cpu")
    kwargs = dict(mode=spec["mode"], image=_image(case), negative_prompt=spec["negative_prompt"],
                  height=spec["height"], width=spec["width"], num_frames=spec["num_frames"],
                  steps=spec["num_inference_steps"], guidance_scale=spec["guidance_scale"], shift=spec["shift"],
                  seed=spec["seed"], sampler=_sampler(case))
    steps_seen = []
    result = stages.generate(handle, spec["prompt"], callback=lambda i, n, x: steps_seen.append((i, n)), **kwargs)
    case.check("final_latents", result.latents, e)
    case.check("frames", result.frames, e)
    n = spec["num_inference_steps"]
    assert steps_seen == [(i + 1, n) for i in range(n)]

    # The stages called one by one, without the test's help, give exactly what `generate` gives.
    image_cond = (stages.encode_image(handle, _image(case), spec["height"], spec["width"])
                  if spec["mode"] == "ti2v" else None)
    cond = stages.encode_prompt(handle, spec["prompt"], spec["negative_prompt"] if spec["guidance_scale"] > 1 else None,
                                image=image_cond, mode=spec["mode"])
    latents = stages.denoise(handle, cond, height=spec["height"], width=spec["width"], num_frames=spec["num_frames"],
                             steps=n, guidance_scale=spec["guidance_scale"], shift=spec["shift"], seed=spec["seed"],
                             image_cond=image_cond, sampler=kwargs["sampler"])
    assert torch.equal(latents, result.latents)
    assert torch.equal(stages.decode(handle, latents), result.frames)

    # And a repeat in the same process reproduces bit for bit.
    again = stages.generate(handle, spec["prompt"], **kwargs)
    assert torch.equal(again.latents, result.latents) and torch.equal(again.frames, result.frames)


@pytest.mark.parametrize("case", REFINE_CASES, ids=lambda c: c.name)
def test_refiner_matches_reference(case):
    e = case.expected()
    spec, rf = case.spec, case.spec["refiner"]
    handle = PipelineHandle.open(case.model_dir, device="cpu")
    first_frame = case.path / spec["first_frame_image"] if spec.get("first_frame_image") else None
    opts = dict(height=rf["height"], width=rf["width"], steps=rf["steps"], shift=rf["shift"],
                t_thresh=rf["t_thresh"], tail_steps=rf["tail_steps"], seed=spec["seed"], first_frame=first_frame)

    start = stages.prepare_refine(handle, e["input_frames"], **opts)
    case.check("upscaled_video", start.video, e)
    case.check("refiner_sigmas", start.sigmas.float() if torch.is_tensor(start.sigmas) else torch.tensor(start.sigmas), e)
    case.check("x_up", start.x_up, e)
    if "refiner_cond_latent" in e:
        case.check("refiner_cond_latent", start.cond_latent, e)
    case.check("refine_noise", start.noise, e)
    case.check("refine_initial_latents", start.initial, e)

    cond = stages.encode_prompt(handle, spec["prompt"], None)
    case.check("prompt_input_ids", cond.positive.input_ids, e)
    case.check("prompt_embeds", cond.positive.embeds, e)
    case.check("prompt_mask", cond.positive.mask, e)

    recorder = DiTRecorder(handle.component("refiner"))
    try:
        latents = stages.refine(handle, e["input_frames"], cond, guidance_scale=rf["guidance_scale"],
                                decode_output=False, **opts)
    finally:
        recorder.close()
    case.check("timesteps", handle.component("scheduler").timesteps, e)
    case.check("sigmas", handle.component("scheduler").sigmas, e)
    _check_run(case, e, recorder.calls, rf["guidance_scale"] > 1)
    # The zero negative: the unconditional branch saw zeros with the prompt's mask.
    assert torch.count_nonzero(recorder.calls[1][2]) == 0
    case.check("final_latents", latents, e)
    case.check("frames", stages.decode(handle, latents, tiling=stages.REFINER_TILING), e)

    # Through `generate`'s refine path: the whole refine call (decode included) equals the stages.
    frames = stages.refine(handle, e["input_frames"], cond, guidance_scale=rf["guidance_scale"], **opts)
    case.check("frames", frames, e)


def test_generate_with_the_refiner_matches_the_refine_case():
    """`generate(..., refine_output=True)` chains the base run and the refiner as the reference does."""
    refine_case = next(c for c in REFINE_CASES if c.name == "refine-moe")
    base_case = next(c for c in CASES if c.name == refine_case.spec["base_case"])
    spec, rf = base_case.spec, refine_case.spec["refiner"]
    handle = PipelineHandle.open(base_case.model_dir, device="cpu")
    result = stages.generate(
        handle, spec["prompt"], mode=spec["mode"], negative_prompt=spec["negative_prompt"], height=spec["height"],
        width=spec["width"], num_frames=spec["num_frames"], steps=spec["num_inference_steps"],
        guidance_scale=spec["guidance_scale"], shift=spec["shift"], seed=spec["seed"], refine_output=True,
        refine_options=dict(height=rf["height"], width=rf["width"], steps=rf["steps"], shift=rf["shift"],
                            t_thresh=rf["t_thresh"], tail_steps=rf["tail_steps"], guidance_scale=rf["guidance_scale"]))
    base_case.check("frames", result.frames, base_case.expected())
    refine_case.check("frames", result.refined, refine_case.expected())


def test_extra_case_folders_are_discovered(tmp_path, monkeypatch, fixtures_root):
    """LINGBOT_PARITY_DIRS adds cases without code changes: a case folder, or a folder of cases."""
    import shutil

    import parity_cases

    root = tmp_path / "more"
    shutil.copytree(fixtures_root / "models" / "tiny-dense", root / "models" / "tiny-dense")
    shutil.copytree(fixtures_root / "cases" / "t2i-dense", root / "cases" / "t2i-extra")
    single = tmp_path / "single" / "transformer-one"
    shutil.copytree(fixtures_root / "cases" / "transformer-dense", single)
    monkeypatch.setenv("LINGBOT_PARITY_DIRS", f"{root}{__import__('os').pathsep}{single}")
    found = parity_cases.discover()
    extra = [c for c in found if c.path in (root / "cases" / "t2i-extra", single)]
    assert len(extra) == 2
    assert next(c for c in extra if c.path == root / "cases" / "t2i-extra").model_dir == root / "models" / "tiny-dense"


def test_a_case_naming_an_unknown_scheduler_fails_instead_of_running_as_unipc(tmp_path):
    case = Case(tmp_path, {"name": "t2v-lcm", "scheduler": {"name": "lcm_student"}}, tmp_path)
    with pytest.raises(pytest.fail.Exception, match="t2v-lcm.*not implemented.*not run as flow-UniPC"):
        _sampler(case)
    odd = Case(tmp_path, {"name": "t2v-odd", "scheduler": {"name": "dmd_student", "sigma_data": 0.5}}, tmp_path)
    with pytest.raises(pytest.fail.Exception, match="sigma_data"):
        _sampler(odd)
