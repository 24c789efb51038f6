"""Video-to-video: an input video re-noised to the strength's point of the sampler's schedule (the
refiner's SDEdit start with the base DiT), on the tiny models."""

from __future__ import annotations

import pytest
import torch

from lingbot_core import stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.video_to_video import prepare_video_start, steps_run, strength_sigmas, video_to_video

GEOMETRY = dict(height=32, width=32, num_frames=5)
RUN = dict(GEOMETRY, steps=6, shift=3.0, seed=7, guidance_scale=1.0)


def _open(fixtures_root, name: str = "tiny-dense") -> PipelineHandle:
    return PipelineHandle.open(fixtures_root / "models" / name, device="cpu")


def _video(frames: int = 5, size: int = 32) -> torch.Tensor:
    return torch.rand(frames, size, size, 3, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def dense(fixtures_root):
    handle = _open(fixtures_root)
    return handle, stages.encode_prompt(handle, "a boat", None)


@pytest.mark.parametrize("sampler", ["flow_unipc", "euler"])
def test_strength_one_equals_plain_sampling(dense, sampler):
    handle, cond = dense
    plain = stages.denoise(handle, cond, sampler=sampler, **RUN)
    v2v = video_to_video(handle, cond, video=_video(), strength=1.0, sampler=sampler, **RUN)
    assert torch.equal(v2v, plain)


def test_lower_strength_runs_the_schedules_tail_and_keeps_the_input(dense):
    handle, cond = dense
    steps = []
    start = prepare_video_start(handle, video=_video(), strength=0.5, steps=6, shift=3.0, seed=7, **GEOMETRY)
    full = handle.component("scheduler").sigma_grid(6, 3.0)
    assert start.sigmas == [float(s) for s in full[3:]] and len(start.sigmas) == steps_run(6, 0.5) == 3
    assert torch.equal(start.initial, stages.renoise(start.clean, start.noise, start.sigmas[0]))
    plain = stages.denoise(handle, cond, **RUN)
    half = video_to_video(handle, cond, video=_video(), strength=0.5,
                          callback=lambda step, total, _latents: steps.append(total), **RUN)
    assert steps == [3, 3, 3] and not torch.equal(half, plain)
    # closer to the input than plain sampling is: the input survives a half-way re-noise
    assert (half - start.clean).abs().mean() < (plain - start.clean).abs().mean()


def test_the_noise_is_plain_samplings_noise_and_a_latent_input_skips_the_vae(dense):
    handle, _cond = dense
    start = prepare_video_start(handle, video=_video(), strength=0.5, steps=6, shift=3.0, seed=7, **GEOMETRY)
    g = torch.Generator().manual_seed(7)
    assert torch.equal(start.noise, stages.prepare_latents(start.noise.shape, g))
    again = prepare_video_start(handle, latents=start.clean, strength=0.5, steps=6, shift=3.0, seed=7, **GEOMETRY)
    assert torch.equal(again.initial, start.initial)


def test_a_video_of_another_size_is_cropped_like_a_first_frame(dense):
    handle, _cond = dense
    wide = torch.rand(7, 32, 64, 3, generator=torch.Generator().manual_seed(1))
    start = prepare_video_start(handle, video=wide, strength=0.5, steps=6, shift=3.0, seed=7, **GEOMETRY)
    assert start.clean.shape == (1, 16, 2, 4, 4)


def test_bad_requests_are_refused_in_one_line_before_the_vae(fixtures_root):
    handle = _open(fixtures_root)
    cases = [
        (dict(video=_video(), strength=0.0), "must be a number in \\(0, 1\\]"),
        (dict(video=_video(), strength=1.5), "must be a number in \\(0, 1\\]"),
        (dict(video=_video(), strength=0.1), "runs no step"),
        (dict(video=_video(), strength=0.5, sampler="dmd_student"), "cannot start part-way"),
        (dict(video=_video(3), strength=0.5), "has 3 frames and the output 5"),
        (dict(video=torch.rand(5, 32, 32), strength=0.5), "shaped \\[F,H,W,3\\]"),
        (dict(video=_video() * 3, strength=0.5), "video"),
        (dict(strength=0.5), "exactly one input"),
        (dict(video=_video(), latents=torch.zeros(1, 16, 2, 4, 4), strength=0.5), "exactly one input"),
        (dict(latents=torch.zeros(1, 16, 1, 4, 4), strength=0.5), "latent must have shape"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ValueError, match=words) as err:
            prepare_video_start(handle, steps=6, shift=3.0, seed=7, **GEOMETRY, **kwargs)
        assert "\n" not in str(err.value)
    assert "vae" not in handle.shared.loaded and "transformer" not in handle.shared.loaded


def test_strength_sigmas_for_euler_are_its_grids_tail(fixtures_root):
    from lingbot_core.sampling import euler_sigmas

    handle = _open(fixtures_root)
    tail = strength_sigmas(handle, steps=4, shift=3.0, strength=0.5, sampler="euler")
    assert tail == [float(s) for s in euler_sigmas(4, 3.0)[2:]]


def test_moe_base_and_the_refiner_after_it(fixtures_root):
    handle = _open(fixtures_root, "tiny-moe")
    cond = stages.encode_prompt(handle, "a boat", None)
    plain = stages.denoise(handle, cond, **RUN)
    assert torch.equal(video_to_video(handle, cond, video=_video(), strength=1.0, **RUN), plain)
    latents = video_to_video(handle, cond, video=_video(), strength=0.6, **RUN)
    frames = stages.decode(handle, latents)
    refined = stages.refine(handle, frames, cond, height=32, width=32, steps=4, seed=7)
    assert refined.shape == (5, 32, 32, 3) and torch.isfinite(refined).all()


# -- the Denoise node's `video` and `denoise` inputs --------------------------------------------------

def _node_run(pipe, cond, **extra):
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    out = NODE_CLASS_MAPPINGS["LingBotDenoise"].execute(pipe, cond, 32, 32, 5, 6, 1.0, 3.0, 7, **extra)
    return out.args[0]["samples"], out.ui


@pytest.fixture(scope="module")
def node_pipe():
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    (pipe,) = NODE_CLASS_MAPPINGS["LingBotLoader"].execute("tiny (built-in dense)", "auto", "auto", "default",
                                                           device="cpu").args
    (cond,) = NODE_CLASS_MAPPINGS["LingBotTextEncode"].execute(pipe, "a boat", encode_negative=False).args
    return pipe, cond


def test_denoise_node_video_to_video(node_pipe):
    pipe, cond = node_pipe
    plain, ui = _node_run(pipe, cond)
    same, ui_same = _node_run(pipe, cond, video=_video(), denoise=1.0)
    assert torch.equal(same, plain) and "not used" in ui_same.as_dict()["text"][0] and ui.as_dict() == {"text": ("",)}
    half, _ = _node_run(pipe, cond, video=_video(), denoise=0.5)
    assert half.shape == plain.shape and not torch.equal(half, plain)
    # a LATENT input at denoise < 1 is the clean video (here: the half run's output, re-noised again)
    again, _ = _node_run(pipe, cond, latent={"samples": half}, denoise=0.5)
    assert again.shape == plain.shape and not torch.equal(again, half)


def test_denoise_node_refusals(node_pipe):
    pipe, cond = node_pipe
    for extra, words in [(dict(video=_video(), denoise=0.5, sigmas="1.0, 0.5"), "custom sigmas and denoise"),
                         (dict(video=_video(), denoise=0.5, sampler="dmd_student"), "cannot start part-way"),
                         (dict(denoise=0.5), "exactly one input")]:
        with pytest.raises(ValueError, match=words):
            _node_run(pipe, cond, **extra)


def test_ti2v_keeps_the_first_frame_pinned(dense):
    handle, _cond = dense
    image = torch.rand(1, 32, 32, 3, generator=torch.Generator().manual_seed(5))
    image_cond = stages.encode_image(handle, image, 32, 32)
    cond = stages.encode_prompt(handle, "a boat", None, image=image_cond, mode="ti2v")
    plain = stages.denoise(handle, cond, image_cond=image_cond, **RUN)
    assert torch.equal(video_to_video(handle, cond, video=_video(), strength=1.0, image_cond=image_cond, **RUN),
                       plain)
    half = video_to_video(handle, cond, video=_video(), strength=0.5, image_cond=image_cond, **RUN)
    pinned = image_cond.sample_latent(torch.Generator().manual_seed(RUN["seed"]))
    assert torch.equal(half[:, :, :1], pinned) and not torch.equal(half, plain)


# -- python -m lingbot_core --video / --denoise --------------------------------------------------------

def test_core_command_video_to_video(tmp_path, capsys):
    from lingbot_core.__main__ import main as core_main
    from lingbot_core.video import save_mp4

    clip = save_mp4(torch.rand(9, 64, 96, 3, generator=torch.Generator().manual_seed(2)), tmp_path / "in.mp4")
    assert core_main(["--output", str(tmp_path / "out"), "--video", str(clip), "--denoise", "0.5",
                      "--steps", "4", "--cfg", "1"]) == 0
    run = capsys.readouterr()
    assert run.out.strip().endswith(".mp4") and "step 2/2" in run.err and "step 3/" not in run.err
    text = tmp_path / "notes.mp4"
    text.write_text("not a video")
    for argv, words in [(["--denoise", "0.5"], "add --video"),
                        (["--video", str(text)], "--video: cannot read 'notes.mp4' as a video"),
                        (["--video", str(clip), "--denoise", "1.5"], "--denoise must be in"),
                        (["--video", str(clip), "--mode", "t2i"], "use --mode t2v or ti2v"),
                        (["--video", str(clip), "--sampler", "dmd_student"], "cannot start part-way")]:
        assert core_main(["--output", str(tmp_path / "out"), "--quiet", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_shipped_v2v_workflow_runs_on_a_file(tmp_path, capsys):
    from lingbot_core.video import save_mp4
    from lingbot_nodes.cli import main

    clip = save_mp4(torch.rand(12, 48, 80, 3, generator=torch.Generator().manual_seed(4)), tmp_path / "in.mp4")
    assert main(["v2v", "--output", str(tmp_path / "out"), "--set", f"Load Video.path={clip}"]) == 0
    run = capsys.readouterr()
    assert run.out.strip().endswith("v2v_00001_.mp4") and "Denoise: done in" in run.err and "3/3 steps" in run.err
    text = tmp_path / "notes.mp4"
    text.write_text("not a video")
    assert main(["v2v", "--output", str(tmp_path / "out"), "--set", f"Load Video.path={text}"]) == 2
    assert "cannot read 'notes.mp4' as a video" in capsys.readouterr().err
