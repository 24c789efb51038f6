"""Many videos from one workflow: a jobs file, its share per data-parallel group, and a manifest.

A jobs file is JSON Lines: one object per line (blank lines and lines starting with ``#`` are
skipped), each a set of overrides on the workflow, e.g.::

    {"id": "boat", "prompt": "...", "seed": 7, "size": "832x480", "frames": 121, "steps": 40}
    {"seed": 8, "set": ["Denoise.cfg=4.5"]}

The short keys are the rows of `JOB_FIELDS` (each fills the named input of every node of its
classes); ``set`` takes ``NODE.INPUT=VALUE`` overrides as ``lingbot-run --set`` does; ``id`` names
the job in the manifest and in its file names. The whole file is read and checked before anything
runs: a line that is not such an object is an error naming the line.

A job is known by what it asks for, not by its line: its `digest` is a hash of its normalised
content (the values and ``set`` overrides; key order, spacing and ``"WxH"`` / ``[W, H]`` do not
count), and its default id is ``j`` and the digest's first 12 hex digits (``.2``, ``.3``, ... for the
second and later copies of one content). The manifest matches a job by id *and* digest, so editing
the file (inserting, removing or reordering lines, changing a job) never skips a job that did not
run nor counts one as another. Manifest lines written before digests existed match by id and line.

A job then runs on one data-parallel group of the world: job i (in file order) belongs to group
i % groups, and only the group's leader writes (files and the manifest). Every finished job appends
one line to the manifest (id, line, status, outputs, seconds); a job that fails -- an override the
workflow refuses, or an error while running -- is recorded as failed and the next job starts on the
same engine (loaded models stay loaded). A second run with the same manifest skips the jobs recorded
as done (failed ones run again), so an interrupted batch resumes where it stopped. Jobs are given
to groups by their place in the whole file, not among the unfinished ones, so the groups need no
communication to agree: each reads the manifest for its own jobs only.

Two runs on one jobs file at once (two terminals, two machines on a shared folder) split the work
instead of doing it twice: before a job starts, its leader claims it with a lock on a file of its
own in ``<manifest stem>.claims/`` beside the manifest (`Claims`: ``flock``, which Linux's NFS client
turns into a lock the server arbitrates; the lock ends with the process holding it, so a killed run
leaves no stale claim). A job another process holds is left to it; once the rest of its share is
done, a run waits for such jobs and runs any that the other process dropped without a manifest
line, so each run ends with its whole share recorded. A job claimed after another run let it go is
looked up in the manifest again first. In a group of several ranks only the leader claims, and
tells the others what it decided (`group_agreement`).

The manifest is one file per writer: with several groups, group g's leader appends to
``<stem>.group<g><suffix>`` beside the named file (``jobs.manifest.group3.jsonl``), and a world of
one group to the named file itself. No two processes ever append to one file, which NFS (the usual
folder shared by several machines) does not make safe: its appends from two clients can overwrite
each other. Reading takes the named file and every ``.group<N>`` one, so a batch resumes under a
different world (more nodes, other degrees) or from a manifest written before the split.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lingbot_core.exit_codes import INTERRUPTED, exit_code, root_cause
from lingbot_core.weights.fileio import BINARY, read_at, write_at
from lingbot_core.workflow.errors import WorkflowError, clip

__all__ = ["DONE", "FAILED", "JOB_FIELDS", "Claims", "Job", "JobField", "JobsFileError", "Manifest", "WorldPlace",
           "check_file_names", "failure_text", "finish_together", "group_agreement", "job_digest", "job_overrides",
           "read_jobs", "run_jobs", "world_place"]

DONE = "done"
FAILED = "failed"
MAX_JOBS_BYTES = 64 * 1024 * 1024  # a jobs file is read whole, after this bound is checked
MAX_LINE_CHARS = 1024 * 1024
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # ends up in file names: no separators


class JobsFileError(WorkflowError):
    """The jobs file cannot be used as given (nothing has run); the message names the line."""


def _shown(value: Any) -> str:
    """A value for a message, its repr cut to 80 characters (a 100,000-character prompt is not echoed)."""
    return clip(repr(value), 80)


@dataclass(frozen=True)
class JobField:
    """One short key of a jobs line: which node inputs its value fills.

    ``inputs`` are filled on every node of the ``classes`` the workflow has; a key with two inputs
    (``size``) takes ``"WxH"`` or ``[W, H]``.
    """

    key: str
    classes: tuple[str, ...]
    inputs: tuple[str, ...]
    kind: type | tuple[type, ...]
    help: str

    def values(self, value: Any) -> tuple[Any, ...]:
        """The value for each of `inputs`; ValueError says what was expected."""
        if len(self.inputs) == 2:
            parts = value.lower().split("x") if isinstance(value, str) else value
            if not isinstance(parts, (list, tuple)) or len(parts) != 2:
                raise ValueError(f"'{self.key}' must be \"WxH\" or [W, H], got {_shown(value)}")
            try:
                return tuple(int(p) for p in parts)
            except (TypeError, ValueError):
                raise ValueError(f"'{self.key}' must be \"WxH\" or [W, H] with whole numbers, got {_shown(value)}") from None
        if isinstance(value, bool) or not isinstance(value, self.kind):
            want = " or ".join(k.__name__ for k in (self.kind if isinstance(self.kind, tuple) else (self.kind,)))
            raise ValueError(f"'{self.key}' must be {want}, got {_shown(value)}")
        return (value,)


#: the short keys a jobs line may use (besides ``id`` and ``set``); the CLI's help lists them
JOB_FIELDS: dict[str, JobField] = {f.key: f for f in (
    JobField("prompt", ("LingBotTextEncode",), ("prompt",), str, "the prompt of every Text Encode"),
    JobField("negative", ("LingBotTextEncode",), ("negative_prompt",), str, "the negative prompt of every Text Encode"),
    JobField("seed", ("LingBotDenoise", "LingBotRefine"), ("seed",), int, "the seed of Denoise and Refine"),
    JobField("size", ("LingBotDenoise",), ("width", "height"), (str, list), "Denoise's \"WxH\""),
    JobField("frames", ("LingBotDenoise",), ("frames",), int, "Denoise's frame count"),
    JobField("steps", ("LingBotDenoise",), ("steps",), int, "Denoise's step count"),
    JobField("cfg", ("LingBotDenoise",), ("cfg",), (int, float), "Denoise's guidance scale"),
    JobField("rewrite", ("LingBotRewrite",), ("prompt",), str,
             "the plain-words prompt of every Rewrite node (lingbot-run --rewrite, or a rewrite workflow)"),
    JobField("video", ("LingBotLoadVideo",), ("path",), str,
             "the input video file of every Load Video (v2v, extend; as --video, an extension takes the whole clip)"),
    JobField("segment_prompts", ("LingBotExtendVideo",), ("prompts",), (str, list),
             "Extend Video's per-segment prompts (as --segment-prompts: text, or a JSON list of them)"),
)}
_OTHER_KEYS = ("id", "set")


def job_digest(values: dict[str, Any], sets: Sequence[str]) -> str:
    """The hex sha256 of a job's normalised content: each short key's values as its inputs take them
    (``"832x480"`` and ``[832, 480]`` alike, a number as a float), then the ``set`` overrides in order."""
    normal = {key: [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                    for v in JOB_FIELDS[key].values(value)] for key, value in values.items()}
    text = json.dumps({"values": normal, "set": list(sets)}, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Job:
    """One line of a jobs file, checked: its id, 1-based line number, its values by key, its ``set``
    overrides and the digest of that content (`job_digest`; computed when not given). `named`: the
    id was written in the file (else it comes from the digest)."""

    id: str
    line: int
    values: dict[str, Any] = field(default_factory=dict)
    sets: tuple[str, ...] = ()
    digest: str = ""
    named: bool = True

    def __post_init__(self) -> None:
        if not self.digest:
            object.__setattr__(self, "digest", job_digest(self.values, self.sets))

    @property
    def key(self) -> tuple[str, str]:
        """What the manifest matches: (id, digest)."""
        return (self.id, self.digest)

    @property
    def legacy_key(self) -> tuple[str, int]:
        """What a manifest line written before digests names: (the id of that time, line)."""
        return (self.id if self.named else f"line{self.line}", self.line)


def read_jobs(path: str | os.PathLike[str]) -> list[Job]:
    """Every job of a jobs file, or JobsFileError naming the first bad line (nothing runs then)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as err:
        raise JobsFileError(f"jobs file {path}: {err.strerror or err}") from None
    if size > MAX_JOBS_BYTES:
        raise JobsFileError(f"jobs file {path}: {size} bytes; the limit is {MAX_JOBS_BYTES}")
    try:
        text = path.read_text(encoding="utf-8-sig")  # an editor's byte-order mark is not part of line 1
    except (OSError, UnicodeDecodeError) as err:
        raise JobsFileError(f"jobs file {path}: cannot read it as UTF-8 text ({err})") from None
    jobs: list[Job] = []
    seen: dict[str, int] = {}
    copies: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        job = _parse_line(stripped, number, path)
        if not job.named:  # the n-th copy of one content: the same id whatever lines come between
            copies[job.digest] = copies.get(job.digest, 0) + 1
            if copies[job.digest] > 1:
                job = Job(f"{job.id}.{copies[job.digest]}", number, job.values, job.sets, job.digest, named=False)
        if job.id in seen:
            raise JobsFileError(f"{path}:{number}: id {job.id!r} is already used on line {seen[job.id]}")
        seen[job.id] = number
        jobs.append(job)
    if not jobs:
        raise JobsFileError(f"jobs file {path} has no jobs (one JSON object per line)")
    return jobs


