"""Layers that only point down (docs/architecture.md): every import between loom's packages goes
to a lower layer of :data:`LAYERS`, or sideways within one layer without a cycle.

Every ``import`` / ``from ... import`` counts, at module level or inside a function (relative
ones resolved), and so does a string naming a loom module: an ``importlib.import_module`` /
``__import__`` argument (a constant, or an f-string's constant prefix) and any string constant
that is exactly a loom module path (``"loom.models.gpt"``, ``"loom.evaluation.mlm:TASK"``: the
registries resolved with ``importlib``). A module's package is the first name under ``loom.``;
a top-level module (``loom/errors.py``, ``loom/cli.py``) is its own package, ``loom/__init__.py``
is ``loom``.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import NamedTuple, Optional

import loom

from import_cycles import find_cycle

ROOT = pathlib.Path(loom.__file__).parent

# Lowest first. A package may import its own layer (if that makes no cycle) and those below.
LAYERS = {
    "loom": 0, "errors": 0, "paths": 0,  # the version; exceptions; the on-disk layout rules
    "config": 1,                         # pure data and validation
    "data": 2, "parallel": 2,            # primitives (parallel knows families by its interface)
    "models": 3,                         # the families
    "checkpoint": 4, "interop": 4, "planner": 4,
    "training": 5, "inference": 5, "evaluation": 5,
    "cli": 6, "demo": 6, "__main__": 6,  # (the test helpers are testkit/, outside the package)
}

_MODULE_STRING = re.compile(r"^loom(\.\w+)+(:\w+)?$")


class Edge(NamedTuple):
    """``source`` package imports ``target`` package at ``where`` (``file:line``)."""

    source: str
    target: str
    where: str


def modules_of(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """``{dotted module name: path}`` of every ``.py`` file under ``root`` (a package dir named
    e.g. ``loom``); ``pkg/__init__.py`` is ``pkg``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def package_of(module: str) -> str:
    """``loom.models.gpt.model`` -> ``models``; ``loom.errors`` -> ``errors``; ``loom`` ->
    ``loom``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _resolve(name: str, modules: dict) -> Optional[str]:
    """The longest prefix of ``name`` that is a module of the tree (None when none is)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def _string_target(node: ast.AST) -> Optional[str]:
    """The module an ``import_module`` / ``__import__`` argument names: a constant, or the
    dotted prefix of an f-string's leading constant; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0]
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        prefix = str(node.values[0].value)
        return prefix.rsplit(".", 1)[0] if "." in prefix else prefix
    return None


def imported_modules(module: str, path: pathlib.Path, modules: dict) -> list[tuple[str, int]]:
    """``[(imported loom module, line)]`` of one file: imports anywhere in it (relative ones
    resolved against ``module``), ``import_module`` / ``__import__`` strings, and string
    constants that are exactly a loom module path."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                stem = here[:len(here) - node.level + 1]
                base = ".".join(stem + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in ("import_module", "__import__"):
                target = _string_target(node.args[0])
                names = [target] if target else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                _MODULE_STRING.match(node.value):
            names = [node.value.split(":")[0]]
        for name in names:
            resolved = _resolve(name, modules) if name.split(".")[0] == "loom" else None
            if resolved is not None:
                out.append((resolved, getattr(node, "lineno", 0)))
    return out


def package_edges(root: pathlib.Path) -> list[Edge]:
    """Every import from one package of the tree at ``root`` into another, with its place."""
    modules = modules_of(root)
    edges: dict[Edge, None] = {}  # in order, each once
    for module, path in modules.items():
        src = package_of(module)
        for target, line in imported_modules(module, path, modules):
            if package_of(target) != src:
                where = f"{path.relative_to(root.parent)}:{line}"
                edges[Edge(src, package_of(target), where)] = None
    return list(edges)


def layer_violations(root: pathlib.Path, layers: dict[str, int]) -> list[str]:
    """One line per broken rule: a package missing from ``layers``, an edge up the layers, a
    ``parallel`` import of ``models`` or above, a cycle among packages (each naming
    ``file:line`` and the edge)."""
    edges = package_edges(root)
    out = []
    for pkg in sorted({package_of(m) for m in modules_of(root)} - set(layers)):
        out.append(f"package {pkg} has no layer in LAYERS")
    for e in edges:
        if e.source not in layers or e.target not in layers:
            continue
        if layers[e.target] > layers[e.source]:
            out.append(f"{e.where}: {e.source} (layer {layers[e.source]}) -> {e.target} "
                       f"(layer {layers[e.target]}) points up")
        if e.source == "parallel" and "models" in layers and \
                layers[e.target] >= layers["models"]:
            out.append(f"{e.where}: parallel -> {e.target}: the parallel package knows model "
                       f"families only through loom.parallel.interface")
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
    cycle = find_cycle(graph)
    if cycle:
        pairs = set(zip(cycle, cycle[1:]))
        places = [f"{e.where} ({e.source} -> {e.target})" for e in edges
                  if (e.source, e.target) in pairs]
        out.append(f"package cycle {' -> '.join(cycle)}: " + ", ".join(places))
    return out


def test_layers_only_point_down():
    bad = layer_violations(ROOT, LAYERS)
    assert not bad, "imports against the layers (tests/unit/test_layers.py LAYERS):\n" + "\n".join(bad)


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in {"__init__.py": "", **files}.items():
        path = tmp_path / "loom" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "loom"


_LOW_HIGH = {"loom": 0, "errors": 0, "parallel": 2, "models": 3, "training": 5}


def test_checker_catches_a_function_level_upward_import(tmp_path):
    root = _tree(tmp_path, {
        "errors.py": "",
        "parallel/__init__.py": "",
        "parallel/mesh.py": "from loom.errors import X\n\ndef f():\n    from loom.models import y\n",
        "models/__init__.py": "from loom.parallel import mesh\n",
    })
    bad = layer_violations(root, _LOW_HIGH)
    assert any("loom/parallel/mesh.py:4: parallel (layer 2) -> models (layer 3) points up" in b
               for b in bad), bad
    assert any(b.startswith("loom/parallel/mesh.py:4: parallel -> models") for b in bad), bad
    assert any(b.startswith("package cycle models -> parallel -> models") for b in bad), bad


def test_checker_catches_relative_and_string_imports(tmp_path):
    root = _tree(tmp_path, {
        "parallel/__init__.py": "",
        "parallel/a.py": "from ..training import step\n",
        "parallel/b.py": "import importlib\nM = importlib.import_module('loom.models.gpt')\n",
        "parallel/c.py": "import importlib\n\ndef g(n):\n"
                         "    return importlib.import_module(f'loom.training.{n}')\n",
        "parallel/d.py": "REGISTRY = {'gpt': 'loom.models.gpt:FAMILY'}\n",
        "models/__init__.py": "", "models/gpt.py": "",
        "training/__init__.py": "", "training/step.py": "",
    })
    bad = "\n".join(layer_violations(root, _LOW_HIGH))
    for where, target in (("a.py:1", "training"), ("b.py:2", "models"), ("c.py:4", "training"),
                          ("d.py:1", "models")):
        assert f"loom/parallel/{where}: parallel (layer 2) -> {target}" in bad, bad


def test_checker_passes_a_downward_tree_and_names_unknown_packages(tmp_path):
    root = _tree(tmp_path, {
        "errors.py": "", "models/__init__.py": "from loom.parallel.mesh import M\n",
        "parallel/__init__.py": "", "parallel/mesh.py": "from . import other\nfrom loom import errors\n",
        "parallel/other.py": "'''mentions loom.models.gpt in prose only'''\n",
    })
    assert layer_violations(root, _LOW_HIGH) == []
    (root / "extra.py").write_text("")
    assert layer_violations(root, _LOW_HIGH) == ["package extra has no layer in LAYERS"]
