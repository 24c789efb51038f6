"""Fuzz `--jobs` files: mutated and edited jobs files, read, run, edited and run again, two runs at once.

    python -m bench.fuzz_jobs [--cases 1500] [--seed 0] [--json OUT]

Each case writes a jobs file from valid lines (every short key of `JOB_FIELDS`, ``set``, ``id``, no
id, copies of one line) and applies 0-3 mutations: a value replaced by something of the wrong kind
(huge numbers, NaN, deep nesting, lone surrogates, 100,000-character strings), a key renamed, a line
cut, invalid UTF-8, NUL bytes, a byte-order mark, CRLF line ends, a duplicate id. Then:

1. `read_jobs`: our `JobsFileError` naming ``file:line`` (``refused``) or a list of jobs;
2. when read, `job_overrides` on a workflow with every node class a key fills, and a run
   (`run_jobs`, a runner that fails about one job in five) into a fresh manifest;
3. the file edited as people do (lines inserted, removed, moved, one job changed), read and run
   again on the same manifest, then a third time by two runs at once (threads) on it (each waits
   for the jobs the other holds, trying their claims every 0.01 s).

A case is ``silent`` when an invariant breaks: ids not unique or not file-name safe; the rerun after
the edit runs a job whose content was already done, or skips one that never ran (or failed); a job
run twice by the two concurrent runs, or a job of the file left without a done or failed line after
them. ``crash``: any exception other than our refusal; ``hang``: a case over 20 s. Prints a JSON
summary with the first bad cases.
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any

from bench._common import fuzz_parser, fuzz_report, fuzz_tally

NODES = {"1": {"class_type": "LingBotTextEncode", "inputs": {"prompt": "p"}},
         "2": {"class_type": "LingBotDenoise", "inputs": {"seed": 1}},
         "3": {"class_type": "LingBotRefine", "inputs": {}},
         "4": {"class_type": "LingBotSaveVideo", "inputs": {"filename_prefix": "lingbot/t2v"}}}
WEIRD = [None, True, -1, 0, 2**64, 2**200, 1e308, float("nan"), "", "x" * 100_000, "\ud800",
         "832x480x3", "axb", [1], [1, 2, 3], {"a": 1}, [[[[[]]]]], "../../etc", "a/b", "é🙂", "\u0000"]


def _valid_line(rng: random.Random, index: int) -> dict[str, Any]:
    line: dict[str, Any] = {}
    if rng.random() < 0.4:
        line["id"] = rng.choice([f"job{index}", f"j.{index}", f"A-{index}_x", "boat"])
    for key in rng.sample(["prompt", "negative", "seed", "size", "frames", "steps", "cfg"], rng.randrange(1, 5)):
        line[key] = {"prompt": rng.choice(["a boat", "a cat " * rng.randrange(1, 5), "é🙂"]), "negative": "blur",
                     "seed": rng.randrange(20), "size": rng.choice(["64x32", [64, 32], "48X32"]),
                     "frames": rng.choice([1, 5, 9]), "steps": rng.randrange(1, 4),
                     "cfg": rng.choice([1, 4, 4.5])}[key]
    if rng.random() < 0.3:
        line["set"] = rng.choice(["Decode.tiling=true", ["Save.fps=16"], ["Denoise.cfg=3", "Save.fps=8"]])
    return line


def _mutate(rng: random.Random, lines: list[str]) -> list[str]:
    if not lines:
        return lines
    i = rng.randrange(len(lines))
    kind = rng.randrange(9)
    if kind == 0:  # a value of the wrong kind
        try:
            obj = json.loads(lines[i])
            if not isinstance(obj, dict):
                return lines
            key = rng.choice(list(obj) or ["seed"])
            obj[key] = rng.choice(WEIRD)
            lines[i] = json.dumps(obj, allow_nan=True)
        except (ValueError, RecursionError):  # a line an earlier mutation made unreadable
            pass
    elif kind == 1:
        lines[i] = lines[i].replace('"seed"', '"seeed"', 1)
    elif kind == 2:
        lines[i] = lines[i][: rng.randrange(len(lines[i]) + 1)]
    elif kind == 3:
        lines[i] = "[" * rng.choice([10, 5000]) + "]" * 10
    elif kind == 4:
        lines[i] = lines[i] + "\x00"
    elif kind == 5:
        lines.insert(i, rng.choice(["# a comment", "", "   ", "{}", "null", "\"text\"", "{\"id\": \"boat\"}"]))
    elif kind == 6:
        lines.insert(i, lines[i])  # a copy of a line (the same id if it has one)
    elif kind == 7:
        lines[i] = json.dumps({"id": "x" * rng.choice([64, 65, 1000])})
    else:
        lines[i] = '{"prompt": "' + "a" * rng.choice([10, 2_000_000]) + '"}'
    return lines


def _write(path: Path, lines: list[str], rng: random.Random) -> None:
    text = "\n".join(lines) + "\n"
    if rng.random() < 0.1:
        text = text.replace("\n", "\r\n")
    data = text.encode("utf-8", "surrogatepass")
    if rng.random() < 0.05:
        data = b"\xef\xbb\xbf" + data
    if rng.random() < 0.05:
        data = data[:-2] + b"\xff\xfe\n"
    path.write_bytes(data)


def _edit(rng: random.Random, lines: list[str]) -> list[str]:
    lines = list(lines)
    for _ in range(rng.randrange(1, 4)):
        kind = rng.randrange(4)
        if kind == 0:
            line = _valid_line(rng, 0)
            line.pop("id", None)  # a new line: no id (one of the file's would be refused as used twice)
            lines.insert(rng.randrange(len(lines) + 1), json.dumps(line))
        elif kind == 1 and len(lines) > 1:
            lines.pop(rng.randrange(len(lines)))
        elif kind == 2 and len(lines) > 1:
            lines.insert(rng.randrange(len(lines)), lines.pop(rng.randrange(len(lines))))
        elif lines:
            i = rng.randrange(len(lines))
            try:
                obj = json.loads(lines[i])
                if isinstance(obj, dict):
                    obj["seed"] = 1000 + rng.randrange(100)
                lines[i] = json.dumps(obj)
            except (ValueError, TypeError):
                pass
    return lines


def one(rng: random.Random, folder: Path) -> tuple[str, str]:
    from lingbot_nodes.jobs import (
        DONE,
        ID_PATTERN,
        JobsFileError,
        Manifest,
        job_overrides,
        read_jobs,
        run_jobs,
    )

    lines = [json.dumps(_valid_line(rng, i)) for i in range(rng.randrange(1, 8))]
    if rng.random() < 0.2 and lines:
        lines.append(lines[0])
    for _ in range(rng.randrange(4)):
        lines = _mutate(rng, lines)
    path = folder / "jobs.jsonl"
    _write(path, lines, rng)
    try:
        jobs = read_jobs(path)
    except JobsFileError as err:
        text = str(err)
        if len(text) > 4000 or "jobs.jsonl" not in text:
            return "silent", f"refusal without the file or too long: {text[:200]!r}"
        return "refused", ""
    ids = [j.id for j in jobs]
    if len(set(ids)) != len(ids) or not all(ID_PATTERN.fullmatch(i) for i in ids):
        return "silent", f"ids {ids[:5]}"
    for job in jobs:
        try:
            job_overrides(NODES, job)
        except ValueError:
            pass
    fails = {j.digest for j in jobs if rng.random() < 0.2}
    ran: list[tuple[str, str]] = []
    lock = threading.Lock()

    def runner(job):
        with lock:
            ran.append(job.key)
        if job.digest in fails:
            raise RuntimeError("this job fails")
        return []

    manifest = Manifest(folder / "m.jsonl")
    run_jobs(jobs, runner, manifest)
    done = {j.key for j in jobs if j.digest not in fails}
    # the edit, then a rerun: exactly the jobs whose (id, content) is not done yet run
    _write(path, _edit(rng, [json.dumps({k: v for k, v in _as_line(j).items()}) for j in jobs]), random.Random(0))
    try:
        edited = read_jobs(path)
    except JobsFileError as err:
        return "silent", f"an edit of a readable file was refused: {str(err)[:200]}"
    ran.clear()
    fails = {j.digest for j in edited if rng.random() < 0.2}
    run_jobs(edited, runner, manifest)
    expected = [j.key for j in edited if j.key not in done]
    if ran != expected:
        return "silent", f"rerun ran {ran[:4]}, expected {expected[:4]}"
    # two runs at once on what is left: each job at most once, every job recorded
    ran.clear()
    fails = set()
    threads = [threading.Thread(target=run_jobs, args=(edited, runner, Manifest(folder / "m.jsonl")),
                                kwargs={"poll_s": 0.01}) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    if any(t.is_alive() for t in threads):
        return "hang", "two concurrent runs"
    if len(ran) != len(set(ran)):
        return "silent", f"a job ran twice at once: {sorted(ran)[:6]}"
    recorded = {(e["id"], e.get("digest")) for e in manifest.entries() if e.get("status") == DONE}
    missing = [j.key for j in edited if j.key not in recorded]
    if missing:
        return "silent", f"jobs never done after the concurrent runs: {missing[:4]}"
    return "read", ""


def _as_line(job) -> dict[str, Any]:
    line = dict(job.values)
    if job.named:
        line["id"] = job.id
    if job.sets:
        line["set"] = list(job.sets)
    return line


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = fuzz_parser(__doc__, cases=1500).parse_args(argv)
    rng = random.Random(args.seed)

    def case(_index: int) -> tuple[str, str, dict[str, Any]]:
        with tempfile.TemporaryDirectory(prefix="lingbot-fuzz-jobs-") as folder:
            try:
                return (*one(random.Random(rng.randrange(2**32)), Path(folder)), {})
            except Exception as err:  # noqa: BLE001 - counting what escapes is the point
                where = traceback.format_exc().strip().splitlines()[-3][:200]
                return "crash", f"{type(err).__name__}: {str(err)[:200]} at {where}", {}

    tally = fuzz_tally(args.cases, case, ("read", "refused"), hang_s=20)
    return fuzz_report({"cases": args.cases, "seed": args.seed, **tally}, args.json)


if __name__ == "__main__":
    main()