def _parse_line(text: str, number: int, path: Path) -> Job:
    where = f"{path}:{number}"
    if len(text) > MAX_LINE_CHARS:
        raise JobsFileError(f"{where}: the line is {len(text)} characters; the limit is {MAX_LINE_CHARS}")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise JobsFileError(f"{where}: not JSON ({err})") from None
    if not isinstance(obj, dict):
        raise JobsFileError(f"{where}: a job is a JSON object such as {{\"prompt\": \"...\", \"seed\": 1}}, "
                            f"got {type(obj).__name__}")
    unknown = [k for k in obj if k not in JOB_FIELDS and k not in _OTHER_KEYS]
    if unknown:
        known = ", ".join([*_OTHER_KEYS, *JOB_FIELDS])
        raise JobsFileError(f"{where}: unknown key {_shown(unknown[0])} (keys: {known}; other inputs go in "
                            "\"set\": [\"NODE.INPUT=VALUE\"])")
    job_id = obj.get("id")
    if job_id is not None and (not isinstance(job_id, str) or not ID_PATTERN.fullmatch(job_id)):
        raise JobsFileError(f"{where}: id {_shown(job_id)} must be 1-64 letters, digits, '.', '_' or '-' "
                            "(it becomes part of file names)")
    sets = obj.get("set", [])
    if isinstance(sets, str):
        sets = [sets]
    if not isinstance(sets, list) or not all(isinstance(s, str) for s in sets):
        raise JobsFileError(f"{where}: \"set\" must be a list of \"NODE.INPUT=VALUE\" strings")
    values = {}
    for key, spec in JOB_FIELDS.items():
        if key in obj:
            try:
                spec.values(obj[key])
            except ValueError as err:
                raise JobsFileError(f"{where}: {err}") from None
            values[key] = obj[key]
    digest = job_digest(values, sets)
    if job_id is None:
        return Job(f"j{digest[:12]}", number, values, tuple(sets), digest, named=False)
    return Job(job_id, number, values, tuple(sets), digest)


