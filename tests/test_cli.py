"""The console commands: `lingbot-run` (workflows) and `python -m lingbot_core` (one generation)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from background import Child, Task, selected
from video_reader import read_video

from lingbot_nodes.cli import main

SIGNALS = [("SIGINT", 130), ("SIGTERM", 143)]


def _default_sigint() -> None:
    """In the child: SIGINT back to its default. A suite started in the background by a shell without job
    control inherits SIGINT as ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_at_step_2(proc: subprocess.Popen, signame: str) -> tuple[list[str], str]:
    """Read the child's progress until Denoise's step 2, send `signame`, wait: (lines read, the rest)."""
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        if "Denoise: step 2/200" in line or not line:
            break
    proc.send_signal(getattr(signal, signame))
    _, rest = proc.communicate(timeout=60)
    return lines, rest


@pytest.fixture(scope="module", autouse=True)
def children(request, tmp_path_factory):
    """This module's commands in processes of their own, started together when the module starts (see
    tests/background.py): they import torch on the second core while the tests in this process run."""
    started = {}
    if selected(request, "test_python_dash_m_entry_points"):
        started["help"] = Child([sys.executable, "-m", "lingbot_nodes", "--help"])
        # `python -m lingbot_core` is wired to its main (a refused size: exit 2 before any model work)
        started["bad size"] = Child([sys.executable, "-m", "lingbot_core", "--height", "40"])
    if selected(request, "test_ctrl_c_in_a_real_process"):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        procs = {}
        for signame, _code in SIGNALS:  # every Popen first, on the main thread, before any thread (preexec_fn)
            output = tmp_path_factory.mktemp(f"ctrl_c_{signame}")
            procs[signame] = output, subprocess.Popen(
                [sys.executable, "-m", "lingbot_nodes", "--set", "Denoise.steps=200", "--output", str(output)],
                stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=_default_sigint)
        for signame, (output, proc) in procs.items():  # then the conversation with each child on a thread
            started[signame] = (proc, output, Task(lambda proc=proc, signame=signame: _signal_at_step_2(proc, signame)))
    if selected(request, "test_the_package_import_is_light"):
        started["light"] = Child([sys.executable, "-c", "import sys, lingbot_nodes; print('torch' in sys.modules)"])
    yield started
    for entry in started.values():  # a child no test waited for (not in this run) is killed
        if isinstance(entry, Child):
            entry.stop()
            continue
        proc, _output, conversation = entry
        if proc.poll() is None:
            proc.kill()
        try:
            conversation.result(timeout=60)  # its thread ends with the child
        except Exception:
            pass


def test_default_run_writes_an_mp4(tmp_path, capsys):
    assert main(["--output", str(tmp_path)]) == 0
    written = capsys.readouterr().out.split()
    assert len(written) == 1 and written[0].endswith(".mp4")
    frames, fps = read_video(written[0])
    assert frames.shape == (9, 64, 64, 3) and fps == pytest.approx(24)


def test_overrides_model_and_shuffle(tmp_path, capsys, fixtures_root):
    code = main(["t2i", "--output", str(tmp_path), "--model", str(fixtures_root / "models" / "tiny-dense"),
                 "--set", "Denoise.width=48", "--set", "Save.filename_prefix=still", "--shuffle", "3"])
    assert code == 0
    out = capsys.readouterr().out.split()
    assert out == [str(tmp_path / "still_00001_.png")]  # ComfyUI's <prefix>_<counter>_ naming
    from PIL import Image

    assert Image.open(out[0]).size == (48, 64)


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["--set", "Denoise.width=40"], 2, "input 'width': value 40 is not a multiple of 16; try 32 or 48"),
        (["--set", "Denoise.nope=1"], 2, "nope"),
        (["--set", "garbage"], 2, "NODE.INPUT=VALUE"),
        (["no-such-workflow"], 2, "not found"),
        (["--model", "/no/such/folder"], 2, "does not exist"),
        (["--set", "Nope.seed=1"], 2, "4 (LingBotDenoise 'Denoise')"),
    ],
)
def test_failures_exit_non_zero_with_one_line(tmp_path, capsys, args, code, message):
    assert main([*args, "--output", str(tmp_path)]) == code
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err and err.startswith("error:")


