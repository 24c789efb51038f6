"""Extending a video segment by segment, each conditioned on the previous frames' last k latent
frames, on the tiny dense model."""

from __future__ import annotations

import pytest
import torch

from lingbot_core import extend as ext
from lingbot_core import stages
from lingbot_core.handle import PipelineHandle

SIZE = 32
RUN = dict(steps=3, shift=3.0, guidance_scale=1.0, seed=5)


def _video(frames: int = 9) -> torch.Tensor:
    return ext.to_8bit(torch.rand(frames, SIZE, SIZE, 3, generator=torch.Generator().manual_seed(3)))


@pytest.fixture(scope="module")
def dense(fixtures_root):
    handle = PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu")
    return handle, stages.encode_prompt(handle, "a boat", None)


def test_overlap_follows_the_vaes_time_packing():
    assert [ext.overlap_frames(k) for k in (1, 2, 3)] == [1, 5, 9]
    assert ext.extended_length(9, 3, 9, 1) == 9 + 3 * 8


def test_three_segments_are_three_segments_frames_less_the_overlap(dense, tmp_path):
    handle, cond = dense
    first = _video(9)  # a 9-frame clip as the first segment
    heard = []
    out = ext.extend_video(handle, first, cond, segments=2, k=2, num_frames=9, folder=tmp_path,
                           on_segment=lambda i, frames, reused: heard.append((i, frames.shape[0], reused)), **RUN)
    assert out.shape == (3 * 9 - 2 * ext.overlap_frames(2), SIZE, SIZE, 3)
    assert heard == [(0, 4, False), (1, 4, False)]
    assert torch.equal(out[:9], first)  # the input kept as it was, nothing repeated after it
    assert list(tmp_path.iterdir()) == []  # a finished extension leaves no segment files


class Stop(Exception):
    pass


def test_an_interrupted_extension_keeps_its_segments_and_a_rerun_continues(dense, tmp_path):
    handle, cond = dense
    first = _video(9)
    whole = ext.extend_video(handle, first, cond, segments=3, k=1, num_frames=9, **RUN)
    calls = []

    def stop_in_the_third(step, total, latents):
        calls.append(step)
        if len(calls) > 2 * RUN["steps"]:
            raise Stop

    with pytest.raises(Stop):
        ext.extend_video(handle, first, cond, segments=3, k=1, num_frames=9, folder=tmp_path,
                         callback=stop_in_the_third, **RUN)
    assert len(list(tmp_path.glob("*.npy"))) == 2
    calls.clear()
    again = ext.extend_video(handle, first, cond, segments=3, k=1, num_frames=9, folder=tmp_path,
                             callback=lambda *a: calls.append(a), **RUN)
    assert torch.equal(again, whole)  # the same video as an uninterrupted run
    assert len(calls) == RUN["steps"]  # only the third segment was sampled
    # another seed does not pick up saved segments
    ext.extend_video(handle, first, cond, segments=1, k=1, num_frames=9, folder=tmp_path, keep=True, **RUN)
    ext.extend_video(handle, first, cond, segments=1, k=1, num_frames=9, folder=tmp_path,
                     callback=lambda *a: calls.append(a), **{**RUN, "seed": 6})
    assert len(calls) == 2 * RUN["steps"]


@pytest.mark.parametrize("k", [1, 2])
def test_a_segment_is_denoise_with_the_k_frame_condition_pinned(dense, k):
    handle, cond = dense
    video = _video(9)
    segment = ext.segment_frames(handle, cond, video, k=k, height=SIZE, width=SIZE, num_frames=9,
                                 **{**RUN, "seed": 11})
    g = torch.Generator().manual_seed(11)
    cond_latent = ext.condition_latent(handle, video, k=k, height=SIZE, width=SIZE, generator=g)
    assert cond_latent.shape[2] == k
    latents = stages.denoise(handle, cond, height=SIZE, width=SIZE, num_frames=9, steps=3, shift=3.0,
                             guidance_scale=1.0, generator=g, cond_latent=cond_latent)
    assert torch.equal(latents[:, :, :k], cond_latent)
    frames = stages.decode(handle, latents)
    assert torch.equal(segment, ext.to_8bit(frames[ext.overlap_frames(k):]))


def test_k_one_is_the_ti2v_first_frame_condition(dense):
    handle, _cond = dense
    video = _video(9)
    image_cond = stages.encode_image(handle, video[-1], SIZE, SIZE)
    got = ext.condition_latent(handle, video, k=1, height=SIZE, width=SIZE, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(got, image_cond.sample_latent(torch.Generator().manual_seed(2)), atol=1e-5)


@pytest.mark.parametrize("change, message", [
    (dict(segments=0), "segments must be"),
    (dict(segments=True), "segments must be"),
    (dict(k=3), "overlap (condition latent frames k)"),
    (dict(k=0), "overlap (condition latent frames k)"),
    (dict(num_frames=8), "4n+1"),
    (dict(num_frames=1), "adds nothing"),
    (dict(video=torch.rand(3, SIZE, SIZE, 3)), "lower k"),
    (dict(video=torch.rand(SIZE, SIZE, 3)), "[F,H,W,3]"),
    (dict(video=torch.full((9, SIZE, SIZE, 3), 2.0)), "video"),
])
def test_bad_inputs_are_refused_in_one_line(dense, change, message):
    handle, cond = dense
    args = dict(video=_video(9), segments=1, k=2, num_frames=9) | change
    with pytest.raises(ValueError) as err:
        ext.extend_video(handle, args.pop("video"), cond, **args, **RUN)
    assert message in str(err.value) and "\n" not in str(err.value)


def _frames(path) -> int:
    import av

    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))


