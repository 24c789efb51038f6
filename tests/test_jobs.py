"""Many videos (issue 24): `lingbot-run --jobs`, its manifest and resume, and the split over processes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from jobs_worker import claim_share, finish_share, run_parallel_cli, run_share, sigterm_in_jobs

from lingbot_core.distributed.launch import free_loopback_port
from lingbot_core.distributed.layout import video_groups
from lingbot_core.workflow.errors import WorkflowError
from lingbot_nodes.cli import main
from lingbot_nodes.jobs import (
    DONE,
    FAILED,
    JOB_FIELDS,
    Job,
    JobsFileError,
    Manifest,
    WorldPlace,
    check_file_names,
    read_jobs,
    world_place,
)


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
        {"id": "boom", "set": ["Denoise.sampler=dmd_student", "Denoise.sigmas=1.0, 0.5"]},  # refused by Denoise itself
        {"seed": 2, "size": [32, 48], "steps": 2},
    ])
    out = tmp_path / "out"
    args = ["t2i", "--model", str(fixtures_root / "models" / "tiny-dense"), "--output", str(out), "--jobs", str(jobs)]
    assert main(args) == 1  # a job failed; the others ran
    captured = capsys.readouterr()
    written = captured.out.split()
    last = read_jobs(jobs)[-1].id  # no id given: j + the digest of its content
    assert last.startswith("j") and len(last) == 13
    assert [Path(p).name for p in written] == ["t2i_a_00001_.png", f"t2i_{last}_00001_.png"]
    from PIL import Image

    assert [Image.open(p).size for p in written] == [(48, 32), (32, 48)]
    assert captured.err.count("Loader: done") == 1  # loaded once: the runtime failure left the handle usable
    manifest = out / "jobs.manifest.jsonl"
    entries = _manifest(manifest)
    assert [(e["id"], e["line"], e["status"]) for e in entries] == [
        ("a", 1, DONE), ("bad", 2, FAILED), ("boom", 5, FAILED), (last, 6, DONE)]
    assert entries[0]["outputs"] == [written[0]] and entries[0]["seconds"] > 0
    assert "multiple of 16" in entries[1]["error"]
    assert "LingBotDenoise" in entries[2]["error"] and "fixed sigma grid" in entries[2]["error"]
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
    from lingbot_nodes.jobs import job_overrides

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


def test_a_linked_filename_prefix_is_refused_when_several_groups_write():
    nodes = {"1": {"class_type": "LingBotSaveVideo", "inputs": {"filename_prefix": ["9", 0]}},
             "2": {"class_type": "LingBotSaveVideo", "inputs": {"filename_prefix": "clips/x"}}}
    check_file_names(nodes, WorldPlace(0, 1, 1))  # one process numbers its jobs' files one after the other
    check_file_names({"2": nodes["2"]}, WorldPlace(0, 4, 1))  # text prefixes get the job id
    with pytest.raises(WorkflowError, match=r"node\(s\) 1 take their filename_prefix through a link"):
        check_file_names(nodes, WorldPlace(0, 4, 2))


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


def _nodes(*counts: int) -> list[tuple[str, int]]:
    """(node, local rank) per global rank as torchrun assigns them: each node's ranks consecutive."""
    return [(f"agent{n}", local) for n, count in enumerate(counts) for local in range(count)]


@pytest.mark.parametrize("counts,size", [((4, 4), 2), ((4, 4), 4), ((3, 3), 2), ((5, 5, 5, 5), 4), ((2, 2), 4),
                                         ((4, 2), 2), ((6, 2), 4), ((1, 1, 1, 1), 2), ((8,), 8)])
def test_video_groups_stay_inside_a_node_where_they_fit(counts, size):
    groups = video_groups(_nodes(*counts), size)
    node_of = [n for n, _local in _nodes(*counts)]
    assert sorted(r for g in groups for r in g) == list(range(sum(counts)))  # each rank once
    assert all(len(g) == size and g == sorted(g) for g in groups) and groups == sorted(groups)
    spanning = [g for g in groups if len({node_of[r] for r in g}) > 1]
    # only the ranks a node cannot fill a whole group with end up in groups across nodes
    assert len(spanning) * size == sum(c % size for c in counts)
    if all(c % size == 0 for c in counts):  # torchrun's consecutive ranks: the groups of consecutive ranks
        assert groups == [list(range(i, i + size)) for i in range(0, sum(counts), size)]


