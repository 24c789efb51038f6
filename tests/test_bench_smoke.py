"""The benchmark scripts run end to end at their smallest settings and report what they must.

Why: the scripts are run by hand (and once on a GPU machine with little time), so a broken one
must show up here. Timing values are never asserted; rows, equality columns and verdict logic are.
"""

from __future__ import annotations

import json

import pytest
import torch

from bench import dit_forward, generate, multinode, offload_gpu, parallel_failure
from lingbot_core.placement.modes import MODE_ORDER

MODES = list(MODE_ORDER)  # every registered offload mode: the benches run them all
# One thread: these runs are tiny, and on a busy 2-core machine two OpenMP threads stall for
# tenths of a second at a time. The scripts set torch's global thread count, so put it back after.
THREADS = ["--threads", "1"]


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One folder for the tiny checkpoint, shared by the generate and offload scripts (built once)."""
    return tmp_path_factory.mktemp("bench")


@pytest.mark.parametrize("script", [dit_forward, generate, offload_gpu, multinode, parallel_failure])
def test_help(script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_dit_forward_quick(tmp_path, capsys):
    out = tmp_path / "dit.json"
    result = dit_forward.main(["--quick", *THREADS, "--json", str(out)])
    printed = capsys.readouterr().out
    assert "ours (broadcast)" in printed and "baseline (per-token)" in printed and "PASS" in printed
    saved = json.loads(out.read_text())
    assert [r["variant"] for r in saved["rows"]] == ["ours (broadcast)", "baseline (per-token)"]
    assert saved["equal_within_tolerance"] and saved["max_abs_diff"] <= 1e-5
    ours, base = result["rows"]
    assert base["time_ratio_vs_baseline"] == 1.0 and base["max_abs_diff_vs_baseline"] == 0.0
    assert ours["peak_bytes"] > 0 and base["peak_bytes"] > 0
    # The per-token modulation tensors are bigger than a per-sample one by the token count.
    tokens = result["config"]["video_tokens"] + result["config"]["text_tokens"]
    assert base["temb_bytes"] == tokens * ours["temb_bytes"]
    real = {r["size"]: r for r in saved["real_sizes"]}
    assert 2.3e9 < real["dense 480x832x121"]["per_token_temb6"] < 2.5e9
    assert 12.3e9 < real["refiner 1088x1920x121"]["per_token_temb6"] < 12.6e9


def test_dit_forward_moe_matches_baseline():
    result = dit_forward.main(["--quick", "--moe", *THREADS])
    assert result["config"]["num_experts"] == 8 and result["equal_within_tolerance"]


def test_generate_quick(tmp_path, workdir, capsys):
    out = tmp_path / "generate.json"
    result = generate.main(["--quick", *THREADS, "--workdir", str(workdir), "--json", str(out)])
    printed = capsys.readouterr().out
    for mode in MODES:
        assert f"\n{mode} " in printed
    (cfg,) = json.loads(out.read_text())["configs"]
    assert cfg["config"] == "tiny" and [r["mode"] for r in cfg["rows"]] == MODES
    for row in cfg["rows"]:
        assert row["max_abs_diff_vs_none"] == 0.0, row["mode"]
        assert row["max_abs_diff_stages_vs_generate"] == 0.0, row["mode"]
        assert row["generate_s"] > 0
    assert result["configs"][0]["frames_shape"] == [5, 32, 32, 3]


def test_generate_mid_checkpoint_is_loadable(workdir):
    from lingbot_core.checkpoints.inspection import inspect_checkpoint
    from lingbot_core.tiny import build_tiny_checkpoint, is_tiny_checkpoint

    tiny = build_tiny_checkpoint(workdir / "tiny-dense", "dense", seed=0)
    mid = generate.build_mid_checkpoint(tiny, workdir / "mid-check", hidden=64, depth=2, heads=2, seed=0)
    info = inspect_checkpoint(mid)
    assert info.transformer_config["hidden_size"] == 64 and info.transformer_config["depth"] == 2
    assert sum(info.transformer_config["axes_dims"]) == 32
    assert not is_tiny_checkpoint(mid) and is_tiny_checkpoint(tiny)


def test_offload_gpu_tiny(tmp_path, workdir, capsys):
    out = tmp_path / "offload.json"
    offload_gpu.main(["--tiny", *THREADS, "--steps", "1", "--frames", "5", "--warmup-steps", "0", "--workdir", str(workdir),
                      "--extra-sizes", "32x48x5", "--extra-steps", "1", "--out-json", str(out)])
    printed = capsys.readouterr().out
    for mode in MODES:
        assert f"\n{mode} " in printed
    saved = json.loads(out.read_text())
    assert saved["device"] == "cpu" and [r["mode"] for r in saved["rows"]] == MODES
    assert "estimated vs measured peak" in printed
    assert [(r["size"], r["mode"]) for r in saved["extra_sizes"]] == [([32, 48, 5], m) for m in MODES]
    assert all(r["estimate_bytes"] > 0 for r in saved["rows"] + saved["extra_sizes"])
    assert saved["components"]["text_encoder"]["buffer_max_diff"] == 0.0
    for row in saved["rows"]:
        assert "error" not in row, row
        assert row["max_abs_diff"] == 0.0 and row["frames_finite"], row["mode"]
        checks = {c["check"]: c["result"] for c in row["checks"]}
        assert checks["pixels == none"] == "PASS"
        assert all(v is None for k, v in checks.items() if k != "pixels == none")  # no timing verdicts on CPU


def test_offload_gpu_tiny_quantized_dit_rows(tmp_path, workdir, capsys):
    """A GGUF Q4_0 DiT swapped into the same handle: its rows run, offload keeps its frames exact, and the
    frames differ from bf16's (so the quantized DiT really ran); the disk row holds nothing in memory."""
    out = tmp_path / "offload.json"
    offload_gpu.main(["--tiny", *THREADS, "--steps", "1", "--frames", "5", "--warmup-steps", "0", "--workdir",
                      str(workdir), "--modes", "none,group", "--extra-sizes", "", "--dit-weights", "bf16,gguf-q4_0",
                      "--out-json", str(out)])
    assert "DiT weight formats" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["complete"] and saved["dit_weights"] == ["bf16", "gguf-q4_0"]
    rows = saved["weight_rows"]
    assert [(r["mode"], r["weights"], r["offload_to"]) for r in rows] == [
        ("none", "gguf-q4_0", "ram"), ("group", "gguf-q4_0", "ram"), ("group", "gguf-q4_0", "disk")]
    for row in rows:
        assert "error" not in row, row
        assert row["weights_format"].startswith("gguf: Q4_0"), row["weights_format"]
        assert row["max_abs_diff"] == 0.0 and row["frames_finite"]
        assert row["max_abs_diff_vs_bf16"] > 0.0
        assert row["time_vs_bf16"] > 0 and row["peak_vs_bf16"] is None  # no accelerator peaks on CPU
        assert [c["result"] for c in row["checks"]] == ["PASS"]
    assert rows[2]["dit_held_bytes"] == 0 < rows[0]["dit_held_bytes"] < saved["components"]["transformer"]["bytes"]
    assert [r["mode"] for r in saved["rows"]] == ["none", "group"]  # the bf16 rows are unchanged