@pytest.mark.parametrize("text,where", [('{"1": {"class_type": "LingBotLoader", "inputs": {', "line 1 column 50"),
                                        ('{"1": {"class_type": "LingBot', "Unterminated string starting at: line 1 column 22")])
def test_malformed_workflow_json(tmp_path, capsys, text, where):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert main([str(bad), "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "bad.json" in err and where in err and err.endswith(")")


def test_python_dash_m_entry_points(children):
    env_run = children["help"].result()
    assert env_run.returncode == 0 and "NODE.INPUT=VALUE" in env_run.stdout
    # `python -m lingbot_core` is wired to its main (a refused size: exit 2 before any model work) ...
    bad = children["bad size"].result()
    assert bad.returncode == 2 and "multiples of 16" in bad.stderr


def test_core_command_numbers_outputs_and_shows_progress(tmp_path, capsys):
    """... and that main writes a numbered file as lingbot-run does, with progress on stderr (in process: a
    second interpreter would only repeat the imports)."""
    from lingbot_core.__main__ import main as core_main

    assert core_main(["--output", str(tmp_path / "clip"), "--steps", "2", "--prefix", "runs/boat"]) == 0
    run = capsys.readouterr()
    assert run.out.strip() == str(tmp_path / "clip" / "runs" / "boat_00001_.mp4")  # numbered as lingbot-run
    assert "step 2/2" in run.err and "loaded transformer: fp32 weights" in run.err  # progress


def _stderr_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_progress_is_labelled_by_node_title(tmp_path, capsys):
    """Every stage that runs gets a line with its title, text encode and VAE decode included."""
    assert main(["t2i", "--output", str(tmp_path)]) == 0
    err = "\n".join(_stderr_lines(capsys))
    for title in ("Loader", "Offload", "Prompt", "Denoise", "Decode", "Save"):
        assert f"  {title}: done in " in err, title
    assert "Denoise: step 1/4" in err and "4/4 steps" in err
    assert "node " not in err


def test_memory_report_text_and_auto_choice_are_printed(tmp_path, capsys):
    import json

    workflow = tmp_path / "report.json"
    workflow.write_text(json.dumps({
        "1": {"class_type": "LingBotLoader", "inputs": {"checkpoint": "tiny (built-in dense)", "variant": "auto",
                                                        "dtype": "auto", "attention": "default"}},
        "2": {"class_type": "LingBotOffload", "inputs": {"pipe": ["1", 0], "mode": "auto"},
              "_meta": {"title": "Plan memory"}},
        "3": {"class_type": "LingBotMemoryReport", "inputs": {"pipe": ["2", 0], "value": ["2", 0]},
              "_meta": {"title": "Where is it"}},
    }))
    assert main([str(workflow), "--quiet", "--output", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "Where is it:" in err and "LingBot memory (none offload" in err  # --quiet keeps what the graph asked for
    assert "done in" not in err and "auto offload" not in err
    assert main([str(workflow), "--output", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "auto offload: the execution device is the CPU" in err and "Plan memory: done" in err


def test_set_error_example_is_valid_for_the_default_workflow():
    from lingbot_core.workflow import WorkflowError, apply_overrides, find_node, load_workflow, parse_override
    from lingbot_nodes import NODE_CLASS_MAPPINGS
    from lingbot_nodes.cli import resolve_workflow

    with pytest.raises(WorkflowError) as err:
        apply_overrides(load_workflow(resolve_workflow("t2v"), NODE_CLASS_MAPPINGS), ["garbage"], NODE_CLASS_MAPPINGS)
    example = str(err.value).rsplit("e.g. ", 1)[1]
    ref, input_name, value, _ = parse_override(example)
    for name in ("t2v", "t2i", "ti2v"):  # the dense workflows; the MoE one titles it "Denoise (base)"
        prompt = load_workflow(resolve_workflow(name), NODE_CLASS_MAPPINGS)
        changed = apply_overrides(prompt, [example], NODE_CLASS_MAPPINGS)
        assert changed.nodes[find_node(changed, ref)]["inputs"][input_name] == value, name


def test_bad_output_folder_fails_before_any_model_work(tmp_path, capsys, monkeypatch):
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    def must_not_run(*_a, **_k):
        raise AssertionError("the loader ran")

    monkeypatch.setattr(NODE_CLASS_MAPPINGS["LingBotLoader"], "execute", must_not_run)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["--output", str(blocker / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: --output") and "not a folder" in err


@pytest.fixture
def broken_checkpoints(tmp_path, fixtures_root):
    import shutil

    good = fixtures_root / "models" / "tiny-dense"
    (tmp_path / "empty").mkdir()
    shutil.copytree(good, tmp_path / "truncated")
    weights = tmp_path / "truncated" / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    return {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "truncated": tmp_path / "truncated"}


@pytest.mark.parametrize("kind", ["missing", "empty", "truncated"])
def test_bad_checkpoint_is_bad_input_for_both_commands(tmp_path, capsys, broken_checkpoints, kind):
    from lingbot_core.__main__ import main as core_main

    folder = broken_checkpoints[kind]
    assert main(["t2i", "--model", str(folder), "--output", str(tmp_path / "out")]) == 2
    assert _stderr_lines(capsys)[-1].startswith("error: Loader (node 1, LingBotLoader): ")
    assert core_main(["--model", str(folder), "--mode", "t2i", "--output", str(tmp_path / "core")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("core*"))


@pytest.mark.parametrize("flag", ["--steps", "--frames", "--width", "--height", "--fps", "--shift"])
@pytest.mark.parametrize("value", ["0", "-16"])
def test_core_command_rejects_zero_and_negative(capsys, flag, value):
    from lingbot_core.__main__ import main as core_main

    with pytest.raises(SystemExit) as done:
        core_main([flag, value])
    assert done.value.code == 2 and "must be above 0" in capsys.readouterr().err


def test_interrupt_inside_a_node_is_one_line_and_130(tmp_path, capsys, monkeypatch):
    from lingbot_nodes import NODE_CLASS_MAPPINGS

    def ctrl_c(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(NODE_CLASS_MAPPINGS["LingBotDecode"], "execute", ctrl_c)
    assert main(["t2i", "--set", "Denoise.steps=1", "--output", str(tmp_path)]) == 130
    assert _stderr_lines(capsys)[-1] == "interrupted in Decode"
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_interrupt_while_writing_leaves_no_partial_file(tmp_path, capsys, monkeypatch):
    import av

    real = av.VideoFrame.from_ndarray
    calls = []

    def second_frame_interrupts(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(av.VideoFrame, "from_ndarray", second_frame_interrupts)
    assert main(["--set", "Denoise.steps=1", "--output", str(tmp_path)]) == 130
    assert _stderr_lines(capsys)[-1] == "interrupted in Save"
    assert len(calls) == 3 and not any(p.is_file() for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("signame,code", SIGNALS)
def test_ctrl_c_in_a_real_process(children, signame, code):
    """SIGINT to `python -m lingbot_nodes` mid-run: exit 130, one line, no traceback, no file. SIGTERM (a
    container stop) takes the same path, with exit code 143. (The child starts with the module: `children`.)"""
    proc, output, conversation = children[signame]
    lines, rest = conversation.result(timeout=200)
    assert proc.returncode == code, "".join(lines) + rest
    assert rest.strip().splitlines()[-1] == "interrupted in Denoise", rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest
    assert not any(p.is_file() for p in output.rglob("*"))


def test_terminal_bar_is_labelled_and_closed():
    """On a terminal the reporter draws a bar per node (tqdm) and still prints each finished stage."""
    import io
    from types import SimpleNamespace

    from lingbot_nodes.cli import Reporter

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    reporter = Reporter({"3": "Prompt", "4": "Denoise"}, stream=out)
    reporter.node_started(SimpleNamespace(node_id="3"))
    reporter.node_started(SimpleNamespace(node_id="3"))  # a lazy node entered twice: one line
    reporter.node_started(SimpleNamespace(node_id="4"))
    for step in (1, 2, 3):
        reporter.progress("4", step, 3)
    reporter.write("  auto offload: something")
    reporter.finish()
    text = out.getvalue()
    assert text.count("Prompt: done in") == 1 and "Denoise: done in" in text and "3/3 steps" in text
    assert "auto offload: something" in text and reporter._bar is None


def test_core_command_options_quiet_and_numbering(tmp_path, capsys):
    """offload, offload_to, weights, tiling, sampler reach the run; --quiet prints only the files; a
    second run takes the next number."""
    from lingbot_core.__main__ import main as core_main

    argv = ["--output", str(tmp_path), "--steps", "2", "--frames", "5", "--offload", "model", "--offload-to", "disk",
            "--weights", "fp8_e4m3", "--tiling", "--sampler", "euler", "--cfg", "1", "--quiet"]
    assert core_main(argv) == 0
    first = capsys.readouterr()
    assert first.err == "" and first.out.strip().endswith("core_00001_.mp4")
    assert core_main(argv) == 0
    assert capsys.readouterr().out.strip().endswith("core_00002_.mp4")
    assert core_main(["--sampler", "nope", "--output", str(tmp_path)]) == 2
    assert "nope" in capsys.readouterr().err


def test_ctrl_c_while_lingbot_run_imports_is_clean(monkeypatch, capsys):
    """Ctrl-C before the run's own code is imported (torch takes seconds): one line, exit 130."""
    import importlib.abc

    import lingbot_launch

    class Interrupting(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "lingbot_nodes.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "lingbot_nodes.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    assert lingbot_launch.main() == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_ctrl_c_while_the_core_command_imports_is_clean(monkeypatch, capsys):
    import lingbot_core.__main__ as core

    def interrupted(_args):
        raise KeyboardInterrupt  # as if pressed while torch is being imported

    monkeypatch.setattr(core, "_generate", interrupted)
    assert core.main([]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_the_package_import_is_light(children):
    """`python -m lingbot_nodes` imports the package before its `__main__` can catch anything: that import
    must not pull in torch, or a Ctrl-C in the first seconds prints a traceback."""
    out = children["light"].result(timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_ctrl_c_while_python_m_lingbot_nodes_imports_is_clean(monkeypatch, capsys):
    import importlib.abc
    import runpy

    class Interrupting(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "lingbot_nodes.cli":
                raise KeyboardInterrupt  # as if pressed while torch is being imported
            return None

    monkeypatch.delitem(sys.modules, "lingbot_nodes.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_module("lingbot_nodes", run_name="__main__")
    assert stopped.value.code == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_a_shipped_workflow_resolves_by_short_name_api_name_old_path_and_title(tmp_path, monkeypatch):
    """The editor files are named by their template titles; the names users typed before (the API name,
    the old editor path `workflows/lingbot_t2v_dense.json`) still reach the same workflow."""
    from lingbot_core.workflow import load_workflow
    from lingbot_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    from lingbot_nodes.cli import resolve_workflow
    from workflows import build

    monkeypatch.chdir(tmp_path)  # no workflows/ here: the names resolve through the shipped folders
    api = build.api_path("lingbot_t2v_dense")
    for typed in ("t2v", "lingbot_t2v_dense", "workflows/lingbot_t2v_dense.json", "lingbot_t2v_dense.json"):
        assert resolve_workflow(typed).resolve() == api.resolve(), typed
    title = build.WORKFLOWS["lingbot_t2v_dense"]["title"]
    by_title = resolve_workflow(title)
    assert by_title.resolve() == build.ui_path("lingbot_t2v_dense").resolve()
    assert (load_workflow(by_title, NODE_CLASS_MAPPINGS, display_names=NODE_DISPLAY_NAME_MAPPINGS).to_dict()
            == load_workflow(api, NODE_CLASS_MAPPINGS).to_dict())
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_workflow("workflows/no_such_workflow.json")
