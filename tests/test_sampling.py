"""Samplers: hand-computed steps and grids, refusals, and CFG-free runs (one DiT call per step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lingbot_core import sampling, stages
from lingbot_core.handle import PipelineHandle

GEOM = dict(height=32, width=32, num_frames=5)


@pytest.fixture
def handle(fixtures_root):
    return PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")


@pytest.fixture
def cond(handle):
    return stages.encode_prompt(handle, "a red boat", "")


def _pair(seed=0, shape=(1, 16, 2, 4, 4)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# -- grids ---------------------------------------------------------------------------------------

def test_euler_default_grid_is_the_trained_4_step_grid():
    run = sampling.EulerSampler().start(steps=4, shift=3.0, sigmas=None, device=torch.device("cpu"), generator=None)
    assert torch.allclose(run.sigmas, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]), atol=1e-7)
    assert torch.allclose(run.timesteps, torch.tensor([1000.0, 900.0, 750.0, 500.0]), atol=1e-4)


def test_euler_custom_sigmas_are_used_as_given():
    run = sampling.EulerSampler().start(steps=99, shift=5.0, sigmas=[0.8, 0.4, 0.1, 0.0],
                                        device=torch.device("cpu"), generator=None)
    assert run.sigmas.tolist() == pytest.approx([0.8, 0.4, 0.1, 0.0])
    assert len(run) == 3


def test_student_grid_follows_the_rule():
    """linspace(1, 1/1000, S+1)[:-1], warped, first value pulled below 1, int-truncated timesteps."""
    for steps, shift in ((8, 3.0), (4, 5.0), (3, 1.0)):
        timesteps, sigmas = sampling.student_grid(steps, shift)
        u = np.linspace(1.0, 0.001, steps + 1)[:-1]
        w = shift * u / (1 + (shift - 1) * u)
        w[0] -= 1e-6
        assert timesteps.tolist() == [int(x * 1000) for x in w]
        assert sigmas.dtype == torch.float32 and float(sigmas[-1]) == 0.0
        assert np.allclose(sigmas[:-1].numpy(), w, atol=1e-7)


# -- steps ---------------------------------------------------------------------------------------

def test_euler_step_by_hand():
    z, v = _pair()
    run = sampling.EulerSampler().start(steps=4, shift=3.0, sigmas=None, device=torch.device("cpu"), generator=None)
    out = run.step(v, 1, z)
    want = z.double() + (0.75 - 0.9) * v.double()
    assert torch.allclose(out.double(), want, atol=1e-6)


def test_dmd_ancestral_step_by_hand():
    z, v = _pair(1)
    g = torch.Generator().manual_seed(5)
    run = sampling.DMDStudentSampler().start(steps=8, shift=3.0, sigmas=None, device=torch.device("cpu"),
                                             generator=g, record=True)
    out = run.step(v, 2, z)
    noise = torch.randn(z.shape, generator=torch.Generator().manual_seed(5)).double()
    s, n = float(run.sigmas[2]), float(run.sigmas[3])
    assert s >= 0.5
    # DDIM std by hand (float64), in the VP frame of x = (1-s) x0 + s eps.
    a_t, a_s = (1 - s) / np.hypot(1 - s, s), (1 - n) / np.hypot(1 - n, n)
    b_t, b_s = s / np.hypot(1 - s, s), n / np.hypot(1 - n, n)
    std = min(b_s / b_t * np.sqrt(max(1 - (a_t / a_s) ** 2, 0)) * np.hypot(1 - n, n), n)
    assert float(run.trace["std"][0]) == pytest.approx(std, rel=1e-5)
    x0, x1 = z.double() - s * v.double(), z.double() + (1 - s) * v.double()
    want = x0 * (1 - n) + x1 * np.sqrt(n * n - std * std) + std * noise
    assert torch.allclose(out.double(), want, atol=1e-5)
    assert torch.equal(run.trace["noise"][0], noise.float())


def test_dmd_low_noise_step_is_euler_and_draws_nothing():
    z, v = _pair(2)
    g = torch.Generator().manual_seed(5)
    run = sampling.DMDStudentSampler().start(steps=8, shift=3.0, sigmas=None, device=torch.device("cpu"), generator=g)
    state = g.get_state()
    out = run.step(v, 7, z)
    assert torch.equal(g.get_state(), state)
    assert torch.allclose(out.double(), z.double() + (0.0 - float(run.sigmas[7])) * v.double(), atol=1e-6)


def test_dmd_step_zero_lands_exactly_on_the_x0_mixture():
    """At s ~ 1 the float32 std equals n, so the x1 term is exactly 0 (the reference's precision trap)."""
    _, sigmas = sampling.student_grid(8, 3.0)
    std = sampling.ancestral_std(sigmas[0], sigmas[1], 1.0)
    assert float(torch.sqrt(sigmas[1] ** 2 - std**2)) == 0.0


# -- refusals ------------------------------------------------------------------------------------

def test_dmd_refuses_custom_sigmas_and_refine_schedules(handle, cond):
    with pytest.raises(ValueError, match="fixed sigma grid.*euler"):
        stages.denoise(handle, cond, **GEOM, steps=4, guidance_scale=1.0, seed=1, sampler="dmd_student",
                       sigmas=torch.tensor([0.9, 0.5]))
    with pytest.raises(ValueError, match="cannot run the refiner.*flow_unipc"):
        sampling.get_sampler("dmd_student").check(steps=8, shift=3.0, refine=True)
    assert handle.shared.loaded.get("transformer") is None  # refused before any model work


def test_refine_refuses_the_student_sampler(fixtures_root):
    moe = PipelineHandle.open(fixtures_root / "models" / "tiny-moe", device="cpu")
    cond = stages.encode_prompt(moe, "a red boat", None)
    with pytest.raises(ValueError, match="cannot run the refiner"):
        stages.refine(moe, torch.rand(5, 32, 32, 3), cond, height=32, width=32, steps=2, sampler="dmd_student")
    assert "refiner" not in moe.shared.loaded


@pytest.mark.parametrize("sigmas, pattern", [
    ([0.5, 0.9], "strictly decreasing"), ([1.5, 0.5], r"\[0, 1\]"), ([float("nan")], "finite"),
    ([0.0], "above 0"), (torch.ones(2, 2), "1-D"), (["a"], "numbers"),
])
def test_bad_custom_sigmas(handle, cond, sigmas, pattern):
    with pytest.raises(ValueError, match=pattern):
        stages.denoise(handle, cond, **GEOM, steps=2, guidance_scale=1.0, seed=1, sampler="euler", sigmas=sigmas)


def test_sampler_names_and_blocks():
    with pytest.raises(ValueError, match="unknown sampler 'ddim'.*flow_unipc, euler, dmd_student"):
        sampling.get_sampler("ddim")
    with pytest.raises(ValueError, match="not implemented"):
        sampling.from_scheduler_block({"name": "lcm"})
    with pytest.raises(ValueError, match="bad options"):
        sampling.from_scheduler_block({"name": "dmd_student", "ddim_etta": 1.0})
    with pytest.raises(ValueError, match="ddim_eta"):
        sampling.get_sampler("dmd_student", ddim_eta=2.0)
    block = {"name": "dmd_student", "num_train_timesteps": 1000, "flow_shift": 3.0, "high_noise_threshold": 0.5,
             "ddim_eta": 1.0}
    assert sampling.from_scheduler_block(block) == sampling.DMDStudentSampler()
    assert sampling.parse_sigmas(" 1.0, 0.9; 0.75 0.5 ") == [1.0, 0.9, 0.75, 0.5]
    assert sampling.parse_sigmas("") is None
    with pytest.raises(ValueError, match="numbers separated"):
        sampling.parse_sigmas("1.0, x")


# -- CFG-free runs -------------------------------------------------------------------------------

class Counter:
    def __init__(self, module):
        self.calls = []
        self.hook = module.register_forward_hook(lambda m, a, o: self.calls.append(a[1].detach().clone()))

    def close(self):
        self.hook.remove()


@pytest.mark.parametrize("sampler", ["flow_unipc", "euler", "dmd_student"])
@pytest.mark.parametrize("guidance, per_step", [(1.0, 1), (0.5, 1), (3.0, 2)])
def test_dit_calls_per_step(handle, cond, sampler, guidance, per_step):
    counter = Counter(handle.component("transformer"))
    try:
        out = stages.denoise(handle, cond, **GEOM, steps=3, guidance_scale=guidance, seed=1, sampler=sampler)
    finally:
        counter.close()
    assert len(counter.calls) == 3 * per_step
    assert torch.isfinite(out).all()


def test_cfg_free_needs_no_negative_and_generate_encodes_one_prompt(handle):
    positive_only = stages.encode_prompt(handle, "a red boat", None)
    assert positive_only.negative is None
    stages.denoise(handle, positive_only, **GEOM, steps=2, guidance_scale=1.0, seed=1)  # no negative needed
    with pytest.raises(ValueError, match="negative"):
        stages.denoise(handle, positive_only, **GEOM, steps=2, guidance_scale=3.0, seed=1)

    encoder = handle.component("text_encoder").model  # what encode_text runs
    seen = []
    hook = encoder.register_forward_hook(lambda m, a, k, o: seen.append(1), with_kwargs=True)
    try:
        stages.generate(handle, "a red boat", **GEOM, steps=2, guidance_scale=1.0, seed=1, sampler="dmd_student")
        assert len(seen) == 1
        seen.clear()
        stages.generate(handle, "a red boat", **GEOM, steps=2, guidance_scale=3.0, seed=1)
        assert len(seen) == 2
    finally:
        hook.remove()


def test_samplers_differ_and_repeat_exactly(handle, cond):
    runs = {}
    for name in ("flow_unipc", "euler", "dmd_student"):
        a = stages.denoise(handle, cond, **GEOM, steps=4, guidance_scale=1.0, seed=3, sampler=name)
        b = stages.denoise(handle, cond, **GEOM, steps=4, guidance_scale=1.0, seed=3, sampler=name)
        assert torch.equal(a, b)
        runs[name] = a
    assert not torch.equal(runs["euler"], runs["flow_unipc"])
    assert not torch.equal(runs["dmd_student"], runs["euler"])


def test_euler_denoise_feeds_the_dit_sigma_times_1000(handle, cond):
    counter = Counter(handle.component("transformer"))
    trace = {}
    try:
        stages.denoise(handle, cond, **GEOM, steps=3, guidance_scale=1.0, seed=1, sampler="euler",
                       sigmas=[0.9, 0.6, 0.3, 0.0], trace=trace)
    finally:
        counter.close()
    seen = torch.cat(counter.calls)
    assert torch.allclose(seen, torch.tensor([900.0, 600.0, 300.0]), atol=1e-3)
    assert trace["run"].sigmas.tolist() == pytest.approx([0.9, 0.6, 0.3, 0.0])


# -- student checkpoints -------------------------------------------------------------------------

def _student(tmp_path, fixtures_root, whole_folder=True):
    """A student of tiny-dense: same config, other weights (every float tensor scaled by 0.9)."""
    from safetensors.torch import load_file, save_file

    src = fixtures_root / "models" / "tiny-dense" / "transformer"
    dst = (tmp_path / "student" / "transformer") if whole_folder else (tmp_path / "student-dit")
    dst.mkdir(parents=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    weights = load_file(src / "diffusion_pytorch_model.safetensors")
    save_file({k: v * 0.9 if v.is_floating_point() else v for k, v in weights.items()},
              dst / "diffusion_pytorch_model.safetensors")
    return dst.parent if whole_folder else dst


@pytest.mark.parametrize("whole_folder", [True, False])
def test_student_transformer_replaces_only_the_dit(tmp_path, fixtures_root, whole_folder):
    base = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    student = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu",
                                  transformer_folder=_student(tmp_path, fixtures_root, whole_folder))
    cond = stages.encode_prompt(base, "a red boat", None)
    assert torch.equal(cond.positive.embeds, stages.encode_prompt(student, "a red boat", None).positive.embeds)
    w_base = base.component("transformer").patch_embedder.weight
    assert torch.equal(student.component("transformer").patch_embedder.weight, w_base * 0.9)
    run = dict(**GEOM, steps=2, guidance_scale=1.0, seed=1, sampler="dmd_student")
    assert not torch.equal(stages.denoise(base, cond, **run), stages.denoise(student, cond, **run))
    assert student.info.weight_files["transformer"][0].parent.name in ("transformer", "student-dit")


def test_student_of_another_architecture_is_refused(tmp_path, fixtures_root):
    from lingbot_core.errors import CheckpointError

    with pytest.raises(CheckpointError, match="not the base checkpoint's architecture"):
        PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu",
                            transformer_folder=fixtures_root / "models" / "tiny-moe")
    with pytest.raises(CheckpointError, match="holds no transformer"):
        PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu", transformer_folder=tmp_path)
