"""bench/speed.py runs end to end at tiny shapes and reports every section's rows.

Timing values are never asserted; row names, block counts and the comparison columns are.
"""

from __future__ import annotations

import json

import pytest
import torch

from bench import speed


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        speed.main(["--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit):
        speed.main(["--quick", "--only", "no-such-section"])
    assert "unknown sections" in capsys.readouterr().err


def test_baseline_quick(tmp_path):
    out = tmp_path / "speed.json"
    result = speed.main(["--quick", "--threads", "1", "--only", "baseline", "--json", str(out)])
    rows = json.loads(out.read_text())["sections"]["baseline"]["rows"]
    assert rows == result["sections"]["baseline"]["rows"]
    steps = result["config"]["steps"]
    # Two forwards per step (CFG) over the tiny DiT's 2 blocks.
    assert rows[0]["dit_blocks"] == 2 * steps * 2


def test_cache_and_cfg_sections_quick(tmp_path):
    result = speed.main(["--quick", "--threads", "1", "--only", "cache", "cfg", "--fb-thresholds", "0", "1e9",
                         "--mag-thresholds", "1e9"])
    cache = {r["run"]: r for r in result["sections"]["cache"]["rows"]}
    assert cache["off"]["blocks_ratio"] == 1.0 and cache["off"]["rel_l2"] == 0.0
    assert cache["first_block 0"]["dit_blocks"] == cache["off"]["dit_blocks"]  # never close enough: all run
    assert cache["first_block 0"]["rel_l2"] == 0.0
    assert cache["first_block 1e+09"]["blocks_ratio"] < 1.0 and cache["magcache 1e+09"]["blocks_ratio"] < 1.0
    assert cache["magcache_calibrate"]["rel_l2"] == 0.0
    cfg = {r["run"]: r for r in result["sections"]["cfg"]["rows"]}
    assert cfg["two forwards"]["max_abs_diff"] == 0.0
    assert cfg["batched"]["rel_l2"] < 1e-5
