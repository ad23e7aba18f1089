# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test install clean

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

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -x tests

clean:
	rm -rf $(VENV) .cache runs
