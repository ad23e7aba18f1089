"""One home per model family: no code outside ``loom/models`` branches on ``--model-type``
(config included: a family's config rules are its ``check`` / ``refuse_own_flags`` hooks); it
asks the family (``get_family(name).<hook>``, :mod:`loom.models.family`).

The check reads every module of ``loom/`` with :mod:`ast` and flags
- a comparison with a family name (``== "bert"``, ``in ("gemma3", "gpt")``),
- a comparison of a ``model_type`` (``cfg.model_type``, ``hf.get("model_type")``,
  ``saved["model_type"]``, a variable ``model_type``) with a string constant,
- a ``match`` on a ``model_type``, and a dict literal keyed by a family name.
"""

from __future__ import annotations

import ast
from pathlib import Path

from loom.models import FAMILY_MODULES

ROOT = Path(__file__).resolve().parents[2] / "loom"
ALLOWED = ("models",)  # loom/models/<family> (and the registry, loom/models/__init__.py)


def _strings(node: ast.AST) -> list[str]:
    """The string constants ``node`` is, or holds as a tuple / list / set literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def _is_model_type(node: ast.AST) -> bool:
    """``x.model_type``, ``model_type``, ``x.get("model_type")``, ``getattr(x, "model_type")``
    or ``x["model_type"]``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "model_type"
    if isinstance(node, ast.Name):
        return node.id == "model_type"
    if isinstance(node, ast.Call):
        return any(s == "model_type" for a in node.args for s in _strings(a))
    if isinstance(node, ast.Subscript):
        return "model_type" in _strings(node.slice)
    return False


def family_branches(source: str, filename: str, names=tuple(FAMILY_MODULES)) -> list[str]:
    """``file:line: code`` of every family branch in ``source`` (see the module docstring)."""
    lines = source.splitlines()
    hits = []
    for node in ast.walk(ast.parse(source, filename)):
        bad = False
        if isinstance(node, ast.Compare):
            ops = [node.left, *node.comparators]
            bad = any(s in names for o in ops for s in _strings(o)) or (
                any(map(_is_model_type, ops)) and any(_strings(o) for o in ops))
        elif isinstance(node, ast.Match):
            bad = _is_model_type(node.subject)
        elif isinstance(node, ast.Dict):
            bad = any(k is not None and any(s in names for s in _strings(k)) for k in node.keys)
        if bad:
            hits.append(f"{filename}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return hits


def scan(root: Path = ROOT) -> list[str]:
    """Family branches in every module of ``root`` outside the allowed folders."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ALLOWED:
            continue
        hits += family_branches(path.read_text(), f"loom/{rel}")
    return hits


def test_no_model_type_branch_outside_the_families():
    hits = scan()
    assert not hits, ("model_type branches outside loom/models (ask the "
                      "family, loom.models.get_family(name).<hook>, instead):\n"
                      + "\n".join(hits))


def test_the_checker_catches_a_synthetic_offender():
    offender = '''
def f(cfg, hf, saved, model_type):
    if cfg.model.model_type == "bert":
        pass
    if name in ("gemma3", "llama"):
        pass
    if hf.get("model_type") != "whatever":
        pass
    if saved["model_type"] == "x" or model_type == "y":
        pass
    ok = getattr(cfg, "model_type", "gpt") == "mamba"
    table = {"gpt": 1}
    match cfg.model_type:
        case _:
            pass
'''
    hits = family_branches(offender, "offender.py")
    assert sorted(int(h.split(":")[1]) for h in hits) == [3, 5, 7, 9, 9, 11, 12, 13], hits
    clean = '''
def g(cfg, family, args, registry):
    fam = registry.get(cfg.model.model_type)
    if args.model_type and args.model_type != fam.name:
        pass
    if family.generation is None or kind == "gpt2":
        pass
'''
    assert family_branches(clean, "clean.py") == []
