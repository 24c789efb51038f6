"""`lingbot-run --jobs` on two machines, rehearsed on one: two torchrun agents on 127.0.0.1.

Why: issue 24 asks that a jobs file spread over a multi-node torchrun world, one manifest line per
finished job, and that a rerun skip the finished ones. Two agents on one host go through the same
multi-node rendezvous as two machines (each agent is a "node": its own GROUP_RANK, LOCAL_RANK
from 0), so this checks the real launcher end to end on the tiny model. Too slow for the suite
(each worker imports torch and loads a model on a shared 2-core machine); the suite keeps the group
layout and manifest logic as unit tests and forked runs (tests/test_jobs.py).

Scenarios (each: a first run with one job the workflow refuses, a manifest line torn as by a
killed writer, then a rerun with that job fixed):

- ``plain``: 2 nodes x 1 process, static rendezvous (``--master-addr/--master-port --node-rank``),
  no ``--parallel`` (one video per process); an output folder per node, as on machines without a
  shared folder.
- ``cfg2``: 2 nodes x 3 processes, c10d rendezvous (``--rdzv-endpoint``), ``--parallel cfg=2,ulysses=1``:
  groups of 2 on 6 ranks; each node fills one group and its left-over rank pairs with the other
  node's into a group across nodes. One shared output folder (as NFS would be).

What it prints: per check "ok" or "FAIL" and what was found, each run's wall time (informative:
start-up dominates), and at the end the pictures against a one-process run of the same jobs
(tolerance: one 8-bit level on the PNGs; the parallel forwards differ from one process by float
rounding only). Exit code 1 when a check failed.

    python bench/multinode.py                    # both scenarios
    python bench/multinode.py --scenario plain   # one of them
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/x.py` from a plain checkout

PROMPTS = ["a red boat", "a small grey cat asleep on a warm windowsill", "rain", "two kites over a beach",
           "a lamp", "snow falling on a quiet street at night"]


@dataclass(frozen=True)
class Scenario:
    name: str
    nproc: int  # processes per node (2 nodes)
    rendezvous: str  # "static" or "c10d"
    parallel: str  # --parallel degrees, "" for none
    shared_output: bool
    groups: int  # video groups the world makes
    spanning: int  # of which span both nodes


SCENARIOS = {s.name: s for s in (
    Scenario("plain", 1, "static", "", shared_output=False, groups=2, spanning=0),
    Scenario("cfg2", 3, "c10d", "cfg=2,ulysses=1", shared_output=True, groups=3, spanning=1),
)}


class Checks:
    def __init__(self) -> None:
        self.failed = 0

    def __call__(self, ok: bool, what: str, found: object = "") -> None:
        self.failed += not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {what}" + (f": {found}" if found != "" else ""), flush=True)


def _free_port() -> int:
    from lingbot_core.distributed.launch import free_loopback_port

    return free_loopback_port()


def _import_paths(folder: Path) -> list[str]:
    """This checkout importable as lingbot_core and lingbot_nodes (a link to nodes/ under `folder`
    when the pack is not installed); the paths are added to this process's too."""
    paths = [str(ROOT)]
    if importlib.util.find_spec("lingbot_nodes") is None:
        shim = folder / "shim"
        shim.mkdir(exist_ok=True)
        if not (shim / "lingbot_nodes").exists():
            (shim / "lingbot_nodes").symlink_to(ROOT / "nodes", target_is_directory=True)
        paths.append(str(shim))
        sys.path.insert(0, str(shim))
    return paths


def _child_env(folder: Path) -> dict[str, str]:
    """The workers' environment: this checkout importable, loopback only, one thread each."""
    paths = _import_paths(folder)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _start_agents(scenario: Scenario, cli: list[list[str]], folder: Path, tag: str) -> list[subprocess.Popen]:
    """Start one torchrun agent per node (cli[node]: its lingbot-run arguments), each in a session of
    its own (as on its own machine); their output goes to folder/<tag>-node<N>.log."""
    port = _free_port()
    if scenario.rendezvous == "static":
        rdzv = lambda node: ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]  # noqa: E731
    else:
        rdzv = lambda node: ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",  # noqa: E731
                             "--rdzv-id", f"bench-{tag}"]
    env = _child_env(folder)
    procs = []
    for node in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                   str(scenario.nproc), *rdzv(node), "-m", "lingbot_nodes", *cli[node]]
        with (folder / f"{tag}-node{node}.log").open("w") as log:
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=folder,
                                          start_new_session=True))
    return procs


