# `make demo` and `make test` create (or reuse) a virtual environment in .venv, install the project into it,
# and run. TORCH pins the PyTorch build: the CPU wheel by default; on a GPU machine use e.g.
# `make test TORCH=torch` to keep or fetch a CUDA build.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
# make test's pytest-xdist workers (a file's tests on one worker, the longest files first: tests/conftest.py); JOBS=0
# runs the suite in one process, auto one worker per core. The 25 slowest tests' times close the report.
JOBS ?= 2
PYTEST := -m pytest -q -n $(JOBS) --dist loadfile --no-loadscope-reorder --durations=25
# The learning test runs the whole demo (~13 minutes on 2 cores): make check runs it, make test leaves it out.
LEARNING := tests/test_learning.py

.PHONY: install demo ablation frontier verdict lint test check test-torch golden clean

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

frontier: install  # the reward-KL frontier: DPO and GRPO grids, 2 seeds, best-of-n, from make demo's SFT policy and reward model
	$(PY) demo.py --out runs/demo --frontier_seeds 2 --reuse

verdict: install  # the method's contrasts paired over 400 held-out posts, 6 seeds each (~80 min on 2 cores), and best-of-n, from make demo's SFT policy and reward model: configs/verdict/embedded.toml
	$(PY) demo.py --verdict configs/verdict/embedded.toml --out runs/demo --reuse

lint: install  # ruff's rules and formatting (pyproject.toml [tool.ruff]): `ruff format .` fixes the formatting
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

test: install  # after every change: every test but the learning test
	$(PY) $(PYTEST) --ignore=$(LEARNING)

check: lint test  # before a merge (what .ci/run runs): lint, make test, then the learning test alone on both cores
	$(PY) -m pytest -q $(LEARNING)

# The suite (without the demo's learning test) under another PyTorch, in a venv of its own: .venv-<version>.
# e.g. `make test-torch TORCH=torch==2.11.0`. Other torch releases than the pinned CPU wheel are CUDA builds from
# PyPI (~4.6 GB each); they run on the CPU here.
test-torch:
	test -x $(VENV)-$(subst torch==,,$(TORCH))/bin/python || $(PYTHON) -m venv $(VENV)-$(subst torch==,,$(TORCH))
	$(VENV)-$(subst torch==,,$(TORCH))/bin/python -m pip install -q --upgrade pip
	$(VENV)-$(subst torch==,,$(TORCH))/bin/python -m pip install -q "$(TORCH)"
	$(VENV)-$(subst torch==,,$(TORCH))/bin/python -m pip install -q -e ".[dev]"
	$(VENV)-$(subst torch==,,$(TORCH))/bin/python $(PYTEST) --ignore=$(LEARNING)

golden: install  # rewrite tests/golden/*.json: only for a change meant to move numbers (say which, and why)
	$(PY) -m tests.golden.stages

clean:
	rm -rf runs/demo
