"""Video-to-video and extension composed with the other run options, on the tiny dense model: every
offload mode, a LoRA view, quantized weights, the step cache and compiled blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compile_fakes import counted_eager_blocks

from lingbot_core import extend as ext
from lingbot_core import lora as lora_ops
from lingbot_core import stages
from lingbot_core.handle import PipelineHandle
from lingbot_core.placement.door import configure_offload
from lingbot_core.placement.modes import MODE_ORDER
from lingbot_core.sampling.step_cache import MIN_STEPS, StepCacheSettings
from lingbot_core.video_to_video import video_to_video

MODES = list(MODE_ORDER)  # every registered offload mode
OPTS = {"group": {"use_stream": False}}
V2V = dict(height=32, width=32, num_frames=5, steps=4, shift=3.0, seed=7, guidance_scale=3.0, strength=0.5)
EXTEND = dict(segments=2, k=1, num_frames=5, steps=2, shift=3.0, guidance_scale=3.0, seed=5)


def _open(root, name: str = "tiny-dense") -> PipelineHandle:
    return PipelineHandle.open(root / "models" / name, device="cpu")


def _clip(frames: int = 5) -> torch.Tensor:
    return ext.to_8bit(torch.rand(frames, 32, 32, 3, generator=torch.Generator().manual_seed(3)))


def _lora() -> lora_ops.LoraFile:
    g = torch.Generator().manual_seed(1)
    return lora_ops.LoraFile.from_state_dict({
        "diffusion_model.blocks.1.attn.to_v.lora_down.weight": torch.randn(2, 32, generator=g) * 0.5,
        "diffusion_model.blocks.1.attn.to_v.lora_up.weight": torch.randn(32, 2, generator=g) * 0.5,
    }, name="compose")


def _both(handle, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """V2V latents and a 2-segment extension's frames on `handle` (a handle or a view)."""
    cond = stages.encode_prompt(handle, "a boat", "")
    v2v = video_to_video(handle, cond, video=_clip().float(), **{**V2V, **options})
    extended = ext.extend_video(handle, _clip(), cond, **{**EXTEND, **options})
    return v2v, extended


@pytest.fixture(scope="module")
def reference(fixtures_root):
    return _both(_open(fixtures_root))


@pytest.fixture(scope="module")
def lora_reference(fixtures_root):
    return _both(lora_ops.with_lora(_open(fixtures_root), _lora(), 1.0))


def test_the_lora_changes_both(reference, lora_reference):
    assert not torch.equal(reference[0], lora_reference[0])
    assert not torch.equal(reference[1], lora_reference[1])


@pytest.mark.parametrize("mode", MODES)
def test_every_offload_mode_equals_none(fixtures_root, reference, lora_reference, mode):
    handle = _open(fixtures_root)
    configure_offload(handle, mode, **OPTS.get(mode, {}))
    v2v, extended = _both(handle)
    assert torch.equal(v2v, reference[0]) and torch.equal(extended, reference[1])
    v2v, extended = _both(lora_ops.with_lora(handle, _lora(), 1.0))  # a LoRA view on the offloaded handle
    assert torch.equal(v2v, lora_reference[0]) and torch.equal(extended, lora_reference[1])


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, fixtures_root):
    """The tiny dense checkpoint as fp8 and as GGUF Q8_0, quantized once."""
    from lingbot_core.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("compose")
    return {t: quantize_checkpoint(fixtures_root / "models" / "tiny-dense", root / t, t) for t in ("fp8", "gguf-q8_0")}


@pytest.mark.parametrize("target", ["fp8", "gguf-q8_0"])
@pytest.mark.parametrize("mode", ["none", MODES[-1]])
def test_quantized_weights_under_offload(quantized, reference, mode, target):
    plain = _both(PipelineHandle.open(quantized[target], device="cpu"))
    assert not torch.equal(plain[0], reference[0])  # the quantized weights are what ran
    handle = PipelineHandle.open(quantized[target], device="cpu")
    configure_offload(handle, mode, **OPTS.get(mode, {}))
    got = _both(handle)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


