"""The experiments: each a list of runs (experiments/embedded.py declares the embedded task's pipeline and grids)
that one runner runs in order (experiments/runner.py). Imports every package below the scripts."""