def job_overrides(nodes: dict[str, dict[str, Any]], job: Job) -> list[str]:
    """``NODE.INPUT=VALUE`` overrides for `job` on a workflow's API nodes (id -> node).

    Every output node with a text ``filename_prefix`` gets ``<prefix>_<id>``, so the files of the
    jobs differ and no two writers race for a file number; the job's own ``set`` comes last.
    ValueError when the workflow has no node a short key fills.
    """
    out = []
    for nid, node in nodes.items():
        prefix = node.get("inputs", {}).get("filename_prefix")
        if isinstance(prefix, str):
            out.append(f"{nid}.filename_prefix={json.dumps(f'{prefix}_{job.id}')}")
    for key, value in job.values.items():
        spec = JOB_FIELDS[key]
        targets = [nid for nid, node in nodes.items() if node.get("class_type") in spec.classes]
        if not targets:
            raise ValueError(f"'{key}' sets {' / '.join(spec.classes)}, but the workflow has no such node")
        for nid in targets:
            out += [f"{nid}.{name}={json.dumps(v)}" for name, v in zip(spec.inputs, spec.values(value), strict=True)]
            if key == "video" and any(n.get("class_type") == "LingBotExtendVideo" for n in nodes.values()):
                out.append(f"{nid}.frame_count=0")  # as --video: an extension continues the whole clip
    return out + list(job.sets)


