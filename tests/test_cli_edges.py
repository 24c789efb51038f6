"""`lingbot-run` and `python -m lingbot_core` rough edges: flags that would be ignored, noisy progress,
late failures, signals and messages (each found by running the commands as a user would)."""

from __future__ import annotations

import sys

import pytest
from background import Child, selected

from lingbot_nodes.cli import main

QUIET_RUNS = [("lingbot-run", ["t2i", "--set", "Denoise.steps=1"]), ("core", ["--mode", "t2i", "--steps", "1"])]


@pytest.fixture
def no_model_work(monkeypatch):
    """Any model work fails the test: what is checked here must be refused before it."""
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    def must_not_run(*_a, **_k):
        raise AssertionError("the loader ran")

    for name in ("LingBotLoader", "LingBotLoaderFiles"):
        monkeypatch.setattr(NODE_CLASS_MAPPINGS[name], "execute", must_not_run)


def _last_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "nothing on stderr"
    return err[-1]


@pytest.mark.parametrize("flag,value", [("--rewrite-endpoint", "http://127.0.0.1:9/v1"), ("--rewrite-model", "m"),
                                        ("--rewrite-map-model", "m"), ("--rewrite-duration", "3")])
def test_rewrite_settings_without_rewrite_are_refused(tmp_path, capsys, no_model_work, flag, value):
    assert main(["t2v", flag, value, "--output", str(tmp_path)]) == 2
    line = _last_error(capsys)
    assert line.startswith("error: ") and flag in line and "--rewrite \"" in line, line


def test_rewrite_settings_fill_a_rewrite_workflows_node_without_rewrite():
    from lingbot_core.workflow import load_workflow
    from lingbot_nodes import NODE_CLASS_MAPPINGS
    from lingbot_nodes.cli import insert_rewrite, resolve_workflow

    prompt = load_workflow(resolve_workflow("t2v-rewrite"), NODE_CLASS_MAPPINGS)
    saved = {nid: dict(n["inputs"]) for nid, n in prompt.nodes.items() if n["class_type"] == "LingBotRewrite"}
    before = set(prompt.nodes)
    prompt = insert_rewrite(prompt, None, endpoint="http://127.0.0.1:9/v1", model="expand-m")
    assert set(prompt.nodes) == before and saved
    for nid, inputs in saved.items():
        now = prompt.nodes[nid]["inputs"]
        assert now["prompt"] == inputs["prompt"] and now["endpoint"] == "http://127.0.0.1:9/v1"
        assert now["expand_model"] == "expand-m"


def test_a_local_rewrites_progress_is_rate_limited(monkeypatch):
    """The local rewriter calls back once per generated token (thousands per prompt); the node passes on a
    few dozen updates per stage, each stage's last token among them."""
    from lingbot_core import rewrite as rw
    from lingbot_nodes import NODE_CLASS_MAPPINGS, runtime
    from lingbot_nodes.rewrite import PROGRESS_UPDATES

    updates = []

    class Recorded:
        def __init__(self, total, label=""):
            pass

        def update(self, value, total=None, preview=None):
            updates.append((value, total))

        def close(self):
            pass

    def generating(request, backend, sampling=None, on_token=None, **_):
        for stage, count in (("expand", 2048), ("map", 2048), ("repair", 1024)):
            for token in range(1, count + 1):
                on_token(stage, token, 2048)
        return rw.RewriteResult(caption="{}", expanded="words", document={})

    monkeypatch.setattr(runtime, "Progress", Recorded)
    monkeypatch.setattr(rw, "rewrite", generating)
    NODE_CLASS_MAPPINGS["LingBotRewrite"].execute("a boat", endpoint="http://127.0.0.1:9/v1", expand_model="m")
    assert 3 <= len(updates) <= 3 * (PROGRESS_UPDATES + 2), len(updates)
    assert (2048, 2048) in updates and 1024 - 2048 // PROGRESS_UPDATES < updates[-1][0] <= 1024


