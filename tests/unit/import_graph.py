"""The one import parser of every layout guard in tests/unit (test_layers.py: packages,
test_architecture.py: modules, model math, families). A plain module beside them, not a test file.

Every way a module of the tree can reach another counts, wherever it stands (module level,
inside a function, under ``if``):
- ``import a.b`` / ``from a.b import c`` / ``from . import c`` / ``from ..x import y``, relative
  ones resolved against the importing module;
- ``importlib.import_module("loom.x")`` / ``__import__("loom.x")`` with a string literal, under
  any name they are bound to (``import importlib as il``, ``from importlib import import_module
  as im``, ``builtins.__import__``);
- ``sys.modules["loom.x"]`` / ``sys.modules.get("loom.x")`` (also with ``sys`` renamed);
- a string constant that is exactly a loom module path (``"loom.models.gpt"``,
  ``"loom.evaluation.mlm:TASK"``): the registries resolved later.

A module name the parser cannot read is refused, not skipped: :attr:`Import.computed` marks an
``import_module`` / ``__import__`` / ``sys.modules`` argument that is not a string literal, and
a string built at run time that spells a loom module (``"loom." + name``, ``"loom.%s" % name``,
``"loom.{}".format(name)``, ``f"loom.{name}"``, ``".".join(["loom", name])``).
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import NamedTuple, Optional

_MODULE_STRING = re.compile(r"^loom(\.\w+)+(:\w+)?$")
_LOOM_PREFIX = re.compile(r"^loom(\.|$)")


class Import(NamedTuple):
    """One reference of ``source`` (a module of the tree) to ``target`` (the longest module of
    the tree its name starts with; None for a computed name) at ``path:line``; ``how`` says
    which form it took."""

    source: str
    target: Optional[str]
    path: pathlib.Path
    line: int
    how: str

    @property
    def computed(self) -> bool:
        """A module name the parser could not read (refused by every guard)."""
        return self.target is None

    def where(self, root: pathlib.Path) -> str:
        """``loom/x/y.py:LINE`` relative to the directory holding the tree ``root``."""
        return f"{self.path.relative_to(root.parent)}:{self.line}"


def modules_of(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """``{dotted module name: path}`` of every ``.py`` file under ``root`` (a package directory
    such as ``loom``); ``pkg/__init__.py`` is ``pkg``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict) -> Optional[str]:
    """The longest prefix of ``name`` that is a module of the tree (None when none is)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def _constant_text(node: ast.AST) -> Optional[str]:
    """The text a string expression has when it holds no run-time part, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _built_text(node: ast.AST) -> Optional[str]:
    """The constant parts, in order, of a string built at run time (``+``, ``%``,
    ``.format``, f-string, ``str.join``); None for anything else, or for a plain literal."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        left = _constant_text(node.left) or _built_text(node.left) or ""
        if isinstance(node.op, ast.Mod):
            return left or None
        right = _constant_text(node.right) or _built_text(node.right) or ""
        return (left + "\0" + right) if (left or right) else None
    if isinstance(node, ast.JoinedStr):
        parts = [v.value if isinstance(v, ast.Constant) else "\0" for v in node.values]
        return "".join(parts) if "\0" in parts else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        base = _constant_text(node.func.value)
        if node.func.attr == "format" and base is not None:
            return base
        if node.func.attr == "join" and base is not None and node.args and isinstance(
                node.args[0], (ast.List, ast.Tuple)):
            return base.join(_constant_text(e) or "\0" for e in node.args[0].elts)
    return None


def _spells_loom(text: Optional[str]) -> bool:
    return text is not None and bool(_LOOM_PREFIX.match(text.replace("\0", "x")))


class _Aliases:
    """The names a file binds to ``importlib.import_module``, ``__import__``, the ``importlib``,
    ``builtins`` and ``sys`` modules (``import sys as s``, ``from importlib import
    import_module as im``)."""

    def __init__(self, tree: ast.AST):
        self.loaders = {"__import__"}
        self.modules_of_loaders = {"importlib", "builtins"}
        self.sys = {"sys"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in ("importlib", "builtins"):
                        self.modules_of_loaders.add(a.asname or a.name)
                    if a.name == "sys":
                        self.sys.add(a.asname or a.name)
            elif isinstance(node, ast.ImportFrom) and node.module in ("importlib", "builtins"):
                for a in node.names:
                    if a.name in ("import_module", "__import__"):
                        self.loaders.add(a.asname or a.name)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                    node.targets[0], ast.Name) and self.is_loader(node.value):
                self.loaders.add(node.targets[0].id)  # load = importlib.import_module

    def is_loader(self, func: ast.AST) -> bool:
        """``func`` is ``import_module`` / ``__import__`` under one of its names (also
        ``getattr(importlib, "import_module")``)."""
        if isinstance(func, ast.Name):
            return func.id in self.loaders
        if isinstance(func, ast.Attribute):
            return func.attr in ("import_module", "__import__")
        if isinstance(func, ast.Call) and getattr(func.func, "id", "") == "getattr" and \
                len(func.args) >= 2:
            return _constant_text(func.args[1]) in ("import_module", "__import__")
        return False

    def is_sys_modules(self, node: ast.AST) -> bool:
        """``node`` is ``sys.modules`` (``sys`` under any of its names)."""
        return isinstance(node, ast.Attribute) and node.attr == "modules" and \
            isinstance(node.value, ast.Name) and node.value.id in self.sys


def imports_of(module: str, path: pathlib.Path, modules: dict) -> list[Import]:
    """Every :class:`Import` of one file (see the module docstring); references to modules
    outside the tree (``torch``, ``os``) are left out, computed loom names are kept."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = _Aliases(tree)
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    top = next(iter(modules)).split(".")[0] if modules else "loom"
    out: list[Import] = []

    def add(name: Optional[str], node: ast.AST, how: str) -> None:
        line = getattr(node, "lineno", 0)
        if name is None:
            out.append(Import(module, None, path, line, how))
        elif name.split(".")[0] == top and (target := _resolve(name, modules)) is not None:
            out.append(Import(module, target, path, line, how))

    def named(arg: ast.AST, node: ast.AST, how: str) -> None:
        text = _constant_text(arg)
        if text is not None:
            add(text.split(":")[0], node, how)
        else:
            add(None, node, f"{how} of a name built at run time")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, node, "import")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                stem = here[:len(here) - node.level + 1]
                base = ".".join(stem + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                add(full if full in modules else base, node, "from-import")
        elif isinstance(node, ast.Call) and aliases.is_loader(node.func):
            if node.args:
                named(node.args[0], node, "import_module")
        elif isinstance(node, ast.Subscript) and aliases.is_sys_modules(node.value):
            named(node.slice, node, "sys.modules[]")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("get", "pop", "setdefault") and \
                aliases.is_sys_modules(node.func.value) and node.args:
            named(node.args[0], node, "sys.modules.get")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                _MODULE_STRING.match(node.value):
            add(node.value.split(":")[0], node, "module string")
        elif _spells_loom(_built_text(node)):
            add(None, node, "a loom module name built at run time")
    return out


def all_imports(root: pathlib.Path) -> list[Import]:
    """Every :class:`Import` of every module of the tree at ``root``."""
    modules = modules_of(root)
    return [i for m, p in modules.items() for i in imports_of(m, p, modules)]


def computed_names(root: pathlib.Path) -> list[str]:
    """``loom/x.py:LINE: how`` of every module name the parser cannot read."""
    out: dict[str, str] = {}  # one line per place: ``import_module(f"loom.{x}")`` is one
    for i in all_imports(root):
        if i.computed:
            out.setdefault(i.where(root), f"{i.where(root)}: {i.how} (import it by its "
                                          f"literal name)")
    return list(out.values())


def module_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """``{module: modules of the tree it references}`` (computed names left out: refused by
    :func:`computed_names`)."""
    graph: dict[str, set[str]] = {m: set() for m in modules_of(root)}
    for i in all_imports(root):
        if i.target is not None and i.target != i.source:
            graph[i.source].add(i.target)
    return graph
