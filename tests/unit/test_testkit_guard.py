"""Every test builds its config with ``testkit.config.tiny_config`` and measures errors with
``testkit.numerics.rel_err`` against ``testkit.numerics``' tolerances: no test file grows its
own copy again (issue 46 found 19 files with their own ``make_cfg`` or ``rel_err``).

The patterns refused in a test file (``tests/**/*.py``), read from its syntax tree:

1. **config builder**: a function that is not a test (its name does not start with ``test``:
   helpers, fixtures, functions nested in a test) and calls a config class's constructor or
   preset: ``LoomConfig(...)``, ``LoomConfig.from_flat({...})`` (of a dict written there; of a
   checkpoint's stored dict it reads a config), ``ModelConfig(...)``,
   ``ModelConfig.llama(...)``, ... (a section's own class, e.g. ``ParallelConfig()`` to reset
   one section, is not a builder). Use ``tiny_config`` /
   ``tiny_model`` (a file's own wrapper that calls them with its parameters is fine). A test
   that checks the config classes themselves constructs them in its own body.
2. **relative error**: a function named like one (``rel_err``, ``_rel``, ``relative_error``,
   ...), or a division ``X.abs().max() / Y.abs().max()`` anywhere: use ``rel_err``.
3. **tolerance constant**: a module-level ``RTOL``/``ATOL``/``TOL``-named constant set to the
   literal of a shared tolerance (1e-5, 1e-4): import ``PARITY_RTOL``, ``PARAM_RTOL`` or
   ``UNIT_ATOL`` from ``testkit.numerics`` (each documents where its value comes from).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

TESTS = pathlib.Path(__file__).resolve().parents[1]
CONFIG_CLASSES = frozenset({"LoomConfig", "ModelConfig"})
REL_NAME = re.compile(r"_?(rel|rel_?err\w*|relative_?err\w*|max_rel\w*)")
TOL_NAME = re.compile(r"^\w*(R|A)?TOL$")
SHARED_TOLERANCES = (1e-5, 1e-4)
NOT_TINY = {("planner/test_planner_memory_runtime.py", "_pr482_model"):
            "the Llama-2-7B-shaped model of Megatron-LM PR 482's measured memory: data, not a "
            "tiny test config"}
"""``{(file under tests/, function): why}``: functions that build a config that is a published
run's, not a test's tiny one."""


def _config_class_call(node: ast.AST) -> str | None:
    """``'ModelConfig.llama'`` for a call of a config class or one of its class methods."""
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    if isinstance(f, ast.Name) and f.id in CONFIG_CLASSES:
        return f.id
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
            and f.value.id in CONFIG_CLASSES:
        if f.attr == "from_flat" and not (node.args and isinstance(node.args[0], ast.Dict)):
            return None  # reading a stored config (a checkpoint's), not building one
        return f"{f.value.id}.{f.attr}"
    return None


def _has_abs_max(node: ast.AST) -> bool:
    """Whether ``node`` contains ``<expr>.abs().max()``."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                and n.func.attr == "max" and isinstance(n.func.value, ast.Call) \
                and isinstance(n.func.value.func, ast.Attribute) \
                and n.func.value.func.attr == "abs":
            return True
    return False


def offences(source: str, name: str = "") -> list[str]:
    """The refused patterns in one file's source (``name``: its path under tests/), as
    ``'line N: what'``."""
    tree = ast.parse(source)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if REL_NAME.fullmatch(node.name):
                out.append(f"line {node.lineno}: def {node.name}: a relative-error helper "
                           "(use testkit.numerics.rel_err)")
            if not node.name.startswith("test") and (name, node.name) not in NOT_TINY:
                body = [n for stmt in node.body for n in ast.walk(stmt)]
                calls = sorted({c for n in body if (c := _config_class_call(n))})
                if calls:
                    out.append(f"line {node.lineno}: def {node.name} builds a config "
                               f"({', '.join(calls)}): use testkit.config.tiny_config")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) \
                and _has_abs_max(node.left) and _has_abs_max(node.right):
            out.append(f"line {node.lineno}: max|a - b| / max|b| written out: use "
                       "testkit.numerics.rel_err")
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        pairs = [(t, node.value) for t in node.targets]
        if isinstance(node.value, ast.Tuple):  # RTOL, ATOL = 1e-5, 1e-7
            pairs = [(t, v) for tup in node.targets if isinstance(tup, ast.Tuple)
                     for t, v in zip(tup.elts, node.value.elts)]
        for t, v in pairs:
            if isinstance(t, ast.Name) and TOL_NAME.match(t.id) \
                    and isinstance(v, ast.Constant) and v.value in SHARED_TOLERANCES:
                out.append(f"line {node.lineno}: {t.id} = {v.value!r}: import "
                           "PARITY_RTOL / PARAM_RTOL / UNIT_ATOL from testkit.numerics")
    return out


