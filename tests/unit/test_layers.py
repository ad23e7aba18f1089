"""Layers that only point down (docs/architecture.md): every import between loom's packages goes
to a lower layer of :data:`LAYERS`, or sideways within one layer without a cycle.

Every reference counts, as the one parser of the guards reads it (tests/unit/import_graph.py:
imports anywhere, relative ones resolved, ``import_module`` / ``__import__`` / ``sys.modules``
with a literal under any alias, strings that are exactly a loom module path); a module name
built at run time is refused. A module's package is the first name under ``loom.``;
a top-level module (``loom/errors.py``, ``loom/cli.py``) is its own package, ``loom/__init__.py``
is ``loom``.
"""

from __future__ import annotations

import pathlib
from typing import NamedTuple

import loom

from import_cycles import find_cycle
from import_graph import all_imports, computed_names, modules_of

ROOT = pathlib.Path(loom.__file__).parent

# Lowest first. A package may import its own layer (if that makes no cycle) and those below.
LAYERS = {
    "loom": 0, "errors": 0, "paths": 0,  # the version; exceptions; the on-disk layout rules;
    "jsonl": 0,                          # reading JSON Lines inputs
    "config": 1,                         # pure data and validation
    "data": 2, "parallel": 2,            # primitives (parallel knows families by its interface)
    "models": 3,                         # the families
    "checkpoint": 4, "interop": 4, "planner": 4,
    "training": 5, "inference": 5, "evaluation": 5,
    "cli": 6, "demo": 6, "__main__": 6,  # (the test helpers are testkit/, outside the package)
}


class Edge(NamedTuple):
    """``source`` package imports ``target`` package at ``where`` (``file:line``)."""

    source: str
    target: str
    where: str


def package_of(module: str) -> str:
    """``loom.models.gpt.model`` -> ``models``; ``loom.errors`` -> ``errors``; ``loom`` ->
    ``loom``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_edges(root: pathlib.Path) -> list[Edge]:
    """Every import from one package of the tree at ``root`` into another, with its place."""
    edges: dict[Edge, None] = {}  # in order, each once
    for i in all_imports(root):
        if i.target is not None and package_of(i.target) != package_of(i.source):
            edges[Edge(package_of(i.source), package_of(i.target), i.where(root))] = None
    return list(edges)


def layer_violations(root: pathlib.Path, layers: dict[str, int]) -> list[str]:
    """One line per broken rule: a package missing from ``layers``, a module name the parser
    cannot read (:func:`import_graph.computed_names`), an edge up the layers, a ``parallel``
    import of ``models`` or above, a cycle among packages (each naming ``file:line`` and the
    edge)."""
    edges = package_edges(root)
    out = computed_names(root)
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
    for where, target in (("a.py:1", "training"), ("b.py:2", "models"), ("d.py:1", "models")):
        assert f"loom/parallel/{where}: parallel (layer 2) -> {target}" in bad, bad
    assert "loom/parallel/c.py:4: import_module of a name built at run time" in bad, bad


def test_checker_passes_a_downward_tree_and_names_unknown_packages(tmp_path):
    root = _tree(tmp_path, {
        "errors.py": "", "models/__init__.py": "from loom.parallel.mesh import M\n",
        "parallel/__init__.py": "", "parallel/mesh.py": "from . import other\nfrom loom import errors\n",
        "parallel/other.py": "'''mentions loom.models.gpt in prose only'''\n",
    })
    assert layer_violations(root, _LOW_HIGH) == []
    (root / "extra.py").write_text("")
    assert layer_violations(root, _LOW_HIGH) == ["package extra has no layer in LAYERS"]
