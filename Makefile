# Quick start: `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv and install what they need by themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build on these machines; GPU users: see README ("Installing on a GPU machine").
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo train test test-all bench bench-inference clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# The main job: standard vs Block vs Full AttnRes on big.txt, report in runs/compare/report.md.
demo: $(VENV)/.installed
	$(PY) -m attnres compare --preset demo --out runs/compare

# A small CPU training run on the default corpus (see configs/train-cpu.yaml).
train: $(VENV)/.installed
	$(PY) -m attnres train --config configs/train-cpu.yaml

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Everything, the slow suites included.
test-all: $(VENV)/.installed
	$(PY) -m pytest -q -m "slow or not slow" $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_training_overhead.py

# Prefill / decode latency and prefill memory of AttnRes vs standard (docs/inference.md).
bench-inference: $(VENV)/.installed
	$(PY) benchmarks/bench_inference.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