def test_shipped_extend_workflow_runs_and_continues_a_file(tmp_path, capsys):
    from lingbot_core.video import save_mp4
    from lingbot_nodes.cli import main

    assert main(["extend", "--output", str(tmp_path / "out"), "--quiet"]) == 0
    made = capsys.readouterr().out.strip().splitlines()[-1]
    assert _frames(made) == ext.extended_length(9, 3, 9, 1)  # the shipped 9-frame pattern and 3 segments
    clip = save_mp4(torch.rand(13, 64, 64, 3, generator=torch.Generator().manual_seed(4)), tmp_path / "in.mp4")
    assert main(["extend", "--output", str(tmp_path / "out"), "--quiet", "--video", str(clip),
                 "--segments", "1"]) == 0
    assert _frames(capsys.readouterr().out.strip().splitlines()[-1]) == 13 + 8  # the whole clip, then one segment
    assert not any((tmp_path / "out" / "lingbot" / "extend_segments").iterdir())


def test_extend_flags_on_a_workflow_without_the_nodes_are_refused(tmp_path, capsys):
    from lingbot_nodes.cli import main

    assert main(["t2v", "--output", str(tmp_path), "--segments", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--segments given, but lingbot_t2v_dense.json has no LingBotExtendVideo node" in err
    assert len(err.splitlines()) == 1
    assert main(["extend", "--output", str(tmp_path), "--segments", "0"]) == 2
    assert "segments" in capsys.readouterr().err


def test_extend_node_refuses_more_prompt_lines_than_segments_and_mirrors_the_core_cap(dense):
    from lingbot_nodes.extend import MAX_SEGMENTS, LingBotExtendVideo

    handle, cond = dense
    assert MAX_SEGMENTS == ext.MAX_SEGMENTS
    with pytest.raises(ValueError, match="2 lines for 1 segments: one per segment"):
        LingBotExtendVideo.execute(handle, cond, _video(9), 1, 1, 9, 2, 1.0, 3.0, 1, prompts="a\nb")


def test_extend_node_encodes_one_prompt_per_segment(dense):
    from lingbot_nodes.extend import LingBotExtendVideo

    handle, cond = dense
    out = LingBotExtendVideo.execute(handle, cond, _video(9), 2, 1, 9, 2, 1.0, 3.0, 1, prompts="a boat\na ship",
                                     save_segments=False)
    frames = out.result[0] if hasattr(out, "result") else out[0]
    same = ext.extend_video(handle, _video(9), cond, segments=2, k=1, num_frames=9, steps=2,
                            guidance_scale=1.0, shift=3.0, seed=1)
    assert frames.shape == same.shape
    assert torch.equal(frames[:17], same[:17])  # segment 0: "a boat" is the conditioning's prompt
    assert not torch.equal(frames[17:], same[17:])  # segment 1: "a ship"


def test_memory_bench_quick(capsys):
    """bench/extend_memory.py at its smallest: the rows, their frame counts, and 3 segments' working
    memory (peak less the joined output) no larger than 1 segment's."""
    from bench import extend_memory

    threads = torch.get_num_threads()
    try:
        result = extend_memory.main(["--quick", "--threads", "1", "--steps", "2"])
    finally:
        torch.set_num_threads(threads)
    rows = {r["run"]: r for r in result["rows"]}
    assert [r["frames"] for r in rows.values()] == [9, ext.extended_length(9, 1, 9, 1), ext.extended_length(9, 3, 9, 1)]
    assert rows["extend 3"]["working"] <= rows["extend 1"]["working"] * 1.05
    assert "peak - output" in capsys.readouterr().out


def test_extend_node_refuses_a_parallel_pipe_before_any_work(dense, monkeypatch):
    from lingbot_core.worker_pool import pool
    from lingbot_nodes.extend import LingBotExtendVideo

    handle, cond = dense
    monkeypatch.setattr(pool, "pool_of", lambda pipe: object())
    with pytest.raises(ValueError, match="from before LingBot Parallel"):
        LingBotExtendVideo.execute(handle, cond, _video(9), 1, 1, 9, 2, 1.0, 3.0, 1)


def test_saved_segments_belong_to_the_model_that_sampled_them(dense, tmp_path):
    """A segment saved by one model is not reused by another: here the same DiT with a LoRA on the view."""
    from lingbot_core import lora as lora_ops

    handle, cond = dense
    dit = handle.component("transformer")
    target = next(n for n, m in dit.named_modules() if n.endswith("attn.to_v"))
    width = dict(dit.named_modules())[target].weight.shape[0]
    g = torch.Generator().manual_seed(1)
    lora = lora_ops.LoraFile.from_state_dict({
        f"diffusion_model.{target}.lora_down.weight": torch.randn(2, width, generator=g),
        f"diffusion_model.{target}.lora_up.weight": torch.randn(width, 2, generator=g)}, name="t")
    with_lora = lora_ops.with_lora(handle, lora)
    assert ext.model_identity(with_lora) != ext.model_identity(handle)
    calls = []
    ext.extend_video(handle, _video(9), cond, segments=1, k=1, num_frames=9, folder=tmp_path, keep=True, **RUN)
    ext.extend_video(with_lora, _video(9), cond, segments=1, k=1, num_frames=9, folder=tmp_path, keep=True,
                     callback=lambda *a: calls.append(a), **RUN)
    assert len(calls) == RUN["steps"]  # sampled again, not read from the plain model's file
    assert len(list(tmp_path.glob("*.npy"))) == 2