def test_step_cache(fixtures_root):
    """At enough steps the cache runs under both (a zero threshold skips nothing: the uncached result);
    too few steps are refused with the cache's one line."""
    handle = _open(fixtures_root)
    many = dict(steps=2 * (MIN_STEPS + 1))  # V2V at strength 0.5 runs half of them
    off = _both(handle, **many)
    exact = _both(handle, **many, step_cache=StepCacheSettings("first_block", threshold=0.0))
    assert torch.equal(exact[0], off[0]) and torch.equal(exact[1], off[1])
    skipping = _both(handle, **many, step_cache=StepCacheSettings("first_block", threshold=1e9, warmup_steps=2,
                                                                   max_skips=3))
    assert not torch.equal(skipping[0], off[0]) and not torch.equal(skipping[1], off[1])
    cond = stages.encode_prompt(handle, "a boat", "")
    with pytest.raises(ValueError, match="step_cache to off"):
        video_to_video(handle, cond, video=_clip().float(), **V2V, step_cache="first_block")
    with pytest.raises(ValueError, match="step_cache to off"):
        ext.extend_video(handle, _clip(), cond, **EXTEND, step_cache="first_block")


def test_compiled_blocks_match_eager(fixtures_root, reference):
    """compile="blocks" (dynamo with the eager backend here) runs both through the compiled blocks."""

    with counted_eager_blocks() as calls:
        got = _both(PipelineHandle.open(fixtures_root / "models" / "tiny-dense", device="cpu", compile="blocks"))
    assert calls[0] > 0
    assert torch.allclose(got[0], reference[0], atol=1e-5)
    assert (got[1].float() - reference[1].float()).abs().max() <= 1 / 255 + 1e-6  # 8-bit frames


# -- lingbot-run --jobs: each job its own input video ----------------------------------------------------

def test_jobs_give_each_v2v_its_own_video(tmp_path, capsys, monkeypatch):
    import json

    from lingbot_core import video as video_files
    from lingbot_nodes.cli import main
    from lingbot_nodes.jobs import job_overrides, read_jobs

    clips = [video_files.save_mp4(torch.rand(9, 64, 64, 3, generator=torch.Generator().manual_seed(s)),
                                  tmp_path / f"in{s}.mp4") for s in (1, 2)]
    saved = {}  # the frames each written file got (x264 under load may encode one input two ways)
    real = video_files.save_mp4

    def recording(frames, path, *args, **kwargs):
        saved[Path(path).name] = frames.clone()
        return real(frames, path, *args, **kwargs)

    monkeypatch.setattr(video_files, "save_mp4", recording)
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("\n".join(json.dumps(j) for j in [
        {"id": "one", "video": str(clips[0])}, {"id": "two", "video": str(clips[1])},
        {"id": "gone", "video": str(tmp_path / "missing.mp4")}]) + "\n")
    assert main(["v2v", "--output", str(tmp_path / "out"), "-q", "--jobs", str(jobs)]) == 1  # "gone" failed
    made = [Path(p).name for p in capsys.readouterr().out.split()]
    assert [name.split("_")[1] for name in made] == ["one", "two"]
    manifest = [json.loads(line) for line in (tmp_path / "out" / "jobs.manifest.jsonl").read_text().splitlines()]
    assert [e["status"] for e in manifest] == ["done", "done", "failed"]
    assert "missing.mp4" in manifest[2]["error"] and "\n" not in manifest[2]["error"]
    # each job's video is the one that ran: the same as --video with that file alone
    assert main(["v2v", "--output", str(tmp_path / "alone"), "-q", "--video", str(clips[1])]) == 0
    alone = Path(capsys.readouterr().out.split()[-1]).name
    assert torch.equal(saved[made[1]], saved[alone]) and not torch.equal(saved[made[0]], saved[made[1]])
    # on an extension the video key, like --video, takes the whole clip
    nodes = {"3": {"class_type": "LingBotLoadVideo", "inputs": {}}, "9": {"class_type": "LingBotExtendVideo"}}
    assert job_overrides(nodes, read_jobs(jobs)[0])[-1] == "3.frame_count=0"


