"""`python -m lingbot_core.quantize`: symlinked folders, bad arguments, no partial DST, progress, Ctrl-C."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from lingbot_core import quantize
from lingbot_core.checkpoints.inspection import inspect_checkpoint


@pytest.fixture
def src(fixtures_root, tmp_path) -> Path:
    """A private copy of the tiny dense checkpoint whose VAE folder is a link to a shared folder."""
    folder = tmp_path / "src"
    shutil.copytree(fixtures_root / "models" / "tiny-dense", folder)
    shared = tmp_path / "shared"
    shared.mkdir()
    (folder / "vae").rename(shared / "vae")
    (folder / "vae").symlink_to(shared / "vae", target_is_directory=True)
    return folder


def _run(capsys, *args: str) -> tuple[int, str]:
    code = quantize.main([str(a) for a in args])
    return code, capsys.readouterr().err


def test_a_symlinked_component_folder_is_followed(src, tmp_path, capsys):
    code, _err = _run(capsys, src, tmp_path / "out", "--to", "gguf-q8_0", "--quiet")
    assert code == 0
    out = tmp_path / "out"
    assert (out / "vae" / "config.json").is_file() and not (out / "vae").is_symlink()
    assert inspect_checkpoint(out).sources["vae"].files  # the result opens


@pytest.mark.parametrize("case", ["dst-inside-src", "dst-is-file", "dst-under-file", "gguf-file-src",
                                  "gguf-folder-src", "per-expert-fp8", "dst-not-empty"])
def test_every_bad_argument_is_one_line_before_any_work(src, tmp_path, capsys, case):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    args = {"dst-inside-src": [src, src / "q8"], "dst-is-file": [src, tmp_path / "a-file"],
            "dst-under-file": [src, tmp_path / "a-file" / "q8"], "dst-not-empty": [src, tmp_path / "full"],
            "per-expert-fp8": [src, tmp_path / "q", "--per-expert"]}.get(case)
    if case.startswith("gguf"):
        quantize.quantize_checkpoint(src, tmp_path / "g", "gguf-q8_0")
        args = [tmp_path / "g" / "transformer" / "diffusion_pytorch_model.gguf" if case == "gguf-file-src"
                else tmp_path / "g", tmp_path / "q"]
    code, err = _run(capsys, *args, "--to", "fp8")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert "utf" not in err.lower() and not (src / "q8").exists() and not (tmp_path / "q").exists()


def test_a_failed_run_leaves_nothing_and_the_rerun_works(src, tmp_path, capsys, monkeypatch):
    real = quantize.write_gguf

    def fails(source, path, *a, progress=None, **k):
        progress("x", 1)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(quantize, "write_gguf", fails)
    code, err = _run(capsys, src, tmp_path / "out", "--to", "gguf-q4_0", "--quiet")
    assert code == 1 and "No space left" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared", "src"]  # no DST, no temporary folder
    monkeypatch.setattr(quantize, "write_gguf", real)
    assert _run(capsys, src, tmp_path / "out", "--to", "gguf-q4_0", "--quiet")[0] == 0
    assert inspect_checkpoint(tmp_path / "out").sources["transformer"].format.name == "gguf"


def test_ctrl_c_is_one_line_exit_130_and_leaves_nothing(src, tmp_path, capsys, monkeypatch):
    real = quantize.write_fp8

    def interrupted(source, path, progress=None):
        def stop(name, nbytes):
            progress(name, nbytes)
            raise KeyboardInterrupt

        real(source, path, progress=stop)

    monkeypatch.setattr(quantize, "write_fp8", interrupted)
    code, err = _run(capsys, src, tmp_path / "out", "--to", "fp8")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 130 and "Traceback" not in err
    assert lines[-1].startswith("quantize: interrupted") and "not written" in lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared", "src"]


def test_progress_with_eta_on_stderr_and_quiet(src, tmp_path, capsys):
    code, err = _run(capsys, src, tmp_path / "out", "--to", "fp8")
    assert code == 0
    progress = [line for line in err.splitlines() if line.startswith("quantize: transformer:")]
    assert progress and "ETA" in progress[-1] and "(100%)" in progress[-1]
    code, err = _run(capsys, src, tmp_path / "quiet", "--to", "fp8", "--quiet")
    assert code == 0 and "ETA" not in err


def test_progress_counts_every_tensor_on_a_terminal():
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    progress = quantize.Progress(300, stream=stream)
    for i in range(3):
        progress("transformer", f"t{i}", 100)
    progress.finish()
    shown = stream.getvalue().split("\r")[1:]
    assert len(shown) == 3 and "1 tensors" in shown[0] and "(100%)" in shown[-1] and "ETA" in shown[-1]


def test_unchanged_files_are_hard_links_and_the_command_says_so(src, tmp_path, capsys, monkeypatch):
    code, err = _run(capsys, src, tmp_path / "out", "--to", "fp8", "--quiet")
    linked = tmp_path / "out" / "scheduler" / "scheduler_config.json"
    assert code == 0 and linked.stat().st_ino == (src / "scheduler" / "scheduler_config.json").stat().st_ino
    assert "hard links" in err
    monkeypatch.setattr(os, "link", lambda *a, **k: (_ for _ in ()).throw(OSError(18, "cross-device link")))
    code, err = _run(capsys, src, tmp_path / "copied", "--to", "fp8", "--quiet")
    assert code == 0 and "hard links" not in err  # copies: nothing to warn about
