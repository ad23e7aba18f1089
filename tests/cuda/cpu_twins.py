"""The CPU tests whose harnesses the CUDA tier runs again on a GPU, loaded by path.

pytest imports each test file by its basename with its folder on ``sys.path``; a run of
``pytest tests/cuda`` alone has none of the other folders there, so the CUDA tests load the CPU
test module they reuse (its configs, harness and tolerance) from its file instead. The module is
imported under a private name (``_twin_<folder>_<name>``), so pytest never collects its tests a
second time. Not a test file (no ``test_`` prefix).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parent.parent


def twin(folder: str, name: str) -> ModuleType:
    """``tests/<folder>/<name>.py`` as a module (imported once per process)."""
    key = f"_twin_{folder}_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, TESTS / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # before exec: dataclasses and pickling look the module up
    spec.loader.exec_module(module)
    return module
