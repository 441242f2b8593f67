# `make demo` and `make test` create (or reuse) a virtual environment in .venv, install the project into it,
# and run. TORCH pins the PyTorch build: the CPU wheel by default; on a GPU machine use e.g.
# `make test TORCH=torch` to keep or fetch a CUDA build.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install demo ablation test golden clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) demo.py

ablation: install  # GRPO's selection and global normalization, 3 seeds each, from one SFT policy and reward model
	$(PY) demo.py --out runs/ablation --ablation_seeds 3 --reuse

test: install
	$(PY) -m pytest -q

golden: install  # rewrite tests/golden/*.json: only for a change meant to move numbers (say which, and why)
	$(PY) -m tests.golden.stages

clean:
	rm -rf runs/demo
