"""Benchmarks: python -m bench.run_all (see bench/run_all.py)."""