WRITER_PATTERN = re.compile(r"group[0-9]{1,6}")


def check_file_names(nodes: dict[str, dict[str, Any]], place: WorldPlace) -> None:
    """Refuse (WorkflowError) a workflow whose files could collide between the world's groups.

    `job_overrides` puts the job's id into every text ``filename_prefix``, so no two jobs share a
    file name; a prefix that comes through a link cannot get it. One process then numbers the files
    of its jobs one after the other, but several groups writing into one folder (a machine's, or a
    shared one) would each pick the same next number and replace each other's file."""
    linked = [nid for nid, node in nodes.items() if isinstance(node.get("inputs", {}).get("filename_prefix"), list)]
    if linked and place.groups > 1:
        raise WorkflowError(f"--jobs on {place.groups} groups of processes: node(s) {', '.join(linked)} take their "
                            "filename_prefix through a link, so the job id cannot be added to it and two processes "
                            "could write the same file name; give them a text prefix (e.g. --set "
                            f"{linked[0]}.filename_prefix=lingbot/batch)")


class Manifest:
    """The jsonl record of finished jobs: one line appended per job, read back to resume.

    `path` names the manifest; `writer` (``group<N>``, see `WorldPlace.writer`) makes this process
    append to its own file beside it (`write_path`), None to `path` itself. Each line is one
    ``write`` followed by ``fsync``. A line cut short (a process killed mid-write, a crash that left
    zero bytes) is skipped when reading, and the next line written after it starts on a line of its
    own.
    """

    def __init__(self, path: str | os.PathLike[str], writer: str | None = None) -> None:
        self.path = Path(path)
        if writer is not None and not WRITER_PATTERN.fullmatch(writer):
            raise ValueError(f"manifest writer {writer!r} is not group<N>")
        self.writer = writer

    @property
    def write_path(self) -> Path:
        """The file this process appends to."""
        if self.writer is None:
            return self.path
        return self.path.with_name(f"{self._stem}.{self.writer}{self.path.suffix}")

    @property
    def _stem(self) -> str:
        return self.path.name[: len(self.path.name) - len(self.path.suffix)]

    def files(self) -> list[Path]:
        """Every file of this manifest that exists: the named one, then each writer's (by group)."""
        found = [self.path] if self.path.is_file() else []
        stem, suffix = self._stem, self.path.suffix
        writers = []
        if self.path.parent.is_dir():
            for candidate in self.path.parent.iterdir():
                name = candidate.name
                if name.startswith(f"{stem}.") and name.endswith(suffix) and candidate.is_file():
                    middle = name[len(stem) + 1: len(name) - len(suffix)]
                    if WRITER_PATTERN.fullmatch(middle):
                        writers.append((int(middle[len("group"):]), candidate))
        return found + [path for _n, path in sorted(writers)]

    def entries(self) -> Iterator[dict[str, Any]]:
        """Every readable line of every file (`files`); torn or foreign lines are skipped."""
        for path in self.files():
            try:
                f = path.open(encoding="utf-8", errors="replace")
            except OSError:  # gone since it was listed (another run cleaning up)
                continue
            with f:
                for raw in f:
                    try:
                        entry = json.loads(raw)
                    except ValueError:
                        continue
                    if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                        yield entry

    def done(self) -> set[str]:
        """Ids of the jobs recorded as done (a later failure of the same id does not undo it)."""
        return {e["id"] for e in self.entries() if e.get("status") == DONE}

    def tally(self) -> tuple[set[tuple[str, Any]], dict[tuple[str, Any], int]]:
        """What the jobs recorded as done match (`is_done`): (id, digest), or (id, line) for a line
        written before digests were recorded; and how many failed lines each (id, digest) has."""
        done: set[tuple[str, Any]] = set()
        failures: dict[tuple[str, Any], int] = {}
        for e in self.entries():
            digest, line = e.get("digest"), e.get("line")
            if e.get("status") != DONE:
                if isinstance(digest, str):
                    failures[(e["id"], digest)] = failures.get((e["id"], digest), 0) + 1
            elif isinstance(digest, str):
                done.add((e["id"], digest))
            elif isinstance(line, int) and not isinstance(line, bool):
                done.add((e["id"], line))
        return done, failures

    @staticmethod
    def is_done(job: Job, keys: set[tuple[str, Any]]) -> bool:
        """Is `job` among `keys` (the first half of `tally`)?"""
        return job.key in keys or job.legacy_key in keys

    @property
    def claims_folder(self) -> Path:
        """Where the jobs' claim files are (`Claims`): ``<stem>.claims`` beside the named file."""
        return self.path.with_name(f"{self._stem}.claims")

    def record(self, entry: dict[str, Any]) -> None:
        """Append `entry` as one line of `write_path` (after a newline if the file ends mid-line)."""
        path = self.write_path
        path.parent.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8")
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | BINARY, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and read_at(fd, 1, size - 1) != b"\n":
                line = b"\n" + line  # a torn last line stays a line of its own, skipped when read
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)


