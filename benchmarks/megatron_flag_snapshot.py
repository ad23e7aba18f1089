"""Snapshot of Megatron-LM's command line: every flag its own ``parse_args()`` knows.

Usage::

    git -C MIRROR archive HEAD | tar -x -C /tmp/mlm        # a Megatron-LM checkout (d98e8a6)
    python -m benchmarks.megatron_flag_snapshot /tmp/mlm [--out loom/config/megatron_flags.json]

Builds Megatron-LM's parser the way ``megatron.training.arguments.parse_args`` does
(``add_megatron_arguments``, which includes the groups generated from its config dataclasses by
``ArgumentGroupFactory``) plus the ModelOpt group that ``pretrain_gpt.py`` / ``pretrain_hybrid.py``
add as ``extra_args_provider`` when ``modelopt`` is installed, and records for each argparse
action: its option strings, dest, default, type, nargs, choices, action kind, argparse group and
the ``file:line`` that declares it (the ``add_argument`` call, or the dataclass field the flag is
generated from). ``megatron/core`` is imported from the checkout itself; the packages a CPU
machine lacks (Triton, Transformer Engine, Apex, ...) are stubbed by an import hook that answers
any attribute with a placeholder, which changes no flag (flags are declared at import, not
computed from those packages). No help text is recorded.

The JSON is committed as ``loom/config/megatron_flags.json`` (CI has no Megatron checkout); the
tests of ``loom.config.flag_table`` read it.
"""

from __future__ import annotations

import argparse
import ast
import enum
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import subprocess
import sys
import types
from typing import Any

# The one package the checkout imports unguarded that a CPU machine lacks (Transformer Engine,
# Apex and the rest are imported under try/except by Megatron itself); stubbed only after torch
# has decided it has no Triton, so torch's own behaviour is unchanged.
STUBBED = ("triton",)


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)

    def __getitem__(cls, key):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


class _Stub(metaclass=_StubMeta):
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):  # a decorator returns what it decorates
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Stub()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)