def _wait(procs: list[subprocess.Popen], started: float, timeout: float) -> list[tuple[int, float]]:
    """Each agent's exit code and when it ended (seconds from `started`); SIGTERM to what outlives `timeout`."""
    ended = [None] * len(procs)
    while any(e is None for e in ended):
        for i, proc in enumerate(procs):
            if ended[i] is None and proc.poll() is not None:
                ended[i] = (proc.returncode, time.perf_counter() - started)
        if time.perf_counter() - started > timeout:
            for i, proc in enumerate(procs):
                if ended[i] is None:
                    os.killpg(proc.pid, signal.SIGTERM)  # the agent's own session (its workers have theirs)
                    ended[i] = (proc.wait(), time.perf_counter() - started)
        time.sleep(0.2)
    return ended


def _agents(scenario: Scenario, cli: list[list[str]], folder: Path, tag: str, timeout: float) -> tuple[list[int], float]:
    """Both agents from start to end: their exit codes and the wall time."""
    started = time.perf_counter()
    ended = _wait(_start_agents(scenario, cli, folder, tag), started, timeout)
    return [code for code, _t in ended], max(t for _c, t in ended)


def _manifest_files(folders: list[Path]) -> dict[str, list[dict]]:
    """Every manifest file (name relative to its output folder's parent) and its parsed lines."""
    out = {}
    for folder in folders:
        for path in sorted(folder.glob("jobs.manifest*.jsonl")):
            lines = []
            for raw in path.read_text().splitlines():
                try:
                    lines.append(json.loads(raw))
                except ValueError:
                    lines.append({"torn": raw})
            out[f"{folder.name}/{path.name}"] = lines
    return out


def _write_jobs(path: Path, jobs: list[dict]) -> None:
    path.write_text("".join(json.dumps(j) + "\n" for j in jobs))


