"""bench/fewstep.py runs at its smallest setting and counts what each recipe costs."""

from __future__ import annotations

import json

import torch

from bench import fewstep


def test_fewstep_quick_counts_dit_calls_and_text_passes(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        result = fewstep.main(["--quick", "--json", str(tmp_path / "fewstep.json")])
    finally:
        torch.set_num_threads(threads)
    assert "8-step DMD" in capsys.readouterr().out
    rows = {r["recipe"]: r for r in json.loads((tmp_path / "fewstep.json").read_text())["rows"]}
    assert {k: (r["dit_calls"], r["text_passes"]) for k, r in rows.items()} == {
        "40-step CFG": (80, 2), "8-step DMD": (8, 1), "4-step CFG-free": (4, 1)}
    assert rows["8-step DMD"]["dit_calls_ratio"] == 0.1 and result["rows"][0]["generate_speedup"] == 1.0
