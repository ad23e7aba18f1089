"""Snapshot of the flags Megatron-LM's earlier releases took and its snapshot commit no longer has.

Usage::

    python -m benchmarks.megatron_removed_flags MIRROR [--out loom/config/megatron_removed_flags.json]

``MIRROR`` is a Megatron-LM git directory with its release tags (``fetch github:NVIDIA/Megatron-LM``).
A launch script written for an earlier release (v1.0 .. core_v0.19.0) may use a flag that the
snapshot commit of ``loom/config/megatron_flags.json`` (d98e8a6) has dropped or renamed; loom's
flag table gives each such flag a row too (:mod:`loom.config.flag_rows_removed`).

For every release tag (each ``vX``, ``YY.MM`` and ``core_v``/``core_r`` tag, release candidates
and alphas included: scripts were written against them too) the ``add_argument`` calls of
``megatron/arguments.py`` or ``megatron/training/arguments.py`` are read statically (``ast``;
nothing is imported, so any release reads on any machine): spellings, ``dest``, ``action``,
``type``, ``nargs``, ``default`` and ``choices`` where they are literals. A flag none of whose
spellings the snapshot knows is recorded as of the newest release declaring it, with the first
and last releases that declare it (tags in :func:`release_tags`' order) and its ``file:line`` there.
The record has the snapshot's format (``parser``: ``"removed"``) plus ``releases``. Also
recorded (``values``): each value a release offered among the ``choices`` of a flag the
snapshot still has but no longer offers (``--ckpt-format zarr``), with its first and last
release.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess

FILES = ("megatron/training/arguments.py", "megatron/arguments.py")
TAG = re.compile(r"^(v\d+\.\d+(\.\d+)?(rc\d+)?|\d\d\.\d\d(-alpha\.rc\d+)?|core_[vr]\d+\.\d+\.\d+"
                 r"(rc\d+|\.beta)?)$")
ACTIONS = {"store_true": "storetrue", "store_false": "storefalse", "store": "store",
           "store_const": "storeconst", "append": "append"}


def _git(mirror: str, *args: str) -> str:
    return subprocess.run(["git", "-C", mirror, *args], check=True, capture_output=True,
                          text=True).stdout


CORE = re.compile(r"^(?:core_[vr]|v)0\.(\d+)\.(\d+)(rc\d+|\.beta)?$")


def _core_key(tag: str) -> tuple:
    minor, patch, pre = CORE.match(tag).groups()
    return (int(minor), int(patch), -1 if pre == ".beta" else int(pre[2:]) if pre else 10 ** 6)


def release_tags(mirror: str) -> list[str]:
    """The release tags of ``mirror`` by commit date, the Megatron-Core releases among them
    (``core_v0.A.B``, ``v0.A.B``) in version order (a patch release's tag can sit on a commit
    newer than the next release's)."""
    out = _git(mirror, "for-each-ref", "--format=%(refname:short)", "refs/tags")
    tags = sorted((t for t in out.split() if TAG.match(t)),
                  key=lambda t: int(_git(mirror, "log", "-1", "--format=%ct", t)))
    core = iter(sorted((t for t in tags if CORE.match(t)), key=_core_key))
    return [next(core) if CORE.match(t) else t for t in tags]


def _literal(node):
    try:
        return ast.literal_eval(node)
    except Exception:
        return None


def declared(source: str, path: str) -> list[dict]:
    """Every ``*.add_argument('--flag', ...)`` of ``source`` as a snapshot-style record."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant)
                 and isinstance(a.value, str) and a.value.startswith("-")]
        if not any(f.startswith("--") for f in flags):
            continue
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        action = _literal(kw["action"]) if "action" in kw else "store"
        if action is None and "action" in kw:  # argparse.BooleanOptionalAction
            action = "booleanoptional"
        action = ACTIONS.get(action, action)
        tnode = kw.get("type")
        tname = (tnode.id if isinstance(tnode, ast.Name) else
                 tnode.attr if isinstance(tnode, ast.Attribute) else None)
        nargs = _literal(kw["nargs"]) if "nargs" in kw else (
            0 if action in ("storetrue", "storefalse", "storeconst", "booleanoptional")
            else None)
        default = _literal(kw["default"]) if "default" in kw else (
            False if action == "storetrue" else True if action == "storefalse" else None)
        long = [f for f in flags if f.startswith("--")]
        out.append(dict(flags=long, dest=_literal(kw["dest"]) if "dest" in kw else
                        long[0][2:].replace("-", "_"), default=default, action=action,
                        type=tname, nargs=nargs,
                        choices=_literal(kw["choices"]) if "choices" in kw else None,
                        group="", source=f"{path}:{node.lineno}", parser="removed"))
    return out


def removed_flags(mirror: str, snapshot: str) -> dict:
    """``{"repository", "snapshot_commit", "releases", "flags"}``: the flags of ``mirror``'s
    releases that ``snapshot`` (a megatron_flags.json) lacks."""
    with open(snapshot, encoding="utf-8") as fh:
        snap = json.load(fh)
    current = {s: f for f in snap["flags"] for s in f["flags"]}
    tags = release_tags(mirror)
    seen: dict = {}
    values: dict = {}  # (first spelling, value) -> [first release, last release]
    for tag in tags:
        for path in FILES:
            try:
                text = _git(mirror, "show", f"{tag}:{path}")
            except subprocess.CalledProcessError:
                continue
            for rec in declared(text, path):
                now = next((current[s] for s in rec["flags"] if s in current), None)
                if now is not None:  # still a flag: the values it no longer takes
                    for v in rec["choices"] or ():
                        if v is not None and now["choices"] is not None and \
                                v not in _choice_values(now["choices"]):
                            key = (now["flags"][0], v)
                            values[key] = [values.get(key, [tag])[0], tag]
                    continue
                key = rec["flags"][0]
                first = seen.get(key, {}).get("releases", [tag])[0]
                rec["releases"] = [first, tag]
                rec["source"] = f"{tag}:{rec['source']}"
                seen[key] = rec
            break
    return {"repository": "NVIDIA/Megatron-LM", "snapshot_commit": snap["commit"],
            "releases": tags, "flags": sorted(seen.values(), key=lambda r: r["flags"][0]),
            "values": [{"flag": f, "value": v, "releases": r}
                       for (f, v), r in sorted(values.items(), key=lambda kv: str(kv[0]))]}


def _choice_values(choices: list) -> set:
    """A snapshot flag's choices as given on the command line (an enum by its name)."""
    return {c["enum"].split(".", 1)[1] if isinstance(c, dict) and "enum" in c else c
            for c in choices}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mirror", help="a Megatron-LM git directory with its release tags")
    ap.add_argument("--snapshot", default=os.path.join("loom", "config", "megatron_flags.json"))
    ap.add_argument("--out", default=os.path.join("loom", "config",
                                                  "megatron_removed_flags.json"))
    args = ap.parse_args(argv)
    data = removed_flags(args.mirror, args.snapshot)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")
    print(f"{len(data['flags'])} flags and {len(data['values'])} values of "
          f"{len(data['releases'])} releases absent from {data['snapshot_commit'][:7]} -> "
          f"{args.out}")


if __name__ == "__main__":
    main()