def _stub(name: str) -> type:
    return _StubMeta(name, (_Stub,), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import X`` (and ``X.y``) for X in :data:`STUBBED` that is not installed."""

    def find_spec(self, fullname, path, target=None):
        top = fullname.split(".")[0]
        if top not in STUBBED:
            return None
        if fullname == top:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                if finder.find_spec(fullname, path, target) is not None:
                    return None  # installed: the real package
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__version__ = "0.0.0"

        def getattr_(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _stub(name)
        mod.__getattr__ = getattr_
        return mod

    def exec_module(self, module):
        pass


def _jsonable(value: Any) -> Any:
    """``value`` as JSON: plain values as they are, enums as ``{"enum": "Cls.name"}``, lists
    and tuples as lists, anything else as ``{"repr": ...}``."""
    if isinstance(value, enum.Enum):  # before int: an IntEnum (signal.Signals) is an int
        return {"enum": f"{type(value).__name__}.{value.name}", "value": _jsonable(value.value)}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else {"repr": repr(value)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return {"repr": repr(value)}


def _type_name(tp: Any) -> Any:
    if tp is None:
        return None
    if isinstance(tp, type):
        return tp.__name__
    name = getattr(tp, "__name__", None)
    if name == "enum_type_handler":  # ArgumentGroupFactory's enum converter
        return "enum"
    return name or repr(tp)


def _field_line(cls: type, name: str, root: str) -> str | None:
    """``file:line`` of the annotated assignment of field ``name`` in ``cls`` or a base."""
    for klass in cls.__mro__:
        try:
            lines, start = inspect.getsourcelines(klass)
            path = inspect.getsourcefile(klass)
        except (OSError, TypeError):
            continue
        tree = ast.parse("".join(lines).replace("\r", ""))
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node in body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                    node.target.id == name:
                return f"{os.path.relpath(path, root)}:{start + node.lineno - 1}"
    return None


def build_parser(root: str) -> tuple[argparse.ArgumentParser, dict[int, str], dict[int, str]]:
    """Megatron-LM's parser from the checkout ``root``, ``{id(action): "file:line"}`` and
    ``{id(action): provider}``: ``pretrain`` (``parse_args()`` itself), ``modelopt`` (the
    ``extra_args_provider`` of pretrain_gpt.py / pretrain_hybrid.py) or ``inference`` (that of
    the inference entry scripts)."""
    root = os.path.abspath(root)
    sys.path.insert(0, root)
    import typing
    if not hasattr(typing, "override"):  # Python 3.12's typing.override, used at d98e8a6
        typing.override = lambda f: f
    import torch  # noqa: F401 - torch decides it has no Triton before the stub exists
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.ir  # noqa: F401
    from torch.utils._triton import has_triton, has_triton_package
    has_triton(), has_triton_package()
    sys.meta_path.insert(0, _StubFinder())
    import warnings
    warnings.simplefilter("ignore")
    from megatron.training import arguments

    sources: dict[int, str] = {}
    original = argparse._ActionsContainer.add_argument

    def add_argument(self, *args, **kwargs):
        action = original(self, *args, **kwargs)
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code.co_name == "build_group" and "argument_utils" in code.co_filename:
                attr, owner = frame.f_locals.get("attr"), frame.f_locals.get("self")
                line = _field_line(owner.src_cfg_class, attr.name, root) if attr else None
                if line:
                    sources[id(action)] = line
                    break
            if code.co_filename.startswith(root) and "argument_utils" not in code.co_filename:
                sources[id(action)] = f"{os.path.relpath(code.co_filename, root)}:{frame.f_lineno}"
                break
            frame = frame.f_back
        return action

    argparse._ActionsContainer.add_argument = add_argument
    providers: dict[int, str] = {}
    try:
        parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
        parser = arguments.add_megatron_arguments(parser)
        providers.update({id(a): "pretrain" for a in parser._actions})
        from megatron.post_training.arguments import add_modelopt_args
        parser = add_modelopt_args(parser)
        providers.update({id(a): "modelopt" for a in parser._actions if id(a) not in providers})
        from megatron.inference.utils import add_inference_args
        parser = add_inference_args(parser)
        for script, name in INFERENCE_SCRIPTS:
            _script_provider(root, script, name)(parser)
        providers.update({id(a): "inference" for a in parser._actions if id(a) not in providers})
    finally:
        argparse._ActionsContainer.add_argument = original
    return parser, sources, providers


# The inference entry scripts of the functional tests add a few flags of their own on top of
# megatron.inference.utils.add_inference_args (their extra_args_provider).
INFERENCE_SCRIPTS = (("examples/inference/advanced/gpt_static_inference.py",
                      "add_static_inference_args"),
                     ("examples/inference/offline_inference.py", "add_offline_inference_args"))


def _script_provider(root: str, script: str, name: str):
    """The function ``name`` of the entry script ``script``, compiled alone (its module imports
    the whole inference engine); the shared ``add_inference_args`` it calls first is skipped,
    already applied."""
    path = os.path.join(root, script)
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace: dict = {"add_inference_args": lambda parser: parser,
                       "ArgumentParser": argparse.ArgumentParser}
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
    return namespace[name]


def _group_of(parser: argparse.ArgumentParser) -> dict[int, str]:
    out = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            out[id(action)] = group.title or ""
    return out


def snapshot(root: str) -> dict:
    """``{"commit", "flags": [...]}``: one entry per argparse action with an option string."""
    parser, sources, providers = build_parser(root)
    groups = _group_of(parser)
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = os.environ.get("MEGATRON_COMMIT", "d98e8a64ddf34856e74b24714e3bedb2f5a39553")
    flags = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        kind = type(action).__name__.lstrip("_").replace("Action", "").lower()
        flags.append({
            "flags": list(action.option_strings),
            "dest": action.dest,
            "default": _jsonable(action.default),
            "action": kind or "store",
            "type": _type_name(action.type),
            "nargs": action.nargs,
            "choices": None if action.choices is None else [_jsonable(c) for c in
                                                           action.choices],
            "group": groups.get(id(action), ""),
            "source": sources.get(id(action), ""),
            "parser": providers[id(action)],
        })
    return {"repository": "NVIDIA/Megatron-LM", "commit": commit,
            "parsers": {"pretrain": "megatron.training.arguments.add_megatron_arguments",
                        "modelopt": "megatron.post_training.arguments.add_modelopt_args",
                        "inference": "megatron.inference.utils.add_inference_args + "
                                     + ", ".join(f"{s}:{n}" for s, n in INFERENCE_SCRIPTS)},
            "flags": flags}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", help="a Megatron-LM source tree (git archive of the commit)")
    ap.add_argument("--out", default="loom/config/megatron_flags.json")
    args = ap.parse_args(argv)
    snap = snapshot(args.checkout)
    with open(args.out, "w", encoding="utf-8") as fh:  # one flag per line
        head = {k: v for k, v in snap.items() if k != "flags"}
        fh.write(json.dumps(head)[:-1] + ', "flags": [\n')
        fh.write(",\n".join(json.dumps(f) for f in snap["flags"]))
        fh.write("\n]}\n")
    print(f"{len(snap['flags'])} flags of Megatron-LM {snap['commit'][:7]} -> {args.out}")


if __name__ == "__main__":
    main()
