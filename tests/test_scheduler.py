"""Scheduler parity: sigma grid, timesteps and every UniPC step against the reference fixtures.

Each pipeline case replays the stored (guided) DiT outputs through `FlowUniPCScheduler.step`,
teacher-forced from the stored DiT inputs, and compares the next DiT input and the final latent.
Extra case folders (for example from a GPU run of the reference) can be added with
LINGBOT_PARITY_DIRS, os.pathsep-separated; each entry is a case folder or a folder of case folders.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parity_cases import Case, discover

from lingbot_core.scheduler import (
    FlowUniPCScheduler,
    UniPCSettings,
    check_sigmas,
    compute_refiner_sigmas,
    transformer_timestep,
)

PIPELINE_MODES = {"t2v", "t2i", "ti2v", "refine"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


CASES = discover(PIPELINE_MODES)


def _dit_dtype(case: dict) -> torch.dtype:
    """The DiT dtype the case ran with (fixtures: float32), from case.json if it says so."""
    ref = case.get("reference", {})
    name = case.get("transformer_dtype") or ref.get("transformer_dtype") or str(ref.get("dtype", "float32"))
    return _DTYPES.get(name.split()[0], torch.float32)


def _scheduler_for(case: Case) -> FlowUniPCScheduler:
    if (case.model_dir / "scheduler" / "scheduler_config.json").is_file():
        return FlowUniPCScheduler.from_pretrained(case.model_dir, subfolder="scheduler")
    return FlowUniPCScheduler()  # defaults equal the reference checkpoint's config


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_replay_matches_reference(case: Case):
    spec = case.spec
    exp = case.expected()
    sched = _scheduler_for(case)

    if spec["mode"] == "refine":
        ref = spec["refiner"]
        sigmas = compute_refiner_sigmas(
            sigma_max=sched.sigma_max,
            sigma_min=sched.sigma_min,
            num_inference_steps=ref["steps"],
            shift=ref["shift"],
            t_thresh=ref["t_thresh"],
            tail_steps=ref["tail_steps"],
        )
        assert sigmas.dtype == torch.float32
        assert torch.equal(sigmas, exp["refiner_sigmas"]), (sigmas, exp["refiner_sigmas"])
        sched.set_timesteps(len(sigmas), sigmas=sigmas, shift=1.0)
        cond = exp.get("refiner_cond_latent")
    else:
        sched.set_timesteps(spec["num_inference_steps"], shift=spec["shift"])
        cond = exp["cond_latent"] if spec["mode"] == "ti2v" else None

    assert sched.timesteps.dtype == torch.int64
    assert sched.timesteps.tolist() == exp["timesteps"].tolist()
    assert sched.sigmas.dtype == torch.float32
    assert torch.equal(sched.sigmas, exp["sigmas"]), (sched.sigmas, exp["sigmas"])
    dit_t = torch.stack([transformer_timestep(t, _dit_dtype(spec)) for t in sched.timesteps])
    case.check("transformer_timesteps", dit_t, exp)

    guidance = float(spec["guidance_scale"])
    use_cfg = guidance > 1.0 and "noise_pred_uncond" in exp
    inputs = exp["dit_input_latents"]
    outputs = []
    for i, t in enumerate(sched.timesteps):
        cond_pred = exp["noise_pred_cond"][i]
        if use_cfg:
            uncond = exp["noise_pred_uncond"][i]
            noise_pred = uncond + guidance * (cond_pred - uncond)
        else:
            noise_pred = cond_pred
        latents = sched.step(noise_pred, t, inputs[i].clone())
        assert latents.dtype == torch.float32
        if cond is not None:
            latents[:, :, : cond.shape[2]] = cond
        outputs.append(latents)
    # Teacher-forced: step i must give the DiT input of step i + 1 (row 0 is the given start, compared
    # with itself), the last step the final latent. A failure names the worst [step, ...] index.
    case.check("dit_input_latents", torch.stack([inputs[0], *outputs[:-1]]), exp)
    case.check("final_latents", outputs[-1], exp)


def test_default_grid_40_steps_shift_3():
    sched = FlowUniPCScheduler()
    sched.set_timesteps(40, shift=3.0)
    ts = sched.timesteps.tolist()
    assert len(ts) == 40 and sched.sigmas.shape == (41,)
    assert ts[:5] == [999, 991, 982, 973, 963]
    assert ts[-3:] == [195, 136, 71]
    assert sched.sigmas[-1].item() == 0.0


def test_refiner_default_schedule():
    sched = FlowUniPCScheduler()
    sigmas = compute_refiner_sigmas(
        sigma_max=sched.sigma_max, sigma_min=sched.sigma_min, num_inference_steps=8, shift=3.0, t_thresh=0.85
    )
    assert sigmas[0].item() == np.float32(0.85)
    sched.set_timesteps(len(sigmas), sigmas=sigmas, shift=1.0)
    assert sched.timesteps.tolist() == [850, 832, 749, 642, 499, 299, 199, 99]
    assert (
        compute_refiner_sigmas(
            sigma_max=sched.sigma_max, sigma_min=0.0, num_inference_steps=8, shift=3.0, t_thresh=None
        )
        is None
    )


def test_sigma_range_from_reference_config(fixtures_root):
    sched = FlowUniPCScheduler.from_pretrained(fixtures_root / "models" / "tiny-dense", subfolder="scheduler")
    assert sched.config.solver_order == 2 and sched.config.solver_type == "bh2"
    assert sched.config.shift == 1.0
    assert sched.sigma_max == float(np.float32(0.999))
    assert sched.sigma_min == 0.0


def test_transformer_timestep():
    # Values from running the reference's own expression: with a half-precision DiT the x1000 happens
    # in that dtype (bf16 899 -> 900.0, not the 898.4375 a float32 multiply would give).
    ts = torch.tensor([999, 899, 499])
    bf16 = [transformer_timestep(t, torch.bfloat16).item() for t in ts]
    assert bf16 == [1000.0, 900.0, 498.0]
    fp16 = [transformer_timestep(t, torch.float16).item() for t in ts]
    assert fp16 == [999.0, 899.0, 499.0]
    assert transformer_timestep(ts, torch.float32).dtype == torch.float32


def _run(sched: FlowUniPCScheduler, steps: int | None = None, seed: int = 0) -> list[torch.Tensor]:
    """Sample with a synthetic flow model (v = x - x0 plus noise); `steps` stops early."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, 2, 3, 3, generator=gen)
    x0 = torch.randn(x.shape, generator=gen)
    outs = []
    for t in sched.timesteps[:steps]:
        v = x - x0 + 0.1 * torch.randn(x.shape, generator=gen)
        x = sched.step(v, t, x)
        outs.append(x)
    return outs


