"""The experiments: each a list of runs (experiments/embedded.py declares the embedded task's pipeline and grids;
experiments/verdict.py reads a verdict from its file) that one runner runs in order (experiments/runner.py). Imports
every package below the scripts."""