# -- the fit check counts the input video's VAE encode ---------------------------------------------------

def test_the_fit_check_refuses_an_encode_that_cannot_fit(fixtures_root, monkeypatch):
    """A budget the text and denoise phases fit but one VAE pass over the input does not: V2V and
    the extension are refused in one line before the VAE (or anything else) loads."""
    from lingbot_core.placement import estimate, plan

    handle = _open(fixtures_root)
    cond = stages.encode_prompt(handle, "a boat", "")
    sizes = plan.model_sizes(handle.shared)
    size, frames, k = 64, 5, 1

    def vae_pass(n: int) -> int:  # what one VAE pass over n frames needs: the estimator's VAE term
        return sizes.vae + estimate.activation_bytes(sizes, estimate.Geometry(height=size, width=size,
                                                                          num_frames=n))["decode"]

    geometry = estimate.Geometry(height=size, width=size, num_frames=frames, cfg=True)
    sampling = estimate.estimate_peak("sequential", sizes, geometry, phases=("text", "denoise"))
    budget = min(vae_pass(frames), vae_pass(ext.overlap_frames(k))) - 1
    assert sampling <= budget  # only the encode does not fit
    monkeypatch.setattr(plan, "device_capacity", lambda _device: budget)
    assert "vae" not in handle.shared.loaded
    clip = torch.rand(frames, size, size, 3, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="encoding the input video .* even with sequential offload") as err:
        video_to_video(handle, cond, video=clip, **{**V2V, "height": size, "width": size})
    assert "\n" not in str(err.value) and "vae" not in handle.shared.loaded
    with pytest.raises(ValueError, match="one extension segment .* even with sequential offload") as err:
        ext.extend_video(handle, ext.to_8bit(clip), cond, **{**EXTEND, "k": k})
    assert "\n" not in str(err.value) and not {"vae", "transformer"} & set(handle.shared.loaded)


# -- a parallel view (--parallel / torchrun): V2V on two gloo processes, extension refused ---------------

def _parallel_worker(rank: int, world: int, port: int, out: str, tiny: str) -> None:
    import json

    from lingbot_core.distributed import ParallelLayout
    from lingbot_core.distributed.launch import init_loopback_group

    torch.set_num_threads(1)
    init_loopback_group(rank, world, port)
    try:
        handle = PipelineHandle.open(tiny, device="cpu")
        view = handle.with_parallel(ParallelLayout.create(2, 1))  # one CFG branch per process
        cond = stages.encode_prompt(view, "a boat", "")
        shared = video_to_video(view, cond, video=_clip().float(), **V2V)
        every = [torch.empty_like(shared) for _ in range(world)]
        torch.distributed.all_gather(every, shared)
        found = {"same": all(torch.equal(e, shared) for e in every), "vae_loaded": "vae" in handle.shared.loaded}
        try:
            ext.extend_video(view, _clip(), cond, **EXTEND)
            found["extend"] = "ran"
        except ValueError as err:
            found["extend"] = str(err)
        if rank == 0:
            alone = video_to_video(handle, stages.encode_prompt(handle, "a boat", ""), video=_clip().float(), **V2V)
            found["diff"] = ((shared - alone).abs().max() / alone.abs().max()).item()
        Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_v2v_on_a_parallel_view_matches_one_process_and_extension_is_refused(tmp_path):
    import json

    import torch.multiprocessing as mp

    from lingbot_core.distributed.launch import free_loopback_port
    from lingbot_core.tiny import ensure_tiny_checkpoint

    tiny = str(ensure_tiny_checkpoint("dense"))
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    mp.start_processes(_parallel_worker, args=(2, free_loopback_port(), str(tmp_path), tiny), nprocs=2, join=True,
                       start_method=method)
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert found[0]["diff"] <= 1e-5, found  # the CFG-parallel V2V is the one-process V2V
    for rank, got in enumerate(found):
        assert got["same"], rank
        assert got["vae_loaded"] is (rank == 0), rank  # rank 0 encoded the input video; the other received it
        assert "runs in one process" in got["extend"] and "\n" not in got["extend"], got


