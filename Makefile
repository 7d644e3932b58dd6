# Two commands on a fresh machine: `make train` (set up, train the default config, print a sample)
# and `make test` (set up, run the tests). Both create or update .venv from constraints.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tiny.py
WORKDIR ?= runs/tiny
PYTEST_ARGS ?= -m "not slow"
# The default suite runs on two workers, a test file each (its module fixtures once): most of its time is
# single-threaded XLA compilation. The slow runs (multi-process, timed) run alone: XDIST= .
XDIST ?= -n 2 --dist loadfile
# the slowest tests of each run, printed after it: where to look before the suite outgrows its budget
DURATIONS ?= --durations=15

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $@

# Compiling for TPU and GPU targets without them (tests/targets): libtpu and the CUDA plugin, in their
# own environment so that the main one stays CPU-only (libtpu reports its search for TPU hardware when
# jax starts without JAX_PLATFORMS=cpu).
TARGETS_VENV := .venv-targets
$(TARGETS_VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(TARGETS_VENV)
	$(TARGETS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TARGETS_VENV)/bin/python -m pip install --quiet -c constraints.txt -e ".[tpu,cuda]" pytest pytest-xdist
	touch $@

.PHONY: setup train test test-all test-long test-targets test-eval bench
setup: $(VENV)/.installed

train: setup
	$(PY) -m jaxtrain train --config=$(CONFIG) --workdir=$(WORKDIR)

test: setup
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS) $(DURATIONS)

test-all: setup
	$(PY) -m pytest -q -m ""

# The `long` runs (over 5 minutes each on 2 cores: long_16k's 20 steps, the comm-quality schemes, the
# post-training chain, moe_tiny to its entropy floor; and the quick runs of 1-3.5 minutes: the VLM's
# and MLM's convergence, ten runs in one process, the RL and post-training studies, scaling, LoRA's RL),
# which CI leaves out to stay near an hour; run them when their code changes.
test-long: setup
	$(PY) -m pytest -q $(XDIST) -m long

# The `long` compiles (the MoE configs, llama_8b, llama_1b on TPU, llama_70b offloaded, optimizer
# offload, ...: 1-9 minutes each on 2 cores) stay out of CI; `make test-targets TARGETS_MARK=` runs every one.
TARGETS_MARK ?= not long
test-targets: $(TARGETS_VENV)/.installed
	JAX_PLATFORMS=cpu $(TARGETS_VENV)/bin/python -m pytest -q -n 2 --dist load tests/targets \
	  -m "$(TARGETS_MARK)" $(PYTEST_TARGETS)

# lm-evaluation-harness beside jaxtrain (tests/eval/test_adapter.py: the adapter and jaxtrain's scoring against
# lm-eval's Hugging Face backend), in its own environment, so that lm-eval's many dependencies (unpinned beyond
# constraints.txt) stay out of the one `make test` uses.
EVAL_VENV := .venv-eval
$(EVAL_VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(EVAL_VENV)/bin/python -m pip install --quiet -c constraints.txt -e ".[test,eval]"
	touch $@

test-eval: $(EVAL_VENV)/.installed
	$(EVAL_VENV)/bin/python -m pytest -q tests/eval/test_adapter.py -m "" $(PYTEST_EVAL)

bench: setup
	$(PY) benchmarks/train_step.py