def test_offload_gpu_rejects_unknown_dit_weights(capsys):
    with pytest.raises(SystemExit) as exit_info:
        offload_gpu.main(["--tiny", "--dit-weights", "bf16,int4"])
    assert exit_info.value.code == 2 and "int4" in capsys.readouterr().err


def test_offload_gpu_dry_run_builds_full_sizes_on_meta(capsys):
    result = offload_gpu.main(["--dry-run"])
    info = result["components"]
    assert info["transformer"]["params"] == 1_357_171_264  # reference-model.md §4: 1,309,169,664 + 48,001,600
    assert 4.3e9 < info["text_encoder"]["params"] < 4.6e9  # Qwen3-VL-4B
    assert 126e6 < info["vae"]["params"] < 128e6  # Wan 2.1 VAE
    assert info["dtypes"]["transformer"] == "bfloat16" and info["dtypes"]["vae"] == "float32"
    assert result["estimate"]["dit_forwards"] == 80
    assert "sequential will stream" in capsys.readouterr().out


def _row(mode, time_s, peak_gb, diff=0.0):
    return {"mode": mode, "time_s": time_s, "peak_bytes": peak_gb * 1e9, "max_abs_diff": diff}


def _results(rows):
    return {mode: {c: ok for c, ok in row["checks"]} for mode, row in rows.items()}


def test_offload_gpu_verdicts():
    rows = {"none": _row("none", 10.0, 12.0), "model": _row("model", 12.0, 8.0),
            "sequential": _row("sequential", 17.0, 1.4), "group": _row("group", 11.0, 2.0)}
    offload_gpu.verdicts(rows, on_gpu=True)
    got = _results(rows)
    assert got["model"] == {"pixels == none": True, "time <= x1.204": True, "peak <= x0.692": True}
    assert got["sequential"] == {"pixels == none": True, "time <= x1.699": False, "peak <= x0.124": True}
    assert got["group"] == {"pixels == none": True, "peak <= 1.5x seq": True, "time <= 1.15x none": True}

    rows = {"none": _row("none", 10.0, 12.0), "sequential": _row("sequential", 16.0, 1.0, diff=1e-3),
            "group": _row("group", 11.6, 1.6)}
    offload_gpu.verdicts(rows, on_gpu=True)
    got = _results(rows)
    assert got["sequential"]["pixels == none"] is False
    assert got["group"] == {"pixels == none": True, "peak <= 1.5x seq": False, "time <= 1.15x none": False}

    rows = {"none": _row("none", 10.0, 12.0), "group": {"mode": "group", "error": "RuntimeError: boom"}}
    offload_gpu.verdicts(rows, on_gpu=True)
    assert _results(rows)["group"] == {"ran": False}