class Claims:
    """One lock file per job (id and digest) in `folder`: a job runs only in the process that holds
    its lock, so two runs on one jobs file never run a job twice at once.

    The lock is ``flock`` (``msvcrt.locking`` on Windows) on a file that is never removed (removing
    a lock file lets a third process lock a new file of the same name while the old lock is held);
    it goes with the process holding it, so a killed run leaves nothing stale. The file holds who
    claimed it last (host, pid, time), for people. `take` says whether anyone had claimed the job
    before (then the caller reads the manifest again: that run may have finished it since)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self._held: dict[tuple[str, str], int] = {}

    def _path(self, job: Job) -> Path:
        return self.folder / f"{job.id}.{job.digest[:16]}.claim"

    def take(self, job: Job) -> tuple[bool, bool]:
        """(held now, claimed before): False when another process holds the job. OSError when the
        folder cannot be written."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._path(job), os.O_RDWR | os.O_CREAT | BINARY, 0o644)
        try:
            if not _try_lock(fd):
                os.close(fd)
                return False, True
            before = os.fstat(fd).st_size > 0
            note = json.dumps({"id": job.id, "digest": job.digest, "host": socket.gethostname(), "pid": os.getpid(),
                               "claimed": datetime.now(UTC).isoformat(timespec="seconds")})
            os.ftruncate(fd, 0)
            write_at(fd, note.encode() + b"\n", 0)
        except BaseException:
            os.close(fd)
            raise
        self._held[job.key] = fd
        return True, before

    def release(self, job: Job) -> None:
        """Let the job go (closing the file drops the lock)."""
        fd = self._held.pop(job.key, None)
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:  # a batch stopped by an exception: its claim goes with it
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()


