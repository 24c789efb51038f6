"""The rewriter-answer and jobs-file fuzzers (bench/fuzz_rewriter.py, bench/fuzz_jobs.py) run end to end at a
few cases and find nothing: the quick version of the bench runs recorded in docs/benchmarks.md."""

from __future__ import annotations

from bench import fuzz_jobs, fuzz_rewriter


def test_the_jobs_fuzzer_finds_nothing_in_a_few_cases(capsys):
    summary = fuzz_jobs.main(["--cases", "40", "--seed", "3"])
    assert summary["read"] + summary["refused"] == 40 and summary["read"] > 0
    assert (summary["crash"], summary["hang"], summary["silent"]) == (0, 0, 0), summary["bad"]


def test_the_rewriter_fuzzer_finds_nothing_in_a_few_cases(capsys):
    summary = fuzz_rewriter.main(["--cases", "16", "--seed", "5", "--timeout", "0.5"])
    assert summary["caption"] + summary["refused"] == 16
    assert (summary["crash"], summary["hang"], summary["silent"]) == (0, 0, 0), summary["bad"]
