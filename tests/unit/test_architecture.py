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
    """``module -> loom modules it imports`` (module level and inside functions)."""
    modules = dict(_modules())
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    graph[name].add(t)
    return graph


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_model_math_does_not_import_parallelism():
    """Model code imports of loom.parallel only the interface the parallel package knows
    families by (forward-step types, StageSpec, recomputation markers); a family's
    ``parallelize.py`` (its plan) may import the rest."""
    graph = import_graph()
    plain = [m for m in graph if m.startswith("loom.models.") and not m.endswith("parallelize")]
    bad = {m: sorted(t for t in graph[m] if t.startswith("loom.parallel")
                     and t not in ("loom.parallel", "loom.parallel.interface")) for m in plain}
    assert not any(bad.values()), bad