def _try_lock(fd: int) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


RUN, SKIP, BROKE, HELD, GONE = 1, 0, 2, 3, 4  # what a group's leader decides for a job (`group_agreement`)
Agreement = Callable[[int], int]


def group_agreement(layout: Any) -> Agreement | None:
    """The leader's decision for each job (`RUN`, `SKIP`, `HELD`, ...) sent to every rank of its video
    group (`layout`: a `ParallelLayout` of several ranks), so the ranks that make a video together run
    the same jobs whatever the manifest and the claims say by the time each reads them. None: a
    one-process group decides alone."""
    if layout is None or layout.world_size <= 1:
        return None
    import torch
    import torch.distributed as dist

    group = layout.group  # None: the whole world is one video (the default group)

    def agree(decision: int) -> int:
        device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        value = torch.tensor([decision], dtype=torch.int64, device=device)
        dist.broadcast(value, src=layout.leader_rank, group=group)
        return int(value.item())

    return agree


@dataclass(frozen=True)
class WorldPlace:
    """Where this process stands among data-parallel groups of `group_size` ranks each.

    `video` / `member` are its group's index and its place in that group as a parallel layout made
    them (`ParallelLayout.video`, `.rank`: groups kept inside nodes); None: groups of consecutive ranks.
    """

    rank: int = 0
    world_size: int = 1
    group_size: int = 1
    video: int | None = None
    member: int | None = None

    @property
    def groups(self) -> int:
        return self.world_size // self.group_size

    @property
    def group(self) -> int:
        return self.rank // self.group_size if self.video is None else self.video

    @property
    def leader(self) -> bool:
        """Rank 0 of its group: the one that writes files and manifest lines."""
        return self.rank % self.group_size == 0 if self.member is None else self.member == 0

    @property
    def writer(self) -> str | None:
        """This group's manifest file name part (`Manifest`): None when the world is one group."""
        return f"group{self.group}" if self.groups > 1 else None

    def share(self, jobs: Sequence[Job]) -> list[Job]:
        """This group's jobs: every `groups`-th from its index, by place in the whole file."""
        return list(jobs[self.group::self.groups])


def world_place(group_size: int = 1, layout: Any = None) -> WorldPlace:
    """This process's place: from `layout` (a `ParallelLayout` of several processes: its video
    group), else from torch.distributed when initialised, else torchrun's RANK / WORLD_SIZE
    variables, else one process. `group_size` (ranks that make one video together) must divide the
    world size."""
    if layout is not None and layout.world_size > 1:
        group_size = layout.world_size
    dist = sys.modules.get("torch.distributed")  # not imported: no group can be initialised
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError("RANK and WORLD_SIZE must be whole numbers (as torchrun sets them)") from None
    if group_size < 1 or world % group_size:
        raise ValueError(f"{group_size} ranks per video do not divide the world of {world} processes")
    if layout is not None and layout.world_size > 1:
        return WorldPlace(rank, world, group_size, video=layout.video, member=layout.rank)
    return WorldPlace(rank, world, group_size)


JobRunner = Callable[[Job], list[str]]  # runs one job, returns the files it wrote