def test_set_timesteps_resets_state():
    reused = FlowUniPCScheduler()
    reused.set_timesteps(6, shift=3.0)
    _run(reused, 3, seed=1)  # abandon a run half way
    reused.set_timesteps(5, shift=3.0)
    first_sigmas, first_ts = reused.sigmas.clone(), reused.timesteps.clone()
    assert reused.step_index is None and reused.last_sample is None
    assert all(m is None for m in reused.model_outputs)
    first = _run(reused)
    reused.set_timesteps(5, shift=3.0)
    assert torch.equal(reused.sigmas, first_sigmas) and torch.equal(reused.timesteps, first_ts)
    second = _run(reused)
    fresh = FlowUniPCScheduler()
    fresh.set_timesteps(5, shift=3.0)
    third = _run(fresh)
    for a, b, c in zip(first, second, third):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_step_accepts_timestep_forms_and_guards_misuse():
    results = []
    for form in (int, torch.tensor, float, lambda t: torch.tensor([t])):
        sched = FlowUniPCScheduler()
        sched.set_timesteps(4, shift=3.0)
        x = torch.ones(1, 2, 1, 2, 2)
        results.append(sched.step(torch.full_like(x, 0.5), form(int(sched.timesteps[0])), x))
        assert sched.step_index == 1
    assert all(torch.equal(results[0], r) for r in results[1:])

    sched = FlowUniPCScheduler()
    with pytest.raises(ValueError, match="set_timesteps"):
        sched.step(torch.zeros(1, 1), 999, torch.zeros(1, 1))
    sched.set_timesteps(2, shift=3.0)
    with pytest.raises(ValueError, match="not in the schedule"):
        sched.step(torch.zeros(1, 1), 123, torch.zeros(1, 1))
    for t in sched.timesteps:
        sched.step(torch.zeros(1, 1), t, torch.zeros(1, 1))
    with pytest.raises(ValueError, match="steps are done"):
        sched.step(torch.zeros(1, 1), sched.timesteps[-1], torch.zeros(1, 1))