def test_v2v_through_lingbot_parallel_matches_one_device(fixtures_root, monkeypatch):
    """The Denoise node with a video and denoise below 1 on a LingBot Parallel pipe (this process
    rank 0, one forked worker, CFG parallel): the same latents as on the plain pipe."""
    from lingbot_core.worker_pool import pool as pool_module
    from lingbot_core.worker_pool.pool import WorkerPool, tag
    from lingbot_core.worker_pool.spec import PoolSpec
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    monkeypatch.setattr(pool_module, "START_METHOD", "fork")
    handle = _open(fixtures_root)
    cond = stages.encode_prompt(handle, "a boat", "")
    node = NODE_CLASS_MAPPINGS["LingBotDenoise"]
    args = dict(width=32, height=32, frames=5, steps=4, cfg=3.0, shift=3.0, seed=7, video=_clip().float(), denoise=0.5)
    expected = node.execute(handle, cond, **args)[0]["samples"]
    pool = WorkerPool(PoolSpec.make(handle, "cpu,cpu", 2))
    try:
        got = node.execute(tag(handle, pool), cond, **args)[0]["samples"]
        assert pool.started  # the denoise ran on the pool
    finally:
        pool.release()
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-5
    plain = node.execute(handle, cond, **{**args, "denoise": 1.0})[0]["samples"]
    assert not torch.equal(plain, expected)  # the video was used


def test_lingbot_run_v2v_jobs_under_parallel_and_extend_refused(tmp_path, fixtures_root, capfd):
    """`lingbot-run v2v --parallel cfg=2,ulysses=1 --jobs` on two gloo ranks (torchrun's environment):
    rank 0 writes the job's video from its own input; `extend --parallel` is refused in one line."""
    import json

    import torch.multiprocessing as mp
    from jobs_worker import run_parallel_cli

    from lingbot_core import video as video_files
    from lingbot_core.distributed.launch import free_loopback_port

    clip = video_files.save_mp4(torch.rand(9, 64, 64, 3, generator=torch.Generator().manual_seed(1)),
                                tmp_path / "in.mp4")
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"id": "one", "video": str(clip), "steps": 3}) + "\n")
    model = ["--model", str(fixtures_root / "models" / "tiny-dense")]  # built already, not raced by two ranks
    runs = [["v2v", *model, "--parallel", "cfg=2,ulysses=1", "-q", "--jobs", str(jobs), "--output", str(tmp_path / "out")],
            ["extend", *model, "--parallel", "cfg=2,ulysses=1", "-q", "--video", str(clip), "--segments", "1",
             "--output", str(tmp_path / "ext")]]
    ports = [free_loopback_port() for _ in runs]
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    mp.start_processes(run_parallel_cli, args=(2, ports, str(tmp_path), runs, 1), nprocs=2, join=True,
                       start_method=method)
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    v2v = [runs_of_rank[0] for runs_of_rank in found]
    assert [r["code"] for r in v2v] == [0, 0], v2v
    assert [Path(p).name for p in v2v[0]["printed"]] == ["v2v_one_00001_.mp4"] and v2v[1]["printed"] == []
    manifest = [json.loads(line) for line in (tmp_path / "out" / "jobs.manifest.jsonl").read_text().splitlines()]
    assert [(e["id"], e["status"]) for e in manifest] == [("one", "done")]
    assert all(runs_of_rank[1]["code"] != 0 for runs_of_rank in found), found
    assert "extending a video runs in one process" in capfd.readouterr().err
