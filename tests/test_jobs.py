"""Many videos (issue 24): `lingbot-run --jobs`, its manifest and resume, and the split over processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from jobs_worker import run_parallel_cli, run_share

from lingbot_core.parallel.jobs import (
    DONE,
    FAILED,
    JOB_FIELDS,
    Job,
    JobsFileError,
    WorldPlace,
    read_jobs,
    world_place,
)
from lingbot_core.parallel.launch import free_loopback_port
from lingbot_nodes.cli import main


def _write(path: Path, lines: list) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def _manifest(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jobs_run_record_fail_alone_and_resume(tmp_path, capsys, fixtures_root):
    """Four tiny T2I jobs: two good, one the workflow refuses, one that fails while running (after the
    models loaded); the failures are recorded and the last good job still runs on the same handle."""
    jobs = _write(tmp_path / "jobs.jsonl", [
        {"id": "a", "seed": 1, "size": "48x32"},
        {"id": "bad", "set": ["Denoise.width=40"]},
        "# a comment line, then a blank one",
        "",
        {"id": "boom", "set": ["Denoise.sigmas=abc"]},
        {"seed": 2, "size": [32, 48], "steps": 2},
    ])
    out = tmp_path / "out"
    args = ["t2i", "--model", str(fixtures_root / "models" / "tiny-dense"), "--output", str(out), "--jobs", str(jobs)]
    assert main(args) == 1  # a job failed; the others ran
    captured = capsys.readouterr()
    written = captured.out.split()
    assert [Path(p).name for p in written] == ["t2i_a_00001_.png", "t2i_line6_00001_.png"]
    from PIL import Image

    assert [Image.open(p).size for p in written] == [(48, 32), (32, 48)]
    assert captured.err.count("Loader: done") == 1  # loaded once: the runtime failure left the handle usable
    manifest = out / "jobs.manifest.jsonl"
    entries = _manifest(manifest)
    assert [(e["id"], e["line"], e["status"]) for e in entries] == [
        ("a", 1, DONE), ("bad", 2, FAILED), ("boom", 5, FAILED), ("line6", 6, DONE)]
    assert entries[0]["outputs"] == [written[0]] and entries[0]["seconds"] > 0
    assert "multiple of 16" in entries[1]["error"]
    assert "LingBotDenoise" in entries[2]["error"] and "sigmas" in entries[2]["error"]
    assert "error: job boom (line 5)" in captured.err

    assert main(args) == 1  # resume: the done jobs are skipped, the failed ones tried again
    captured = capsys.readouterr()
    assert captured.out.split() == []
    assert [(e["id"], e["status"]) for e in _manifest(manifest)[4:]] == [("bad", FAILED), ("boom", FAILED)]
    assert "0 done, 2 failed, 2 already done" in captured.err


@pytest.mark.parametrize("line,message", [
    ("{\"seed\": 1", "not JSON"),
    ("[1, 2]", "a job is a JSON object"),
    ({"seeed": 1}, "unknown key 'seeed'"),
    ({"seed": "one"}, "'seed' must be int"),
    ({"size": "832 by 480"}, "\"WxH\""),
    ({"id": "../x"}, "id '../x'"),
    ({"set": "Denoise.seed=1", "id": "first"}, "'first' is already used on line 1"),
    ({"set": [1]}, "NODE.INPUT=VALUE"),
])
def test_a_bad_line_stops_everything_before_work_and_names_the_line(tmp_path, capsys, line, message):
    jobs = _write(tmp_path / "jobs.jsonl", [{"id": "first", "seed": 3}, line])
    assert main(["t2i", "--output", str(tmp_path), "--jobs", str(jobs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and "jobs.jsonl:2: " in err and message in err, err
    assert not (tmp_path / "jobs.manifest.jsonl").exists()


def test_job_fields_fill_their_inputs():
    from lingbot_core.parallel.jobs import job_overrides

    nodes = {"1": {"class_type": "LingBotDenoise", "inputs": {}}, "2": {"class_type": "LingBotRefine", "inputs": {}},
             "3": {"class_type": "LingBotSaveVideo", "inputs": {"filename_prefix": "clips/x"}}}
    job = Job("j1", 1, {"seed": 5, "size": "64x32"}, ("Save.fps=12",))
    assert job_overrides(nodes, job) == ['3.filename_prefix="clips/x_j1"', "1.seed=5", "2.seed=5", "1.width=64",
                                         "1.height=32", "Save.fps=12"]
    with pytest.raises(ValueError, match="no such node"):
        job_overrides({}, Job("j2", 1, {"frames": 5}))
    for key in ("prompt", "negative"):
        with pytest.raises(ValueError, match="must be str"):
            JOB_FIELDS[key].values(3)


def test_world_place_splits_jobs_by_their_place_in_the_file(monkeypatch):
    jobs = [Job(f"j{i}", i + 1) for i in range(7)]
    place = WorldPlace(rank=5, world_size=6, group_size=2)  # three groups of two ranks
    assert (place.groups, place.group, place.leader) == (3, 2, False)
    assert [j.id for j in place.share(jobs)] == ["j2", "j5"]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert world_place() == WorldPlace(1, 4, 1)
    with pytest.raises(ValueError, match="do not divide"):
        world_place(3)


def test_two_processes_split_the_jobs_and_share_one_manifest(tmp_path):
    _write(tmp_path / "jobs.jsonl", [{"id": f"j{i}", "seed": 13 if i == 2 else i} for i in range(5)])
    mp.spawn(run_share, args=(2, free_loopback_port(), str(tmp_path)), nprocs=2, join=True)
    entries = sorted(_manifest(tmp_path / "m.jsonl"), key=lambda e: e["id"])
    assert [(e["id"], e["rank"], e["status"]) for e in entries] == [
        ("j0", 0, DONE), ("j1", 1, DONE), ("j2", 0, FAILED), ("j3", 1, DONE), ("j4", 0, DONE)]
    assert "unlucky seed" in entries[2]["error"]
    assert all((tmp_path / f"{e['id']}.txt").read_text() == str(e["rank"]) for e in entries if e["status"] == DONE)
    with pytest.raises(JobsFileError):
        read_jobs(tmp_path / "missing.jsonl")


def test_four_processes_run_the_jobs_as_two_ulysses_groups(tmp_path, capsys, fixtures_root):
    """torchrun-like world of 4 gloo ranks, --parallel cfg=1,ulysses=2: two groups of two ranks, each
    job run once by one group (its DiT forwards shared over the group's own ulysses subgroup), the
    group leaders (ranks 0 and 2) writing the files and the manifest; each picture equals the
    one-process run's (PNG: lossless) within one 8-bit level."""
    import numpy as np
    import torch
    from PIL import Image

    model = str(fixtures_root / "models" / "tiny-dense")
    # a prompt per job (of different lengths): each job encodes anew, so a broadcast that left its group
    # would hand the other group the wrong prompt (or wait for ranks that have finished)
    prompts = ["a red boat", "a small grey cat asleep on a warm windowsill", "rain"]
    jobs = _write(tmp_path / "jobs.jsonl", [{"id": f"j{i}", "seed": i, "size": "48x32", "steps": 2, "prompt": p}
                                            for i, p in enumerate(prompts)])
    method = "spawn" if torch.cuda.is_initialized() else "fork"  # fork: no second torch import per rank
    mp.start_processes(run_parallel_cli, args=(4, free_loopback_port(), str(tmp_path), model), nprocs=4, join=True,
                       start_method=method)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["code"] for r in ranks] == [0, 0, 0, 0]
    assert ranks[1]["printed"] == [] and ranks[3]["printed"] == []  # only the group leaders print
    entries = sorted(_manifest(tmp_path / "out" / "jobs.manifest.jsonl"), key=lambda e: e["id"])
    assert [(e["id"], e["rank"], e["status"]) for e in entries] == [("j0", 0, DONE), ("j1", 2, DONE), ("j2", 0, DONE)]
    assert sorted(ranks[0]["printed"] + ranks[2]["printed"]) == [e["outputs"][0] for e in entries]

    alone = tmp_path / "alone"
    assert main(["t2i", "--model", model, "-q", "--jobs", str(jobs), "--output", str(alone)]) == 0
    capsys.readouterr()
    for entry in _manifest(alone / "jobs.manifest.jsonl"):
        (mine,) = [e for e in entries if e["id"] == entry["id"]]
        parallel_png = np.asarray(Image.open(mine["outputs"][0]), dtype=np.int16)
        alone_png = np.asarray(Image.open(entry["outputs"][0]), dtype=np.int16)
        assert parallel_png.shape == alone_png.shape == (32, 48, 3)
        assert np.abs(parallel_png - alone_png).max() <= 1, entry["id"]


def test_the_readme_jobs_example_reads(tmp_path):
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = text.split("```jsonl\n", 1)[1].split("```", 1)[0]
    jobs = read_jobs(_write(tmp_path / "jobs.jsonl", block.splitlines()))
    assert [j.id for j in jobs] == ["boat", "boat-b", "line3"] and jobs[2].sets == ("Decode.tiling=true", "Save.fps=16")