def test_lora_bench_quick(tmp_path, capsys):
    """bench/lora.py at tiny shapes: the LightLingBot-shaped file resolves fully, merge and removal are exact."""
    from bench import lora as lora_bench

    result = lora_bench.main(["--quick", *THREADS, "--repeats", "2", "--data", str(tmp_path), "--json",
                              str(tmp_path / "lora.json")])
    printed = capsys.readouterr().out
    assert "extrapolated" in printed and "runtime deltas" in printed
    saved = json.loads((tmp_path / "lora.json").read_text())
    per_block = len(lora_bench.TARGETS)
    assert saved["file"]["modules"] == saved["depth"] * per_block and saved["file"]["unmatched"] == 0
    assert saved["file"]["keys"] == 2 * saved["depth"] * per_block  # down + up, no alpha
    assert saved["file"]["match_warm_seconds"] > 0
    bf16, fp8 = result["bf16"], result["fp8"]
    assert bf16["modules"] == result["blocks"] * per_block and bf16["unmatched"] == 0
    # Merged: pristine copies of exactly the targeted bf16 weights; fp8: runtime deltas, no copies.
    assert bf16["pristine_bytes"] == saved["file"]["pristine_bytes_computed"] * result["blocks"] // result["depth"]
    assert bf16["runtime_deltas"] == 0 and fp8["runtime_deltas"] == result["blocks"] * per_block
    assert fp8["pristine_bytes"] == 0
    for row in (bf16, fp8):
        assert row["plain_bit_exact_after_removal"] and row["lora_repeatable"] and row["lora_effect_rel_l2"] > 0
        assert len(row["apply_s"]) == len(row["lora_s"]) == 2
    assert 0 < fp8["rel_l2_vs_bf16_merged"] < 0.2


def test_weights_full_moe_writes_random_gguf_and_streams_it_from_disk(tmp_path, capsys):
    from bench import weights

    assert weights.main(["--quick", "--full-moe", "--modes", "group", "--data", str(tmp_path),
                         "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "full MoE (48 blocks, GGUF-Q4_0" in out
    row = json.loads((tmp_path / "out.json").read_text())["full_moe"]["rows"]["group"]
    assert row["weight_reads"] == 0 and row["finite"]  # loaded without reading a tensor; a finite output
    assert row["format"].startswith("gguf: Q4_0")


def test_quant_error_on_the_tiny_model(fixtures_root, tmp_path, capsys):
    from bench import quant_error

    out = tmp_path / "q.json"
    assert quant_error.main(["--data", str(fixtures_root / "models" / "tiny-dense"), "--formats", "noise1,q8_0,q4_0",
                             "--video-tokens", "16", "--text-tokens", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())["formats"]
    assert report["q8_0"]["weight_rel_l2"] < report["q4_0"]["weight_rel_l2"]
    assert abs(report["noise1"]["weight_rel_l2"] - 0.01) < 0.002  # 1 % of each layer's RMS
    assert len(report["q4_0"]["block_rel_l2_by_depth"]) == 2  # tiny-dense has 2 blocks
    assert "| q4_0 |" in capsys.readouterr().out


def test_parallel_failure_two_processes_and_its_verdicts(tmp_path, capsys):
    """Two forked gloo ranks, rank 1 raising inside a forward: both stop and name it (the script's exit
    code 0); the verdicts flag a rank that never reported or names another rank."""
    out = tmp_path / "f.json"
    assert parallel_failure.main(["--processes", "2", "--cfg", "1", "--steps", "2", "--start-method", "fork",
                                  "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["error"] for r in result["rows"]] == ["GroupBroken", "GroupBroken"] and result["verdicts"] == []
    rows = [{"rank": 0, "exit_code": -9, "stopped_after_s": None, "error": None, "message": None},
            {"rank": 1, "exit_code": 0, "stopped_after_s": 0.1, "error": "GroupBroken", "message": "rank 0 (cpu) failed"}]
    bad = parallel_failure.verdicts({"failing_rank": 1, "rows": rows}, 60)
    assert len(bad) == 2 and "did not report" in bad[0] and "not GroupBroken naming rank 1" in bad[1]


def test_video_read_bench_quick():
    """bench/video_read.py at its smallest: both sides read the whole clip and a ratio comes out."""
    from bench import video_read

    result = video_read.main(["--quick"])
    assert result["frames"] == 9 and set(result["seconds"]) == set(video_read.SIDES)
    assert all(0 < t < 60 for t in result["seconds"].values()) and result["ratio_one_thread_over_default"] > 0