def run_scenario(scenario: Scenario, model: str, folder: Path, alone: dict[str, Path], check: Checks,
                 timeout: float) -> None:
    import numpy as np
    from PIL import Image

    from lingbot_core.distributed.layout import video_groups
    from lingbot_nodes.jobs import DONE, FAILED, Manifest

    print(f"\n== {scenario.name}: 2 nodes x {scenario.nproc} processes, {scenario.rendezvous} rendezvous, "
          f"--parallel {scenario.parallel or '(none)'}, {'shared' if scenario.shared_output else 'per-node'} output",
          flush=True)
    world = 2 * scenario.nproc
    good = [{"id": f"j{i}", "seed": i, "size": "48x32", "steps": 2, "prompt": p} for i, p in enumerate(PROMPTS)]
    count = 2 * scenario.groups  # two jobs per group, one of them the refused one
    bad = {"id": "bad", "seed": 9, "size": "48x32", "steps": 2, "prompt": "fog"}
    first_jobs = [*good[:1], {**bad, "set": ["Denoise.width=40"]}, *good[1:count - 1]]
    fixed_jobs = [*good[:1], bad, *good[1:count - 1]]
    _write_jobs(folder / "jobs.jsonl", first_jobs)
    outputs = [folder / ("out" if scenario.shared_output else f"out-node{n}") for n in range(2)]

    def cli(node: int) -> list[str]:
        args = ["t2i", "--model", model, "--jobs", "jobs.jsonl", "--output", str(outputs[node])]  # not -q: the notes
        return args + (["--parallel", scenario.parallel] if scenario.parallel else [])

    codes, took = _agents(scenario, [cli(0), cli(1)], folder, "first", timeout)
    print(f"  first run: agents exited {codes} in {took:.1f} s", flush=True)
    folders = sorted(set(outputs))
    files = _manifest_files(folders)
    entries = [e for lines in files.values() for e in lines]
    found = sorted(int(name.rsplit(".group", 1)[1].split(".")[0]) for name in files if ".group" in name)
    check(found == list(range(scenario.groups)) and len(files) == scenario.groups,
          f"one manifest file per group ({scenario.groups} groups of {world // scenario.groups})", sorted(files))
    check(all(len({e['rank'] for e in lines}) == 1 for lines in files.values()),
          "each file written by one process (its group's leader)",
          {name: sorted({e['rank'] for e in lines}) for name, lines in files.items()})
    # torchrun numbers each node's workers consecutively: the layout then keeps whole groups on a node
    expected = [g[0] for g in video_groups([(f"node{r // scenario.nproc}", r % scenario.nproc) for r in range(world)],
                                           world // scenario.groups)]
    leaders = sorted({e["rank"] for e in entries})
    check(leaders == expected, "the writers are the leaders of the node-aware groups", leaders)
    status = {e["id"]: e["status"] for e in entries}
    check(status == {**{j["id"]: DONE for j in first_jobs if j["id"] != "bad"}, "bad": FAILED},
          "every job recorded once, the refused one failed and the others done", status)
    check(len(entries) == len(first_jobs), "no job ran twice", len(entries))
    logs = "".join((folder / f"first-node{n}.log").read_text() for n in range(2))
    names = [Path(p).name for e in entries for p in e["outputs"]]
    check(len(names) == len(set(names)) and all(f"_{e['id']}_" in Path(p).name for e in entries for p in e["outputs"])
          and all(Path(p).is_file() for e in entries for p in e["outputs"]),
          "output names distinct, each with its job id, each file there", names)
    check(codes == [1, 1], "every node's agent exits 1 (a job failed somewhere; its workers left together)", codes)
    check("exit barrier" not in logs, "no agent waited at torchrun's exit barrier")
    check(logs.count("spans 2 nodes") == scenario.spanning, "groups across nodes said on the terminal",
          logs.count("spans 2 nodes"))

    # a writer killed mid-line: the rerun must skip the torn line and write its own lines after it
    (bad_file,) = [name for name, lines in files.items() if any(e.get("id") == "bad" for e in lines)]
    torn = next(o for o in folders if o.name == bad_file.split("/")[0]) / bad_file.split("/")[1]
    with torn.open("a") as f:
        f.write('{"id": "j0", "status": "do')
    _write_jobs(folder / "jobs.jsonl", fixed_jobs)
    codes, took = _agents(scenario, [cli(0), cli(1)], folder, "resume", timeout)
    print(f"  resume: agents exited {codes} in {took:.1f} s", flush=True)
    after = _manifest_files(folders)
    new = [e for name, lines in after.items() for e in lines[len(files.get(name, [])):]]
    check(codes == [0, 0], "the rerun succeeds on both nodes", codes)
    check([(e["id"], e["status"]) for e in new if "torn" not in e] == [("bad", DONE)],
          "the rerun ran only the fixed job (the done ones skipped)", [e.get("id", "torn") for e in new])
    check(Manifest(torn).done() >= {"bad"} and json.loads(torn.read_text().splitlines()[-1])["id"] == "bad",
          "the line after the torn one is whole and read back", torn.read_text().splitlines()[-2:])
    done = {e["id"]: e for lines in after.values() for e in lines if e.get("status") == DONE}
    worst = 0
    for job_id, path in alone.items():
        if job_id in done:
            a = np.asarray(Image.open(done[job_id]["outputs"][0]), dtype=np.int16)
            b = np.asarray(Image.open(path), dtype=np.int16)
            worst = max(worst, int(np.abs(a - b).max()) if a.shape == b.shape else 999)
    check(worst <= 1, "pictures within one 8-bit level of the one-process run", f"max diff {worst}")


def run_stop(model: str, folder: Path, check: Checks, timeout: float, sig: signal.Signals) -> None:
    """One machine stopped mid-batch: node 1's agent gets `sig` once its first job is recorded
    (SIGINT: Ctrl-C in its terminal; SIGTERM: a scheduler ending the job), and torchrun passes it on
    to its worker; node 0's worker finishes its own share and leaves at once, with a failure,
    instead of waiting at the end for a process that will not come."""
    scenario = Scenario("stop", 1, "static", "", shared_output=False, groups=2, spanning=0)
    print(f"\n== stop: 2 nodes x 1 process, static rendezvous; {sig.name} to node 1's torchrun mid-batch", flush=True)
    jobs = [{"id": f"s{i}", "seed": i, "size": "48x32", "steps": 4, "prompt": PROMPTS[i % len(PROMPTS)]}
            for i in range(8)]
    _write_jobs(folder / "jobs.jsonl", jobs)
    outputs = [folder / f"out-node{n}" for n in range(2)]
    cli = [["t2i", "--model", model, "--jobs", "jobs.jsonl", "--output", str(o)] for o in outputs]
    started = time.perf_counter()
    procs = _start_agents(scenario, cli, folder, f"stop-{sig.name}")
    node1 = outputs[1] / "jobs.manifest.group1.jsonl"
    while not (node1.is_file() and node1.read_text().strip()) and time.perf_counter() - started < timeout:
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    stopped_at = time.perf_counter() - started
    os.killpg(procs[1].pid, sig)  # the agent's session (its worker has its own)
    (code0, end0), (code1, end1) = _wait(procs, started, timeout)
    print(f"  node 1 stopped at {stopped_at:.1f} s; agents exited {code0} at {end0:.1f} s, {code1} at {end1:.1f} s",
          flush=True)
    files = _manifest_files(outputs)
    node0 = files.get("out-node0/jobs.manifest.group0.jsonl", [])
    log0 = (folder / f"stop-{sig.name}-node0.log").read_text()
    check(code1 != 0, "node 1's agent ends with an error (interrupted)", code1)
    check(sorted(e["id"] for e in node0 if e.get("status") == "done") == [f"s{i}" for i in range(0, 8, 2)],
          "node 0 still finishes its whole share", [e.get("id") for e in node0])
    check(code0 == 1 and "another process stopped" in log0, "node 0 then leaves with exit 1, not waiting for node 1",
          code0)
    check("exit barrier" not in log0, "no wait at torchrun's exit barrier")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=[*SCENARIOS, "stop", "all"], default="all")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per torchrun run (both agents)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (its path is printed)")
    args = parser.parse_args(argv)

    from lingbot_core.tiny import ensure_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="lingbot-multinode-"))
    _import_paths(work)
    from lingbot_nodes.cli import main as lingbot_run

    model = str(ensure_tiny_checkpoint("dense"))
    print(f"work folder {work}; tiny dense model {model}", flush=True)
    check = Checks()
    # the baseline: the same jobs in this one process
    base = work / "alone"
    base.mkdir()
    _write_jobs(base / "jobs.jsonl", [{"id": f"j{i}", "seed": i, "size": "48x32", "steps": 2, "prompt": p}
                                      for i, p in enumerate(PROMPTS)] +
                [{"id": "bad", "seed": 9, "size": "48x32", "steps": 2, "prompt": "fog"}])
    started = time.perf_counter()
    code = lingbot_run(["t2i", "--model", model, "-q", "--jobs", str(base / "jobs.jsonl"), "--output", str(base / "out")])
    print(f"one-process baseline: exit {code} in {time.perf_counter() - started:.1f} s", flush=True)
    alone = {}
    for raw in (base / "out" / "jobs.manifest.jsonl").read_text().splitlines():
        entry = json.loads(raw)
        alone[entry["id"]] = Path(entry["outputs"][0])
    for name in [*SCENARIOS, "stop"] if args.scenario == "all" else [args.scenario]:
        if name == "stop":
            for sig in (signal.SIGINT, signal.SIGTERM):
                folder = work / f"stop-{sig.name}"
                folder.mkdir()
                run_stop(model, folder, check, args.timeout, sig)
            continue
        folder = work / name
        folder.mkdir()
        run_scenario(SCENARIOS[name], model, folder, alone, check, args.timeout)
    print(f"\n{'all checks passed' if not check.failed else f'{check.failed} check(s) FAILED'}"
          f"{f'; work folder kept: {work}' if args.keep else ''}")
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 1 if check.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
