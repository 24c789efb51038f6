"""The console commands: `lingbot-run` (workflows) and `python -m lingbot_core` (one generation)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lingbot_core.video import read_video
from lingbot_nodes.cli import main


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
    assert out == [str(tmp_path / "still_00001.png")]
    from PIL import Image

    assert Image.open(out[0]).size == (48, 64)


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["--set", "Denoise.width=40"], 2, "not a multiple of 16"),
        (["--set", "Denoise.nope=1"], 2, "nope"),
        (["--set", "garbage"], 2, "NODE.INPUT=VALUE"),
        (["no-such-workflow"], 2, "not found"),
        (["--model", "/no/such/folder"], 1, "does not exist"),
    ],
)
def test_failures_exit_non_zero_with_one_line(tmp_path, capsys, args, code, message):
    assert main([*args, "--output", str(tmp_path)]) == code
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err and err.startswith("error:")


def test_malformed_workflow_json(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"1": {"class_type": "LingBotLoader", "inputs": {')
    assert main([str(bad), "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and "line 1" in err


def test_python_dash_m_entry_points(tmp_path):
    env_run = subprocess.run([sys.executable, "-m", "lingbot_nodes", "--help"], capture_output=True, text=True)
    assert env_run.returncode == 0 and "NODE.INPUT=VALUE" in env_run.stdout
    core = subprocess.run([sys.executable, "-m", "lingbot_core", "--output", str(tmp_path / "clip"), "--steps", "2"],
                          capture_output=True, text=True)
    assert core.returncode == 0, core.stderr
    assert core.stdout.strip().endswith("clip.mp4")
    bad = subprocess.run([sys.executable, "-m", "lingbot_core", "--height", "40"], capture_output=True, text=True)
    assert bad.returncode == 2 and "multiples of 16" in bad.stderr