def run_jobs(jobs: Sequence[Job], run_one: JobRunner, manifest: Manifest, *, place: WorldPlace = WorldPlace(),
             on_result: Callable[[dict[str, Any]], None] | None = None, agree: Agreement | None = None,
             on_skip: Callable[[Job, str], None] | None = None, poll_s: float = 1.0) -> list[dict[str, Any]]:
    """Run this group's unfinished jobs with `run_one`, one manifest line each (leader only).

    A job's exception is recorded as failed and the next job runs; an interrupt (Ctrl-C, an
    interrupt exception) stops the batch and propagates, the jobs already recorded staying done. So
    does, after its manifest line, a failure that broke the group's collectives (an error marked
    `stops_group`: `distributed.abort.GroupBroken`, one rank failing inside a DiT forward): the group
    cannot run another job, and a rerun resumes after the jobs recorded as done.
    Returns the entries of the jobs run here (``on_result`` sees each as it is recorded).

    Each job is claimed first (`Claims`, leader only; `agree` hands the leader's decision to the
    rest of a group of several ranks, `group_agreement`). A job another process holds (a second run
    on the same jobs file) is left to it, and after the rest of the share this process waits for it
    (`_claimed`): so every run ends with its whole share recorded. `on_skip` hears ``(job, "done")``
    (done before this run), ``(job, "waiting")`` and then ``(job, "elsewhere")`` (recorded by
    another process meanwhile) for the jobs not run here.
    """
    claims = Claims(manifest.claims_folder)
    results = []
    for job in _claimed(place.share(jobs), manifest, claims, place, agree, on_skip, poll_s):
        started = time.perf_counter()
        entry: dict[str, Any] = {"id": job.id, "line": job.line, "digest": job.digest}
        stop: Exception | None = None
        try:
            outputs = run_one(job)
        except Exception as err:
            if exit_code(err) == INTERRUPTED:
                raise
            entry.update(status=FAILED, outputs=[], error=failure_text(err))
            if getattr(root_cause(err), "stops_group", False):
                stop = err
        else:
            entry.update(status=DONE, outputs=[str(p) for p in outputs])
        entry.update(seconds=round(time.perf_counter() - started, 3), rank=place.rank,
                     finished=datetime.now(UTC).isoformat(timespec="seconds"))
        if place.leader:
            manifest.record(entry)
        claims.release(job)
        results.append(entry)
        if on_result is not None:
            on_result(entry)
        if stop is not None:
            raise stop
    return results


def _claimed(jobs: Sequence[Job], manifest: Manifest, claims: Claims, place: WorldPlace, agree: Agreement | None,
             on_skip: Callable[[Job, str], None] | None, poll_s: float) -> Iterator[Job]:
    """The jobs of this share that this process runs, in order: first each job nobody else holds; then,
    one at a time, those another process held: waited for (its claim tried every `poll_s` seconds)
    and run here only if that process let it go without a manifest line (killed before the end)."""
    seen = manifest.tally() if place.leader or agree is None else (set(), {})
    held: list[Job] = []
    for job in jobs:
        decision = _agreed(job, manifest, claims, seen, place, agree)
        if decision == RUN:
            yield job
        elif decision == HELD:
            held.append(job)
        elif on_skip is not None:
            on_skip(job, "done")
    for job in held:
        if on_skip is not None:
            on_skip(job, "waiting")
        while (decision := _agreed(job, manifest, claims, seen, place, agree)) == HELD:
            time.sleep(poll_s)
        if decision == RUN:
            yield job
        elif on_skip is not None:
            on_skip(job, "elsewhere")


def _agreed(job: Job, manifest: Manifest, claims: Claims, seen: tuple[set, dict], place: WorldPlace,
            agree: Agreement | None) -> int:
    """What to do with `job`: the leader's decision (`_decide`), shared with its group."""
    decision = SKIP
    if place.leader or agree is None:
        try:
            decision = _decide(job, manifest, claims, seen)
        except OSError as err:
            if agree is not None:
                agree(BROKE)
            raise JobsFileError(f"cannot claim job {job.id} in {claims.folder}: {err.strerror or err}") from None
    if agree is not None:
        decision = agree(decision)
        if decision == BROKE:
            raise JobsFileError(f"the leader of this group could not claim job {job.id} (its error says why)")
    return decision


