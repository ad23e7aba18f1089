# Two commands do all the set-up on a fresh machine: `make demo` and `make test`
# (`make test-fast`: the single-process tier alone, tests/unit and tests/planner, ~1 minute).
# On a CUDA machine, `make gpu-check` measures loom on its GPU in <= 6 minutes, with no install.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast gpu-check install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Keep a user's own torch (e.g. a CUDA build); otherwise take the CPU build 2.13.0.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m loom demo

# Random order (pytest-randomly), a new seed each run, printed first and last; a failing run
# prints `make test SEED=N`, which runs the same order again. No -x: one run reports every
# failure of its order (a random order is worth reading in full; tests/README.md).
# WORKERS pytest-xdist processes share the modules (--dist loadscope: a module's tests stay in
# one worker, so a module-scoped world is spawned once); the serial suite kept 2 cores only
# ~0.75 busy (spawned ranks wait on each other, drills wait on timeouts). WORKERS=0: one process.
WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p randomly $(if $(SEED),--randomly-seed=$(SEED)) \
		$(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --dist loadscope) tests

# The fast tier: the tests marked `fast` (tests/unit, tests/planner: in-process, no spawned
# ranks but the one torchrun run of `loom plan`'s printed command; markers set by folder in
# tests/conftest.py), in random order too: about 1 minute on 2 cores.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p randomly $(if $(SEED),--randomly-seed=$(SEED)) -m fast tests

# loom on one CUDA GPU (benchmarks/gpu_check.py, <= 6 minutes on an H100): the CUDA tests
# (pytest -m cuda tests/cuda), speed against a plain PyTorch loop, the planner against the GPU;
# results in benchmarks/results/gpu_check_<gpu>.json (and $OUT when set). No venv, no install:
# the python3 on PATH (the machine's own CUDA torch) on this working tree. Without CUDA it prints
# one line and exits 0.
gpu-check:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 $(PYTHON) -m benchmarks.gpu_check

clean:
	rm -rf $(VENV) .cache runs