def test_explicit_sigma_validation():
    sched = FlowUniPCScheduler()
    with pytest.raises(ValueError, match="strictly decrease"):
        sched.set_timesteps(sigmas=[0.5, 0.6], shift=1.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        sched.set_timesteps(sigmas=[1.2, 0.5], shift=1.0)
    with pytest.raises(ValueError, match="above the final sigma"):
        sched.set_timesteps(sigmas=[0.5, 0.0], shift=1.0)
    with pytest.raises(ValueError, match="does not match"):
        sched.set_timesteps(3, sigmas=[0.5, 0.25], shift=1.0)
    with pytest.raises(ValueError, match="must begin at t_thresh=0.85"):
        check_sigmas([0.8, 0.5], start=0.85)
    with pytest.raises(ValueError, match="strictly decrease"):
        compute_refiner_sigmas(sigma_max=0.2, sigma_min=0.8, num_inference_steps=4, shift=1.0, t_thresh=0.85)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        compute_refiner_sigmas(
            sigma_max=0.999, sigma_min=-0.5, num_inference_steps=4, shift=1.0, t_thresh=0.85
        )
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        compute_refiner_sigmas(sigma_max=0.999, sigma_min=0.0, num_inference_steps=4, shift=1.0, t_thresh=1.5)

    # A valid float32 list is taken as is (shift 1), with the final 0 appended.
    sched.set_timesteps(sigmas=torch.tensor([0.5, 0.25]), shift=1.0)
    assert sched.timesteps.tolist() == [500, 250]
    assert sched.sigmas.tolist() == [0.5, 0.25, 0.0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"thresholding": True},
        {"predict_x0": False},
        {"prediction_type": "epsilon"},
        {"solver_type": "dpmsolver++"},
        {"use_dynamic_shifting": True},
        {"final_sigmas_type": "last"},
        {"lower_order_final": False},
        {"timestep_spacing": "trailing"},
    ],
)
def test_unsupported_config_raises(kwargs):
    with pytest.raises((ValueError, NotImplementedError), match=next(iter(kwargs))):
        FlowUniPCScheduler(**kwargs)


def test_bh1_and_order3_run_finite():
    # The reference's bh1 ends in -inf * 0 = NaN on the step to sigma 0; ours must not.
    for kwargs in (
        {"solver_type": "bh1"},
        {"solver_order": 3},
        {"solver_order": 1, "lower_order_final": False},
    ):
        sched = FlowUniPCScheduler(**kwargs)
        sched.set_timesteps(6, shift=3.0)
        assert torch.isfinite(_run(sched)[-1]).all(), kwargs


def test_settings_round_trip_the_checkpoint_config(fixtures_root, tmp_path):
    import json

    raw = json.loads((fixtures_root / "models" / "tiny-dense" / "scheduler" / "scheduler_config.json").read_text())
    sched = FlowUniPCScheduler.from_pretrained(fixtures_root / "models" / "tiny-dense", subfolder="scheduler")
    assert sched.settings == UniPCSettings.from_mapping(raw)
    assert {k: v for k, v in sched.config.items() if not k.startswith("_")} == {
        k: v for k, v in raw.items() if not k.startswith("_")}
    sched.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "scheduler_config.json").read_text())
    assert {k: v for k, v in saved.items() if not k.startswith("_")} == {
        k: v for k, v in raw.items() if not k.startswith("_")}
    assert FlowUniPCScheduler(UniPCSettings(shift=3.0)).config.shift == 3.0
    with pytest.raises(TypeError, match="not both"):
        FlowUniPCScheduler(UniPCSettings(), shift=2.0)


def test_settings_parse_aliases_and_reject_unknown_keys():
    assert FlowUniPCScheduler(solver_type="heun").config.solver_type == "bh2"
    assert UniPCSettings.from_mapping({"solver_type": "logrho"}).solver_type == "bh2"
    with pytest.raises(ValueError, match=r"unknown keys \['solver_ordr'\]"):
        UniPCSettings.from_mapping({"solver_ordr": 3})
    with pytest.raises(ValueError, match="solver_order is 0"):
        FlowUniPCScheduler(solver_order=0)
    with pytest.raises(ValueError, match="shift=0"):
        FlowUniPCScheduler(shift=0)


def test_refiner_sigma_errors_say_what_to_change():
    with pytest.raises(ValueError, match="num_inference_steps is 0"):
        compute_refiner_sigmas(t_thresh=0.5, num_inference_steps=0, shift=1.0, sigma_max=0.999, sigma_min=0.0)
    with pytest.raises(ValueError, match="tail_steps is -1"):
        compute_refiner_sigmas(t_thresh=0.5, num_inference_steps=4, shift=1.0, sigma_max=0.999, sigma_min=0.0,
                               tail_steps=-1)
    with pytest.raises(ValueError, match="NaN or infinite"):
        check_sigmas([0.5, float("nan")])
    with pytest.raises(ValueError, match="non-empty flat list"):
        check_sigmas([])
