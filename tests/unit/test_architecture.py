"""Guards of the layout (docs/architecture.md): no module-level mutable state anywhere in
``loom/`` (mutable containers at module level only as UPPER_CASE constants, no ``global``
statements), no import cycles between loom's modules, and plain model
code that imports of the parallel package only its interface (loom.parallel.interface). The
layers between packages: tests/unit/test_layers.py.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil

import loom

from import_cycles import find_cycle
from import_graph import computed_names, module_graph

ROOT = pathlib.Path(loom.__file__).parent


def _modules() -> list[tuple[str, pathlib.Path]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def test_no_module_level_mutable_state():
    offenders = []
    for info in pkgutil.walk_packages(loom.__path__, "loom."):
        if info.name == "loom.__main__":
            continue
        mod = importlib.import_module(info.name)
        for name, value in vars(mod).items():
            if name.startswith("__") or name.isupper() or name.lstrip("_").isupper():
                continue
            if isinstance(value, (list, dict, set, bytearray)):
                offenders.append(f"{info.name}.{name} ({type(value).__name__})")
    assert not offenders, "module-level mutable state: " + ", ".join(offenders)


def test_no_global_statements():
    offenders = [f"{path.relative_to(ROOT.parent)}:{node.lineno}"
                 for _, path in _modules()
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Global)]
    assert not offenders, "`global` rebinds module state: " + ", ".join(offenders)


def import_graph() -> dict[str, set[str]]:
    """``module -> loom modules it references`` (tests/unit/import_graph.py: every form,
    relative imports resolved)."""
    return module_graph(ROOT)


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def family_violations(root: pathlib.Path) -> list[str]:
    """``source -> target`` of every reference from one model family's folder
    (``loom/models/<family>/``) into another's: families share code through the modules
    directly under ``loom/models/`` (and the packages below), never through each other."""
    graph = module_graph(root)

    def family(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "models" and (
            root / "models" / parts[2] / "__init__.py").exists() else None

    return sorted(f"{src} -> {dst}" for src, targets in graph.items() for dst in targets
                  if family(src) and family(dst) and family(src) != family(dst))


def test_no_family_imports_another():
    bad = family_violations(ROOT)
    assert not bad, "a family imports another family's folder (move the shared piece under " \
                    "loom/models/ or below):\n" + "\n".join(bad)


def test_the_guards_fail_on_synthetic_trees(tmp_path):
    """Each rule of this file and of the shared parser fails on a tree made to break it."""
    files = {
        "__init__.py": "",
        "models/__init__.py": "",
        "models/shared.py": "",
        "models/a/__init__.py": "from ..b import model\n",          # relative, family -> family
        "models/a/model.py": "from loom.models import shared\n",     # shared: allowed
        "models/b/__init__.py": "",
        "models/b/model.py": "import importlib as il\nm = il.import_module('loom.models.a')\n",
        "models/c/__init__.py": "import sys\nx = getattr(sys.modules['loom.models.a'], 'y')\n",
        "models/c/math.py": "from loom.parallel import tensor\n",   # model math -> parallel
        "parallel/__init__.py": "",
        "parallel/tensor.py": "from importlib import import_module as im\n"
                              "t = im('loom.%s' % 'training')\n"
                              "u = im('loom.' + 'models')\n",
        "parallel/cyc.py": "from . import cyc2\n",
        "parallel/cyc2.py": "def f():\n    from loom.parallel import cyc\n",
    }
    for name, text in files.items():
        path = tmp_path / "loom" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    root = tmp_path / "loom"
    assert family_violations(root) == ["loom.models.a -> loom.models.b.model",
                                       "loom.models.b.model -> loom.models.a",
                                       "loom.models.c -> loom.models.a"]
    computed = computed_names(root)
    assert [c.split(":")[:2] for c in computed] == [["loom/parallel/tensor.py", "2"],
                                                    ["loom/parallel/tensor.py", "3"]], computed
    graph = module_graph(root)
    assert "loom.parallel.tensor" in graph["loom.models.c.math"]
    assert find_cycle(graph) == ["loom.models.a", "loom.models.b.model", "loom.models.a"]
    parallel = {m: t for m, t in graph.items() if m.startswith("loom.parallel")}
    assert find_cycle(parallel) == ["loom.parallel.cyc", "loom.parallel.cyc2",
                                    "loom.parallel.cyc"]  # a function-level import counts


def test_model_math_does_not_import_parallelism():
    """Model code imports of loom.parallel only the interface the parallel package knows
    families by (forward-step types, StageSpec, recomputation markers); a family's
    ``parallelize.py`` (its plan) may import the rest."""
    graph = import_graph()
    plain = [m for m in graph if m.startswith("loom.models.") and not m.endswith("parallelize")]
    bad = {m: sorted(t for t in graph[m] if t.startswith("loom.parallel")
                     and t not in ("loom.parallel", "loom.parallel.interface")) for m in plain}
    assert not any(bad.values()), bad


def test_a_familys_declarations_import_no_torch():
    """The planner's layer kinds come from each family's torch-free ``config.py`` (its
    ``FAMILY_MODULES`` row's ``config``), so pricing every built-in family imports no torch
    (``loom plan`` stays a torch-free command)."""
    import subprocess
    import sys
    code = ("import sys\n"
            "from loom.config import LoomConfig, ModelConfig\n"
            "from loom.models import FamilyRegistry\n"
            "from loom.planner.memory import total_params\n"
            "shape = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=96, "
            "seq_length=16)\n"
            "print([total_params(ModelConfig(model_type=n, **shape)) > 0 "
            "for n in FamilyRegistry().names()], 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=pathlib.Path(loom.__file__).parents[1])
    assert out.stdout.strip() == "[True, True, True, True] False", out.stdout + out.stderr
