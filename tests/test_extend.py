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
    # a rerun continues from the written segments: nothing sampled, the same video
    calls = []
    again = ext.extend_video(handle, first, cond, segments=3, k=2, num_frames=9, folder=tmp_path,
                             callback=lambda *a: calls.append(a), **RUN)
    assert torch.equal(again[:out.shape[0]], out) and again.shape[0] == out.shape[0] + 4
    assert len(calls) == RUN["steps"]  # only the third segment ran
    # another seed does not pick up those segments
    other = ext.extend_video(handle, first, cond, segments=1, k=2, num_frames=9, folder=tmp_path,
                             **{**RUN, "seed": 6})
    assert not torch.equal(other, out[:13])


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