def test_video_groups_follow_the_nodes_not_the_rank_numbers():
    interleaved = [(f"agent{r % 2}", r // 2) for r in range(8)]  # a launcher that deals ranks round-robin
    assert video_groups(interleaved, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert video_groups(interleaved, 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # five ranks on one node, three on another, groups of four: node 0's first four make a group, its
    # fifth and node 1's three are pooled into the one group across nodes
    assert video_groups(_nodes(5, 3), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert video_groups([("b", 1), ("b", 0), ("a", 0), ("a", 1)], 2) == [[0, 1], [2, 3]]  # local order within a node
    with pytest.raises(ValueError, match="do not divide"):
        video_groups(_nodes(3), 2)


def test_manifest_files_per_writer_torn_lines_and_the_old_single_file(tmp_path):
    base = tmp_path / "jobs.manifest.jsonl"
    base.write_text(json.dumps({"id": "old", "status": DONE}) + "\n")  # written before the per-writer files
    g0, g12 = Manifest(base, "group0"), Manifest(base, "group12")
    assert (g0.write_path.name, g12.write_path.name) == ("jobs.manifest.group0.jsonl", "jobs.manifest.group12.jsonl")
    g12.record({"id": "a", "status": DONE})
    g12.write_path.open("a").write('{"id": "b", "status": "do')  # a writer killed mid-line
    g0.record({"id": "c", "status": FAILED})
    g12.record({"id": "d", "status": DONE})  # the next line starts on a line of its own
    (tmp_path / "jobs.manifest.groupx.jsonl").write_text(json.dumps({"id": "x", "status": DONE}) + "\n")
    (tmp_path / "jobs.manifest.jsonl.bak").write_text(json.dumps({"id": "y", "status": DONE}) + "\n")
    (tmp_path / "other.manifest.group1.jsonl").write_text(json.dumps({"id": "z", "status": DONE}) + "\n")
    reader = Manifest(base)
    assert [p.name for p in reader.files()] == ["jobs.manifest.jsonl", "jobs.manifest.group0.jsonl",
                                                "jobs.manifest.group12.jsonl"]
    assert [e["id"] for e in reader.entries()] == ["old", "c", "a", "d"]
    assert reader.done() == {"old", "a", "d"}
    assert g12.write_path.read_text().splitlines()[1:] == ['{"id": "b", "status": "do', '{"id": "d", "status": "done"}']
    assert Manifest(tmp_path / "none.jsonl").done() == set()
    with pytest.raises(ValueError, match="group<N>"):
        Manifest(base, "../x")


def test_world_place_takes_the_groups_of_a_layout(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    place = world_place(layout=SimpleNamespace(world_size=2, video=1, rank=0))  # rank 3 leads group 1 (ranks 1, 3)
    assert (place.group, place.groups, place.leader, place.writer) == (1, 2, True, "group1")
    assert [j.id for j in place.share([Job(f"j{i}", i + 1) for i in range(5)])] == ["j1", "j3"]
    assert WorldPlace().writer is None and WorldPlace(2, 3, 1).writer == "group2"


def test_a_job_that_broke_the_group_is_recorded_and_stops_the_batch(tmp_path):
    """A job whose run broke the group's collectives (one rank failed inside a DiT forward: every rank
    raises GroupBroken) gets its manifest line, and the batch stops there instead of running the next
    job on a group that is out of step; a rerun resumes after the jobs done."""
    from lingbot_core.distributed.abort import Failure, GroupBroken
    from lingbot_core.workflow.errors import NodeExecutionError
    from lingbot_nodes.jobs import Manifest, run_jobs

    jobs = [Job(f"j{i}", i + 1) for i in range(4)]
    ran, healed = [], []
    broken = GroupBroken(Failure(1, "cuda:1", "OutOfMemoryError: CUDA out of memory", "in the DiT forward of step 3"), 0)

    def run_one(job):
        ran.append(job.id)
        if job.id == "j1" and not healed:
            raise NodeExecutionError("4", "LingBotDenoise", str(broken)) from broken  # as the engine wraps it
        if job.id == "j2":
            raise ValueError("a refused input fails that job alone")
        return []

    manifest = Manifest(tmp_path / "m.jsonl")
    with pytest.raises(NodeExecutionError):
        run_jobs(jobs, run_one, manifest)
    assert ran == ["j0", "j1"]
    entries = _manifest(tmp_path / "m.jsonl")
    assert [(e["id"], e["status"]) for e in entries] == [("j0", DONE), ("j1", FAILED)]
    assert "rank 1 (cuda:1) failed in the DiT forward of step 3 (OutOfMemoryError" in entries[1]["error"]
    ran.clear()
    healed.append(True)
    run_jobs(jobs, run_one, manifest)  # the rerun resumes at j1; a refused input (j2) fails that job alone
    assert ran == ["j1", "j2", "j3"]
    assert [e["status"] for e in _manifest(tmp_path / "m.jsonl")[2:]] == [DONE, FAILED, DONE]


def test_two_processes_split_the_jobs_each_writing_its_own_manifest(tmp_path):
    _write(tmp_path / "jobs.jsonl", [{"id": f"j{i}", "seed": 13 if i == 2 else i} for i in range(5)])
    mp.start_processes(run_share, args=(2, free_loopback_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method=_START)
    # one file per writer (NFS does not make two writers' appends to one file safe), read back as one
    assert sorted(p.name for p in tmp_path.glob("m*.jsonl")) == ["m.group0.jsonl", "m.group1.jsonl"]
    entries = sorted(Manifest(tmp_path / "m.jsonl").entries(), key=lambda e: e["id"])
    assert [(e["id"], e["rank"], e["status"]) for e in entries] == [
        ("j0", 0, DONE), ("j1", 1, DONE), ("j2", 0, FAILED), ("j3", 1, DONE), ("j4", 0, DONE)]
    assert all(e in _manifest(tmp_path / f"m.group{e['rank']}.jsonl") for e in entries)
    assert "unlucky seed" in entries[2]["error"]
    assert all((tmp_path / f"{e['id']}.txt").read_text() == str(e["rank"]) for e in entries if e["status"] == DONE)
    with pytest.raises(JobsFileError):
        read_jobs(tmp_path / "missing.jsonl")


_START = "spawn" if torch.cuda.is_initialized() else "fork"  # fork: no second torch import per rank
# a prompt per job (of different lengths): each job encodes anew, so a broadcast that left its group
# would hand the other group the wrong prompt (or wait for ranks that have finished)
_PROMPTS = ["a red boat", "a small grey cat asleep on a warm windowsill", "rain"]


def _picture_jobs() -> list[dict]:
    return [{"id": f"j{i}", "seed": i, "size": "48x32", "steps": 2, "prompt": p} for i, p in enumerate(_PROMPTS)]


@pytest.fixture(scope="module")
def alone(tmp_path_factory, fixtures_root) -> dict[str, Path]:
    """The picture jobs run by one process (no --parallel): job id -> its PNG."""
    folder = tmp_path_factory.mktemp("alone")
    jobs = _write(folder / "jobs.jsonl", _picture_jobs())
    model = str(fixtures_root / "models" / "tiny-dense")
    assert main(["t2i", "--model", model, "-q", "--jobs", str(jobs), "--output", str(folder / "out")]) == 0
    return {e["id"]: Path(e["outputs"][0]) for e in _manifest(folder / "out" / "jobs.manifest.jsonl")}


def _same_pictures(entries: list[dict], alone: dict[str, Path]) -> None:
    """Each job's PNG (lossless) equals the one-process run's within one 8-bit level: the parallel
    forwards differ from one process's by float rounding only (tests/test_parallel.py: 2e-6 on frames)."""
    import numpy as np
    from PIL import Image

    assert sorted(e["id"] for e in entries) == sorted(alone)
    for entry in entries:
        parallel_png = np.asarray(Image.open(entry["outputs"][0]), dtype=np.int16)
        alone_png = np.asarray(Image.open(alone[entry["id"]]), dtype=np.int16)
        assert parallel_png.shape == alone_png.shape == (32, 48, 3)
        assert np.abs(parallel_png - alone_png).max() <= 1, entry["id"]


def _run_world(tmp_path: Path, runs: list[list[str]], nodes: int = 1, world: int = 4) -> list[list[dict]]:
    """`world` gloo ranks (forked) running `lingbot-run` once per entry of `runs`; per rank, per run:
    its exit code, what it printed, when it started and returned."""
    ports = [free_loopback_port() for _ in runs]
    mp.start_processes(run_parallel_cli, args=(world, ports, str(tmp_path), runs, nodes), nprocs=world, join=True,
                       start_method=_START)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def test_processes_under_torchrun_leave_together_with_the_worlds_exit_code(tmp_path, fixtures_root):
    """Plain --jobs (no --parallel) on two processes: rank 0's share is one job the workflow refuses
    (done at once), rank 1's a real one. torchrun stops a node's other workers when one exits non-zero,
    so rank 0 must not leave before rank 1 has finished; both leave with exit code 1 (a job failed)."""
    jobs = _write(tmp_path / "jobs.jsonl", [{"id": "bad", "set": ["Denoise.width=40"]},
                                            {"id": "slow", "seed": 1, "size": "48x32", "steps": 2}])
    args = ["t2i", "--model", str(fixtures_root / "models" / "tiny-dense"), "-q", "--jobs", str(jobs),
            "--output", str(tmp_path / "out")]
    (rank0,), (rank1,) = _run_world(tmp_path, [args], world=2)
    assert (rank0["code"], rank1["code"]) == (1, 1)
    entries = {e["id"]: e for e in Manifest(tmp_path / "out" / "jobs.manifest.jsonl").entries()}
    assert (entries["bad"]["status"], entries["slow"]["status"]) == (FAILED, DONE)
    assert rank0["returned"] >= rank1["started"] + entries["slow"]["seconds"], (rank0, rank1)


def test_four_processes_run_the_jobs_as_two_ulysses_groups(tmp_path, fixtures_root, alone):
    """torchrun-like world of 4 gloo ranks, --parallel cfg=1,ulysses=2: two groups of two ranks, each
    job run once by one group (its DiT forwards shared over the group's own ulysses subgroup), the
    group leaders (ranks 0 and 2) writing the files and their own manifest files."""
    jobs = _write(tmp_path / "jobs.jsonl", _picture_jobs())
    args = ["t2i", "--model", str(fixtures_root / "models" / "tiny-dense"), "--parallel", "cfg=1,ulysses=2", "-q",
            "--jobs", str(jobs), "--output", str(tmp_path / "out")]
    ranks = [r[0] for r in _run_world(tmp_path, [args])]
    assert [r["code"] for r in ranks] == [0, 0, 0, 0]
    assert ranks[1]["printed"] == [] and ranks[3]["printed"] == []  # only the group leaders print
    entries = sorted(Manifest(tmp_path / "out" / "jobs.manifest.jsonl").entries(), key=lambda e: e["id"])
    assert [(e["id"], e["rank"], e["status"]) for e in entries] == [("j0", 0, DONE), ("j1", 2, DONE), ("j2", 0, DONE)]
    assert [e["id"] for e in _manifest(tmp_path / "out" / "jobs.manifest.group1.jsonl")] == ["j1"]
    assert sorted(ranks[0]["printed"] + ranks[2]["printed"]) == [e["outputs"][0] for e in entries]
    _same_pictures(entries, alone)


def test_sigterm_interrupts_a_jobs_run_under_torchrun():
    """torchrun stops its workers with SIGTERM (its own SIGTERM, a failed sibling): in a --jobs run it must
    raise like Ctrl-C, so the process can tell the others' end-of-batch wait (finish_together) that it stopped."""
    import multiprocessing
    import signal

    codes = []
    for under_torchrun in (True, False):
        child = multiprocessing.get_context("fork").Process(target=sigterm_in_jobs, args=(under_torchrun,))
        child.start()
        child.join(30)
        codes.append(child.exitcode)
    assert codes == [7, -signal.SIGTERM]  # an interrupt under torchrun; Python's default (killed) otherwise


def test_a_process_that_stops_early_does_not_leave_the_others_waiting(tmp_path):
    context = mp.start_processes(finish_share, args=(3, free_loopback_port(), str(tmp_path)), nprocs=3, join=False,
                                 start_method=_START)
    deadline = time.monotonic() + 60
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):  # False until all have ended
        if time.monotonic() > deadline:  # they would wait for ever for the one that stopped
            for process in context.processes:
                process.kill()
            pytest.fail("the processes that finished still wait for the one that stopped")
    # nobody waits for the one that stopped (this returns at all) and every process leaves with a failure:
    # the stopped one with 1, the others with the failures counted when they saw it stop (1 or both)
    found = [int((tmp_path / f"finish{r}.txt").read_text()) for r in range(3)]
    assert found[2] == 1 and found[0] in (1, 2) and found[1] in (1, 2), found


def test_cfg2_fsdp_groups_on_two_nodes_fail_alone_and_resume(tmp_path, fixtures_root, alone):
    """--parallel cfg=2,ulysses=1 --fsdp --jobs on 4 gloo ranks spread over two pretend nodes round-robin
    (node 0: ranks 0 and 2, node 1: ranks 1 and 3, as GROUP_RANK / LOCAL_RANK say): the two video
    groups are {0, 2} and {1, 3}, each inside its node (not the consecutive {0, 1}, {2, 3}), their
    leaders 0 and 1 writing the files and the manifest files. A job the workflow refuses is recorded
    as failed and the others run; the second run (the bad job fixed, same id) skips the done ones
    and runs only it. Pictures equal the one-process run's within one 8-bit level."""
    good = _picture_jobs()
    bad = {"id": "bad", "seed": 5, "size": "48x32", "steps": 2, "prompt": "fog", "set": ["Denoise.width=40"]}
    first = _write(tmp_path / "first.jsonl", [good[0], bad, good[1], good[2]])
    fixed = _write(tmp_path / "fixed.jsonl", [good[0], {k: v for k, v in bad.items() if k != "set"}, *good[1:]])
    common = ["t2i", "--model", str(fixtures_root / "models" / "tiny-dense"), "--parallel", "cfg=2,ulysses=1",
              "--fsdp", "-q", "--output", str(tmp_path / "out"), "--manifest", str(tmp_path / "out" / "m.jsonl")]
    ranks = _run_world(tmp_path, [[*common, "--jobs", str(first)], [*common, "--jobs", str(fixed)]], nodes=2)
    # every process exits with the world's verdict: a job failed in the first run (in group 1's share)
    assert [[run["code"] for run in r] for r in ranks] == [[1, 0]] * 4
    assert all(run["printed"] == [] for r in (ranks[2], ranks[3]) for run in r)  # not group leaders
    manifest = Manifest(tmp_path / "out" / "m.jsonl")
    entries = list(manifest.entries())
    # jobs by place in the file: group 0 (ranks 0, 2) takes lines 1 and 3, group 1 (ranks 1, 3) lines 2 and 4
    assert [(e["id"], e["rank"], e["status"]) for e in _manifest(tmp_path / "out" / "m.group0.jsonl")] == [
        ("j0", 0, DONE), ("j1", 0, DONE)]
    assert [(e["id"], e["rank"], e["status"]) for e in _manifest(tmp_path / "out" / "m.group1.jsonl")] == [
        ("bad", 1, FAILED), ("j2", 1, DONE), ("bad", 1, DONE)]
    assert "multiple of 16" in entries[2]["error"]
    assert ranks[0][1]["printed"] == [] and len(ranks[1][1]["printed"]) == 1  # the resume ran only "bad"
    done = {e["id"]: e for e in entries if e["status"] == DONE}
    assert Path(done["bad"]["outputs"][0]).name == "t2i_bad_00001_.png"
    _same_pictures([e for e in done.values() if e["id"] != "bad"], alone)


def test_the_readme_jobs_example_reads(tmp_path):
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = text.split("```jsonl\n", 1)[1].split("```", 1)[0]
    jobs = read_jobs(_write(tmp_path / "jobs.jsonl", block.splitlines()))
    assert [j.id for j in jobs[:2]] == ["boat", "boat-b"] and jobs[2].sets == ("Decode.tiling=true", "Save.fps=16")
    assert jobs[2].id == f"j{jobs[2].digest[:12]}"


# --- issue 34 item 3: a job is its content, not its line; two runs at once split the work ---

def _ran(jobs_path: Path, manifest: Manifest, **kw) -> list[tuple[str, int]]:
    from lingbot_nodes.jobs import run_jobs

    ran = []
    run_jobs(read_jobs(jobs_path), lambda job: ran.append((job.values.get("seed"), job.line)) or [], manifest, **kw)
    return ran


def test_an_edited_jobs_file_runs_what_never_ran_and_nothing_twice(tmp_path):
    manifest = Manifest(tmp_path / "m.jsonl")
    jobs = _write(tmp_path / "jobs.jsonl", [{"seed": 1}, {"seed": 2}, {"id": "named", "seed": 3}])
    assert _ran(jobs, manifest) == [(1, 1), (2, 2), (3, 3)]
    # a line inserted at the top, a copy of an existing job (its own id: the second copy), a named job edited
    _write(jobs, [{"seed": 9}, {"seed": 2}, {"seed": 1}, {"seed": 2}, {"id": "named", "seed": 4}])
    ids = [j.id for j in read_jobs(jobs)]
    assert ids[3] == ids[1] + ".2" and ids[2] == read_jobs(tmp_path / "jobs.jsonl")[2].id
    # line numbers moved: still nothing done runs again, and what never ran (seed 9, the copy, the edit) runs
    assert _ran(jobs, manifest) == [(9, 1), (2, 4), (4, 5)]
    assert _ran(jobs, manifest) == []
    # the same content written differently is the same job
    _write(jobs, ['{ "seed" : 9 }', {"seed": 2}, {"seed": 1}, {"seed": 2}, {"seed": 4, "id": "named"}])
    assert _ran(jobs, manifest) == []
    same = read_jobs(_write(tmp_path / "a.jsonl", [{"size": "64x32", "cfg": 4}, {"cfg": 4.0, "size": [64, 32]}]))
    assert same[0].digest == same[1].digest and same[1].id == same[0].id + ".2"


def test_manifest_lines_from_before_digests_still_resume(tmp_path):
    base = tmp_path / "m.jsonl"
    base.write_text("\n".join(json.dumps(e) for e in [
        {"id": "boat", "line": 1, "status": DONE}, {"id": "line2", "line": 2, "status": DONE},
        {"id": "line3", "line": 3, "status": FAILED}]) + "\n")
    jobs = _write(tmp_path / "jobs.jsonl", [{"id": "boat", "seed": 1}, {"seed": 2}, {"seed": 3}])
    assert _ran(jobs, Manifest(base)) == [(3, 3)]
    assert [e.get("digest") for e in _manifest(base)][-1] == read_jobs(jobs)[2].digest


def test_two_runs_on_one_jobs_file_share_the_jobs(tmp_path):
    """Run A holds j0 (blocked inside it) while run B goes through the file: B leaves j0 to A and runs
    the rest, then waits for j0 (A is let go then); A finds the others done in the manifest. Every job
    ran once, and B returned only once j0 was recorded."""
    import threading

    from lingbot_nodes.jobs import run_jobs

    jobs = read_jobs(_write(tmp_path / "jobs.jsonl", [{"id": f"j{i}", "seed": i} for i in range(3)]))
    inside, go, ran, skipped = threading.Event(), threading.Event(), [], []

    def slow(job):
        ran.append(("A", job.id))
        if job.id == "j0":
            inside.set()
            assert go.wait(10)
        return []

    first = threading.Thread(target=run_jobs, args=(jobs, slow, Manifest(tmp_path / "m.jsonl")))
    first.start()
    assert inside.wait(10)

    def heard(job, why):
        skipped.append((job.id, why))
        if why == "waiting":
            go.set()

    run_jobs(jobs, lambda job: ran.append(("B", job.id)) or [], Manifest(tmp_path / "m.jsonl"), on_skip=heard,
             poll_s=0.02)
    assert ("j0", DONE) in {(e["id"], e["status"]) for e in Manifest(tmp_path / "m.jsonl").entries()}
    first.join(10)
    assert sorted(ran, key=lambda r: r[1]) == [("A", "j0"), ("B", "j1"), ("B", "j2")]
    assert skipped == [("j0", "waiting"), ("j0", "elsewhere")]
    assert sorted(e["id"] for e in Manifest(tmp_path / "m.jsonl").entries()) == ["j0", "j1", "j2"]
    # the claims are let go at the end: a third run takes a failed or new job at once
    assert Manifest(tmp_path / "m.jsonl").claims_folder.is_dir()
    assert _ran(_write(tmp_path / "jobs.jsonl", [{"id": "j3", "seed": 3}]), Manifest(tmp_path / "m.jsonl")) == [(3, 1)]


def test_a_group_runs_what_its_leader_decided(tmp_path):
    """The ranks of one video group follow the leader's decision (group_agreement), not their own
    reading of the manifest: a member whose manifest says done still runs the job the leader runs."""
    from lingbot_nodes.jobs import RUN, SKIP, run_jobs

    jobs = read_jobs(_write(tmp_path / "jobs.jsonl", [{"id": "a", "seed": 1}, {"id": "b", "seed": 2}]))
    (tmp_path / "m.jsonl").write_text(json.dumps({"id": "a", "digest": jobs[0].digest, "status": DONE}) + "\n")
    said, ran = iter([RUN, SKIP]), []
    run_jobs(jobs, lambda job: ran.append(job.id) or [], Manifest(tmp_path / "m.jsonl"),
             place=WorldPlace(rank=1, world_size=2, group_size=2), agree=lambda _mine: next(said))
    assert ran == ["a"] and len(_manifest(tmp_path / "m.jsonl")) == 1  # a member runs, never records
    heard = []
    run_jobs(jobs, lambda job: [], Manifest(tmp_path / "m.jsonl"), place=WorldPlace(0, 2, 2),
             agree=lambda mine: heard.append(mine) or mine)
    assert heard == [SKIP, RUN]  # the leader: a is done, b is not


def test_a_huge_value_is_not_echoed_whole_and_a_byte_order_mark_is_fine(tmp_path):
    for line in ({"seed": "7" * 100_000}, {"x" * 100_000: 1}, {"id": "y" * 100_000}, {"size": "z" * 100_000}):
        with pytest.raises(JobsFileError) as caught:
            read_jobs(_write(tmp_path / "jobs.jsonl", [line]))
        assert len(str(caught.value)) < 400 + len(str(tmp_path)) and "jobs.jsonl:1: " in str(caught.value)
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"seed": 1}).encode() + b"\r\n")
    assert [j.values for j in read_jobs(path)] == [{"seed": 1}]


def test_two_processes_on_one_jobs_file_run_each_job_once(tmp_path):
    """The claims are file locks between processes: two processes started together on one jobs file and
    manifest run every job exactly once between them, and the manifest has every job done."""
    import multiprocessing

    _write(tmp_path / "jobs.jsonl", [{"id": f"j{i}", "seed": i} for i in range(12)])
    context = multiprocessing.get_context("fork")
    children = [context.Process(target=claim_share, args=(str(tmp_path), name)) for name in ("a", "b")]
    for child in children:
        child.start()
    for child in children:
        child.join(30)
    assert [c.exitcode for c in children] == [0, 0]
    ran = [line for name in ("a", "b") if (tmp_path / f"ran-{name}.txt").exists()
           for line in (tmp_path / f"ran-{name}.txt").read_text().split()]
    assert sorted(ran) == sorted(f"j{i}" for i in range(12))  # none twice, none left out
    assert sorted(e["id"] for e in Manifest(tmp_path / "m.jsonl").entries() if e["status"] == DONE) == sorted(ran)


def test_a_job_dropped_by_a_run_that_died_is_run_by_the_one_waiting(tmp_path):
    """Another process holds j0 and goes away without a manifest line (killed: its lock goes with it):
    the run that waited for j0 runs it itself. One it recorded as failed meanwhile is not run again."""
    from lingbot_nodes.jobs import Claims, run_jobs

    jobs = read_jobs(_write(tmp_path / "jobs.jsonl", [{"id": f"j{i}", "seed": i} for i in range(3)]))
    manifest = Manifest(tmp_path / "m.jsonl")
    other = Claims(manifest.claims_folder)
    assert other.take(jobs[0]) == (True, False) and other.take(jobs[2]) == (True, False)
    ran = []

    def heard(job, why):
        if why == "waiting" and job.id == "j0":
            other.release(jobs[0])  # dies with j0 undone
        if why == "waiting" and job.id == "j2":
            manifest.record({"id": "j2", "digest": jobs[2].digest, "status": FAILED})
            other.release(jobs[2])

    run_jobs(jobs, lambda job: ran.append(job.id) or [], manifest, on_skip=heard, poll_s=0.02)
    assert ran == ["j1", "j0"]