def test_every_jobs_overrides_are_checked_before_any_model_work(tmp_path, capsys, no_model_work):
    """A bad `set` or `size` deep in a jobs file is reported before the first job's models load (it used to
    surface when its turn came, hours into a batch); here the first good job then meets the loader."""
    import json

    jobs = [{"id": "good", "seed": 1}] + [{"seed": i} for i in range(2, 40)] + [
        {"id": "size", "size": "833x480"}, {"id": "sigmas", "set": ["Denoise.sigmas=abc"]},
        {"id": "steps", "set": ["Denoise.steps=-1"]}, {"id": "node", "set": ["Nope.x=1"]}]
    path = tmp_path / "jobs.jsonl"
    path.write_text("\n".join(json.dumps(job) for job in jobs))
    assert main(["t2i", "--jobs", str(path), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.splitlines()
    first_run = next(i for i, line in enumerate(err) if line.startswith("job good (line 1)"))
    refused = [line for line in err[:first_run] if "recorded as failed" in line]
    assert [line.split()[2] for line in refused] == ["size", "sigmas", "steps", "node"], err[:first_run]
    assert "multiple of 16" in refused[0] and "custom sigmas must be numbers" in refused[1]
    assert sum("multiple of 16" in line for line in err) == 1, err  # not again when its turn comes


def test_a_library_error_while_checking_jobs_is_not_a_bad_job(tmp_path, capsys, monkeypatch, no_model_work):
    """Checking the jobs catches refused inputs only: a ValueError some library raised is a failure (exit 1),
    not every job recorded as bad input."""
    import json

    from lingbot_nodes import jobs as jobs_module

    def library_failure(*_a, **_k):
        import numpy

        numpy.zeros(-1)  # raises ValueError inside numpy

    monkeypatch.setattr(jobs_module, "job_overrides", library_failure)
    path = tmp_path / "jobs.jsonl"
    path.write_text(json.dumps({"seed": 1}))
    assert main(["t2i", "--jobs", str(path), "--output", str(tmp_path / "out")]) == 1
    assert "recorded as failed" not in capsys.readouterr().err


def test_batch_rewriting_with_rewrite_and_a_per_job_field(tmp_path, capsys, monkeypatch):
    """--rewrite with --jobs: a Rewrite node before Text Encode, its prompt the job's `rewrite` field, or
    --rewrite's text for a job without one."""
    import json

    from rewrite_fakes import FakeChatServer, reply, valid_caption

    from lingbot_core import rewrite as rw

    monkeypatch.delenv(rw.ENDPOINTS_ENV, raising=False)
    document = json.dumps(valid_caption(0.5))
    path = tmp_path / "jobs.jsonl"
    path.write_text(json.dumps({"id": "own", "rewrite": "a green kite over a beach"}) + "\n"
                    + json.dumps({"id": "default", "seed": 3}))
    replies = [reply("A kite."), reply(document), reply("A boat."), reply(document)]
    with FakeChatServer(replies) as server:
        code = main(["t2v", "-q", "--output", str(tmp_path / "out"), "--jobs", str(path), "--set", "Denoise.steps=1",
                     "--rewrite", "a red paper boat at dawn", "--rewrite-endpoint", server.url,
                     "--rewrite-model", "base"])
    err = capsys.readouterr().err
    assert code == 0, err
    asked = [r["body"]["messages"][1]["content"] for r in server.requests if r["body"]["model"] == "base"]
    assert any("a green kite over a beach" in text for text in asked), asked
    assert any("a red paper boat at dawn" in text for text in asked), asked


def test_a_jobs_rewrite_field_without_a_rewrite_node_is_refused_before_work(tmp_path, capsys, no_model_work):
    import json

    path = tmp_path / "jobs.jsonl"
    path.write_text(json.dumps({"seed": 1}) + "\n" + json.dumps({"rewrite": "a kite"}))
    assert main(["t2v", "--jobs", str(path), "--output", str(tmp_path / "out")]) == 2
    line = _last_error(capsys)
    assert "'rewrite' on line(s) 2" in line and "--rewrite" in line, line


def _prose_run(tmp_path, monkeypatch, *extra: str) -> int:
    from lingbot_nodes import conditioning

    monkeypatch.setattr(conditioning, "_warned_prose", False)  # the once-per-process note fires again
    return main(["t2i", *extra, "--set", "Prompt.prompt=a red paper boat on a canal", "--set", "Denoise.steps=1",
                 "--output", str(tmp_path)])


def test_quiet_prints_no_notes(tmp_path, capsys, monkeypatch):
    assert _prose_run(tmp_path, monkeypatch, "-q") == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.strip().endswith(".png")


def test_a_note_is_printed_once_per_run_and_per_batch(tmp_path, capsys, monkeypatch):
    from lingbot_nodes.conditioning import PROSE_NOTICE

    assert _prose_run(tmp_path, monkeypatch) == 0
    assert capsys.readouterr().err.count(PROSE_NOTICE) == 1  # the log line, not again as the node's text
    import json

    path = tmp_path / "jobs.jsonl"
    path.write_text("\n".join(json.dumps({"seed": seed}) for seed in (1, 2, 3)))
    assert _prose_run(tmp_path, monkeypatch, "--jobs", str(path)) == 0
    assert capsys.readouterr().err.count(PROSE_NOTICE) == 1  # not once per job


def test_a_parallel_followers_texts_are_not_printed():
    from types import SimpleNamespace

    from lingbot_nodes.cli import Reporter, report_texts

    result = SimpleNamespace(ui={"7": {"text": ["LingBot memory (none offload)"]}})
    reporter = Reporter({"7": "Memory"}, enabled=False)
    assert report_texts(result, reporter.labels, reporter, {"7"}) == ["Memory:", "  LingBot memory (none offload)"]
    reporter.follower = True
    assert report_texts(result, reporter.labels, reporter, {"7"}) == []


def test_a_node_with_nothing_to_say_prints_nothing():
    """Its empty text is for the editor (it clears that node's earlier notice), not a label for the terminal."""
    from types import SimpleNamespace

    from lingbot_nodes.cli import Reporter, report_texts

    result = SimpleNamespace(ui={"3": {"text": ("",)}, "7": {"text": ["LingBot memory (none offload)"]}})
    reporter = Reporter({"3": "Prompt", "7": "Memory"}, enabled=True)
    assert report_texts(result, reporter.labels, reporter, {"7"}) == ["Memory:", "  LingBot memory (none offload)"]


def _unwritable_folder(tmp_path):
    """A folder this process cannot write in though its permission bits may say so: a read-only folder
    for a user, the kernel's /sys for root (`os.access` passes there as root)."""
    import os
    from pathlib import Path

    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        return folder
    sys_folder = Path("/sys")
    if not sys_folder.is_dir() or not os.access(sys_folder, os.W_OK):
        pytest.skip("needs the kernel's /sys folder (read-only, yet writable by its permissions as root)")
    return sys_folder


def test_an_unwritable_output_folder_is_found_by_writing(tmp_path, capsys, no_model_work):
    folder = _unwritable_folder(tmp_path)
    assert main(["t2i", "--output", str(folder / "lingbot-out")]) == 2
    line = _last_error(capsys)
    assert line.startswith("error: --output") and "cannot write in" in line, line
    assert not list(tmp_path.rglob(".lingbot-probe-*"))


def test_the_output_probe_leaves_nothing_behind(tmp_path):
    from lingbot_nodes.cli import check_output_dir

    check_output_dir(tmp_path / "new" / "deeper")
    assert list(tmp_path.iterdir()) == []


def test_the_core_command_finds_an_unwritable_output_folder_too(tmp_path, capsys):
    from lingbot_core.__main__ import main as core_main

    folder = _unwritable_folder(tmp_path)
    assert core_main(["--mode", "t2i", "--output", str(folder / "lingbot-out")]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: --output") and "cannot write in" in line, line


def test_a_missing_rewrite_model_is_named_by_its_flag(tmp_path, capsys, no_model_work):
    assert main(["t2v", "--rewrite", "a boat", "--rewrite-endpoint", "http://127.0.0.1:9/v1",
                 "--output", str(tmp_path)]) == 2
    line = _last_error(capsys)
    assert "--rewrite-model" in line and "expand_model" not in line, line


def test_sigterm_interrupts_like_ctrl_c_and_restores_the_handler():
    import os
    import signal

    from lingbot_core.exit_codes import TERMINATED, interrupted_code, sigterm_interrupts

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), sigterm_interrupts() as terms:
        with sigterm_interrupts() as inner:  # nested: the outer one's handler and record
            os.kill(os.getpid(), signal.SIGTERM)
    assert terms == [signal.SIGTERM] and inner is terms and interrupted_code(terms) == TERMINATED
    assert signal.getsignal(signal.SIGTERM) == before


def test_the_offload_choice_is_printed_once(tmp_path, capsys):
    """`auto` logs its choice while running; the Offload node's text saying the same is not printed again."""
    assert main(["t2i", "--set", "Offload.mode=auto", "--set", "Denoise.steps=1", "--output", str(tmp_path)]) == 0
    err = capsys.readouterr().err.splitlines()
    choice = [line for line in err if line.strip().startswith("auto offload:")]
    assert len(choice) == 1, err
    reason = choice[0].split("auto offload:", 1)[1].strip()
    assert sum(reason in line for line in err) == 1, err


def test_the_core_command_names_image_for_ti2v(tmp_path, capsys, monkeypatch):
    from lingbot_core import handle
    from lingbot_core.__main__ import main as core_main

    monkeypatch.setattr(handle.PipelineHandle, "open", lambda *a, **k: pytest.fail("the checkpoint was opened"))
    assert core_main(["--mode", "ti2v", "--output", str(tmp_path)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: ") and "--image" in line, line


NOISY = """
import logging, sys
from lingbot_core import save_path

def noisy(real):
    def call(*args, **kwargs):
        logging.getLogger("lingbot_core.save_path").warning("a note the run makes")
        return real(*args, **kwargs)
    return call

save_path.check_output_folder = noisy(save_path.check_output_folder)  # lingbot-run calls it while running
save_path.save_target = noisy(save_path.save_target)  # python -m lingbot_core, while running
if sys.argv[1] == "core":
    from lingbot_core.__main__ import main
else:
    from lingbot_nodes.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


@pytest.fixture(scope="module", autouse=True)
def quiet_runs(request, tmp_path_factory):
    """The --quiet runs below, each in a process of its own, started together when the module starts: they
    run on the second core while this module's other tests run here (tests/background.py)."""
    started = {}
    if selected(request, "test_quiet_drops_the_librarys_warnings_too"):
        for command, args in QUIET_RUNS:
            output = tmp_path_factory.mktemp(f"quiet_{command}")
            started[command] = Child([sys.executable, "-c", NOISY, command, *args, "-q", "--output", str(output)])
    yield started
    for child in started.values():
        child.stop()


@pytest.mark.parametrize("command,args", QUIET_RUNS)
def test_quiet_drops_the_librarys_warnings_too(quiet_runs, command, args):
    """A warning the library logs while running (a cut prompt, a guidance note) is not printed with --quiet:
    with no handler of ours Python prints warnings on stderr itself (a process of its own: pytest's log
    capture would hide that)."""
    done = quiet_runs[command].result(timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and done.stdout.strip()


def test_help_never_cuts_a_shipped_name_across_lines():
    from lingbot_nodes.cli import SHORT_NAMES, build_parser

    words = set(build_parser().format_help().split())
    assert all(any(short in w for w in words) for short in SHORT_NAMES)
