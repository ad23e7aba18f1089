"""Every test starts from the same process state, whatever ran before it (the suite runs in a
random order, ``pytest-randomly``; see tests/README.md).

The autouse fixture below snapshots what a test can change process-wide and puts it back
afterwards: ``os.environ``, torch's default dtype, intra-op thread count and default
generator state (a ``Trainer`` seeds the default generator, as Megatron does), and the
handlers and levels of the loggers. A process group left initialized by a test fails that
test (and is destroyed, so the next test is unaffected).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch


def _loggers() -> dict:
    out = {"": logging.getLogger()}
    for name, lg in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger):
            out[name] = lg
    return {name: (lg, list(lg.handlers), lg.level, lg.propagate, lg.disabled)
            for name, lg in out.items()}


@pytest.fixture(autouse=True)
def _restore_process_state():
    import torch.distributed as dist
    env = dict(os.environ)
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    rng = torch.random.get_rng_state()
    loggers = _loggers()
    had_group = dist.is_available() and dist.is_initialized()
    yield
    left_group = dist.is_available() and dist.is_initialized() and not had_group
    if left_group:
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)
    torch.set_default_dtype(dtype)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    torch.random.set_rng_state(rng)
    for name, (lg, handlers, level, propagate, disabled) in loggers.items():
        for h in [h for h in lg.handlers if h not in handlers]:
            lg.removeHandler(h)  # (a handler added by the test; not closed: it may be shared)
        for h in handlers:
            if h not in lg.handlers:
                lg.addHandler(h)
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled
    assert not left_group, "the test left a torch.distributed process group initialized"


# The folders (tests/README.md) and the markers of their tests (registered in pyproject.toml):
# `-m fast` is `make test-fast`; `-m "not drill"`, `-m distributed` select the other tiers;
# `-m cuda` (tests/cuda) needs a CUDA device and is skipped without one (`make gpu-check` runs it).
FOLDER_MARKERS = {
    "unit": "fast", "planner": "fast",
    "parallel": "distributed", "models": "distributed", "integration": "distributed",
    "drills": "drill", "cuda": "cuda",
}
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """Mark each test by its folder: tests/unit/test_x.py's tests are ``fast``, and so on. A
    test file directly under tests/ or in a folder missing from FOLDER_MARKERS is an error.
    Without a CUDA device the ``cuda`` tests are collected and skipped."""
    no_cuda = pytest.mark.skip(reason="no CUDA device (the tier runs on a GPU: make gpu-check)")
    for item in items:
        try:
            folder = Path(str(item.path)).resolve().relative_to(_TESTS).parts[0]
        except ValueError:
            continue  # (collected from outside tests/: no marker)
        if folder not in FOLDER_MARKERS:
            raise pytest.UsageError(f"{item.nodeid}: a test belongs in one of the folders "
                                    f"{sorted(FOLDER_MARKERS)} of tests/ (tests/README.md)")
        item.add_marker(FOLDER_MARKERS[folder])
        if folder == "cuda" and not torch.cuda.is_available():
            item.add_marker(no_cuda)


def _seed(config):
    """pytest-randomly's seed when it orders this run (``-p randomly``), else None."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int) and getattr(config.option, "randomly_reorganize", False):
        return seed
    return None


def _say_seed(config, terminal, failed: bool) -> None:
    seed = _seed(config)
    if seed is None or terminal is None:
        return
    terminal.write_line(f"random test order: --randomly-seed={seed}")
    if failed:
        terminal.write_line(
            f"reproduce this order: `make test SEED={seed}` (the same modules on the same worker "
            f"only when their speeds repeat: `make test SEED={seed} WORKERS=0` runs the order in "
            f"one process), or `OMP_NUM_THREADS=1 .venv/bin/python -m pytest -p randomly -p "
            f"no:cacheprovider --randomly-seed={seed} tests` (the same seed on a subset of the "
            f"files keeps their relative order)",
            red=True, bold=True)


def pytest_sessionstart(session):
    """The seed first (also under ``-q``, which hides pytest-randomly's header line)."""
    _say_seed(session.config, session.config.pluginmanager.get_plugin("terminalreporter"),
              failed=False)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The seed again at the end, and on failure the command that runs the same order."""
    _say_seed(config, terminalreporter, failed=exitstatus not in (0, 5))