def test_no_test_file_builds_its_own_config_or_relative_error():
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        name = path.relative_to(TESTS).as_posix()
        if bad := offences(path.read_text(), name):
            found[name] = bad
    assert not found, "\n".join(f"tests/{f}: {b}" for f, bs in found.items() for b in bs)


SYNTHETIC = {
    "builder": ("from loom.config import LoomConfig, ModelConfig\n"
                "def make_cfg(tp=1):\n"
                "    cfg = LoomConfig(model=ModelConfig.llama(num_layers=2))\n"
                "    return cfg\n", "def make_cfg builds a config (LoomConfig, ModelConfig.llama)"),
    "nested builder": ("def test_x():\n"
                       "    def cfg():\n"
                       "        return LoomConfig.from_flat({**BASE, 'lr': 1.0})\n",
                       "def cfg builds a config (LoomConfig.from_flat)"),
    "fixture": ("@pytest.fixture\n"
                "def cfg():\n"
                "    return ModelConfig(num_layers=2)\n", "def cfg builds a config (ModelConfig)"),
    "rel_err": ("def rel_err(a, b):\n    return 0.0\n", "def rel_err: a relative-error helper"),
    "_rel": ("def _rel(a, b):\n    return 0.0\n", "def _rel: a relative-error helper"),
    "inline": ("def test_y():\n"
               "    err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))\n",
               "max|a - b| / max|b| written out"),
    "RTOL": ("RTOL = 1e-5\n", "RTOL = 1e-05: import PARITY_RTOL"),
    "ATOL": ("ATOL = 1e-5\n", "ATOL = 1e-05: import"),
    "PARAM": ("PARAM_RTOL = 1e-4\n", "PARAM_RTOL = 0.0001: import"),
    "tuple": ("RTOL, ATOL = 1e-5, 1e-7\n", "RTOL = 1e-05: import"),
}


def test_each_exemption_names_a_function_that_exists():
    for (name, func), _ in NOT_TINY.items():
        tree = ast.parse((TESTS / name).read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == func for n in ast.walk(tree)), \
            (name, func)


@pytest.mark.parametrize("case", sorted(SYNTHETIC))
def test_the_guard_refuses_each_pattern(case):
    source, expected = SYNTHETIC[case]
    assert any(expected in o for o in offences(source)), offences(source)


def test_the_guard_accepts_what_tests_may_do():
    ok = ("from testkit.config import tiny_config\n"
          "from testkit.numerics import PARITY_RTOL as RTOL\n"
          "STEPS = 3\n"
          "TOL = 5e-5  # its own tolerance, explained where set\n"
          "def make_cfg(tp=1):\n"
          "    return tiny_config('llama', tensor_model_parallel_size=tp)\n"
          "def stored(path):\n"
          "    return LoomConfig.from_flat(read_common(path)['config'])\n"
          "def test_config_classes():\n"
          "    assert LoomConfig(model=ModelConfig(num_layers=2)).model.num_layers == 2\n"
          "def test_norm():\n"
          "    assert x.abs().max() < 1.0\n")
    assert offences(ok) == []


def test_tiny_config_routes_flat_names_and_a_later_value_wins():
    from testkit.config import PRE_ISSUE_21, tiny_config, tiny_model
    cfg = tiny_config("llama", PRE_ISSUE_21, {"lr": 2e-3}, lr=5e-3, tensor_model_parallel_size=2,
                      num_layers=4, save="ck")
    assert (cfg.training.lr, cfg.training.adam_beta2, cfg.parallel.tensor_model_parallel_size,
            cfg.checkpoint.save, cfg.data.mock_data) == (5e-3, 0.95, 2, "ck", True)
    assert (cfg.model.num_layers, cfg.model.num_query_groups, cfg.model.normalization) == \
        (4, 2, "RMSNorm") and cfg.derived is None
    assert tiny_config(world=1).derived.world_size == 1
    model = tiny_model("gpt")
    again = tiny_config(model=model, num_layers=3)
    assert again.model.num_layers == 3 and model.num_layers == 2  # the given model is copied
    with pytest.raises(TypeError, match="no_such_flag"):
        tiny_config(no_such_flag=1)
    with pytest.raises(TypeError, match="not model fields"):
        tiny_model("gpt", lr=1e-3)
