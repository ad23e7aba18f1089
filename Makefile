# Two commands do all the set-up on a fresh machine: `make demo` and `make test`
# (`make test-fast`: the single-process tier alone, tests/unit and tests/planner, ~1 minute).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast install clean

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
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p randomly $(if $(SEED),--randomly-seed=$(SEED)) tests

# The fast tier: the tests marked `fast` (tests/unit, tests/planner: in-process, no spawned
# ranks but the one torchrun run of `loom plan`'s printed command; markers set by folder in
# tests/conftest.py), in random order too: about 1 minute on 2 cores.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p randomly $(if $(SEED),--randomly-seed=$(SEED)) -m fast tests

clean:
	rm -rf $(VENV) .cache runs