def _decide(job: Job, manifest: Manifest, claims: Claims, seen: tuple[set, dict]) -> int:
    """RUN when `job` is not done and this process now holds its claim; SKIP when the manifest said done
    when this run began; HELD while another process holds it; GONE when another process recorded it
    (done or failed) since this run read the manifest."""
    done, failures = seen
    if Manifest.is_done(job, done):
        return SKIP
    taken, before = claims.take(job)
    if not taken:
        return HELD
    if before:  # another run had it: it may have finished it since this run read the manifest
        done_now, failures_now = manifest.tally()
        if Manifest.is_done(job, done_now) or failures_now.get(job.key, 0) > failures.get(job.key, 0):
            claims.release(job)
            return GONE
    return RUN


_FINISHES = [0]


def finish_together(failed: int, *, stopped: bool = False, poll_s: float = 1.0,
                    say: Callable[[str], None] | None = None) -> int:
    """Wait until every process of the initialised world has finished its share of the jobs; returns
    how many jobs failed in the whole world (`failed`: this process's count, leaders only), at least
    1 when a process stopped its share early.

    Why: torchrun stops every worker of a node when one exits non-zero, and a node whose workers
    all succeeded waits (5 minutes, then an error) for the others at its exit. A process whose
    share is done early and had a failed job would so stop its node's other processes in the middle
    of their jobs. Here every process leaves at the same moment, all with the world's verdict.

    Shares may end hours apart, longer than any collective's timeout, so the wait is a counter in
    the process group's store, read every `poll_s` seconds, and a barrier once all are in (so no
    process, the store's host among them, leaves while another still reads). `stopped`: this
    process leaves its share unfinished (an interrupt, an error outside the jobs): it says so in the
    store and returns at once, and the waiting ones stop waiting and skip the barrier. A process
    that dies without a word is torchrun's to stop (the manifest lines are written before this).
    `say` gets one line when this process has to wait. Without an initialised group: `failed`."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return failed
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()  # the group's rendezvous store (torchrun's agent store, or rank 0's)
    world = dist.get_world_size()
    _FINISHES[0] += 1  # every process calls this as often as the others: a key of its own each time
    key = f"lingbot-jobs/{_FINISHES[0]}"
    if stopped:
        store.add(f"{key}/stopped", 1)
        return max(failed, 1)
    store.add(f"{key}/failed", int(failed))
    waiting = store.add(f"{key}/finished", 1) < world
    if waiting and say is not None:
        say(f"jobs: this share is finished; waiting for the other processes of the world ({world}) to finish theirs")
    pause = min(0.05, poll_s)
    stopped_elsewhere = 0
    try:
        while waiting and not stopped_elsewhere:
            time.sleep(pause)
            pause = min(2 * pause, poll_s)  # quick when the shares end close together, then every poll_s
            waiting = store.add(f"{key}/finished", 0) < world
            stopped_elsewhere = store.add(f"{key}/stopped", 0)
        total = store.add(f"{key}/failed", 0)
    except RuntimeError:  # the store is gone: its host (rank 0, where torchrun's agent does not hold it) left
        stopped_elsewhere, total = 1, failed
    if stopped_elsewhere:
        if say is not None:
            say("jobs: another process stopped before the end of its share; leaving without waiting for it")
        return max(int(total), 1)
    dist.barrier()
    return int(total)


def failure_text(err: BaseException) -> str:
    """One line for the manifest: the node that failed (when one did) and what it raised."""
    cause = root_cause(err)
    where = ""
    if cause is not err and getattr(err, "node_id", None) is not None:
        where = f"node {err.node_id} ({err.class_type}): "
    kind = "" if isinstance(cause, WorkflowError) else f"{type(cause).__name__}: "
    return clip(" ".join(f"{where}{kind}{cause}".split()), 2000)
