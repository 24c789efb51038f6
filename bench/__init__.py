"""Benchmark scripts (run as `python bench/NAME.py`); each compares against a baseline in one process."""
