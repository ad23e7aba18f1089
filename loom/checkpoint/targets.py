"""Outputs a user made are never replaced silently (``loom preprocess``, ``loom checkpoint
convert --to-hf`` / ``--from-hf``).

Torch-free. Each command checks its target before it writes anything (and before any slow
work): an existing target is refused unless ``--overwrite``; a training checkpoint root (a
directory holding ``iter_N`` directories or a ``latest`` pointer), or any directory inside one,
is refused even with ``--overwrite``: other files there would be taken for, or replace, the
training's checkpoints. A refusal is a :class:`~loom.errors.ConfigError` (one line, exit 2).
"""

from __future__ import annotations

import os
import re
from typing import Optional, Sequence

from loom.checkpoint.safety import LATEST, read_pointer
from loom.errors import ConfigError

_ITER_ANY = re.compile(r"^iter_(\d+)(\.tmp)?$")


def held_iterations(directory: str) -> list[int]:
    """Iterations that make ``directory`` a checkpoint root: its ``iter_N`` (and partial
    ``iter_N.tmp``) directories and the iteration its ``latest`` pointer names (-1 for an
    unreadable pointer); empty for any other directory."""
    try:
        names = os.listdir(directory)
    except OSError:  # absent, not a directory, or unreadable: nothing loom could tell apart
        return []
    found = set()
    for name in names:
        m = _ITER_ANY.match(name)
        if m and os.path.isdir(os.path.join(directory, name)):
            found.add(int(m.group(1)))
    if os.path.lexists(os.path.join(directory, LATEST)):
        try:
            pointer = read_pointer(directory)
        except ConfigError:
            pointer = -1
        found.add(-1 if pointer is None else pointer)
    return sorted(found)


def checkpoint_root_of(path: str) -> Optional[str]:
    """The checkpoint root ``path`` is, or lies inside (``path`` or an ancestor holds
    ``iter_N`` directories or a ``latest`` pointer); None when there is none."""
    here = os.path.abspath(path)
    while True:
        if held_iterations(here):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def _describe(root: str) -> str:
    its = [i for i in held_iterations(root) if i >= 0]
    what = f"iterations {', '.join(map(str, its))}" if its else f"a {LATEST}"
    return f"{root} is a training checkpoint directory ({what})"


def refuse_checkpoint_root(path: str, label: str, allow_import: bool = False) -> None:
    """Refuse writing ``path`` (a file or directory) into a training checkpoint root, even with
    ``--overwrite``. ``allow_import``: ``path`` itself may be a root holding only iteration 0
    (an earlier ``--from-hf`` import, which ``--overwrite`` replaces). Raises ConfigError
    starting with ``label`` (e.g. "--output-prefix data/x") and naming the root."""
    root = checkpoint_root_of(path)
    if root is None:
        return
    if allow_import and root == os.path.abspath(path) and held_iterations(root) == [0]:
        return
    raise ConfigError(f"{label}: {_describe(root)}; writing there could replace or be taken "
                      f"for its checkpoints, so loom refuses it even with --overwrite: choose "
                      f"a path outside it")


def refuse_existing(paths: Sequence[str], label: str, overwrite: bool, what: str,
                    choose: str) -> None:
    """Refuse replacing ``paths`` that exist unless ``overwrite`` (``--overwrite``). Raises
    ConfigError: ``LABEL already holds WHAT (the files); ...: CHOOSE, or give --overwrite``."""
    existing = [p for p in paths if os.path.lexists(p)]
    if existing and not overwrite:
        shown = ", ".join(existing[:4]) + (f" and {len(existing) - 4} more"
                                           if len(existing) > 4 else "")
        raise ConfigError(f"{label} already holds {what} ({shown}); loom does not replace it: "
                          f"{choose}, or give --overwrite to replace it")


def directory_entries(directory: str) -> list[str]:
    """The paths inside ``directory`` (none when it is absent or not a directory)."""
    if not os.path.isdir(directory):
        return []
    return [os.path.join(directory, n) for n in sorted(os.listdir(directory))]


def check_output_dir(out_dir: str, label: str, overwrite: bool,
                     allow_import: bool = False) -> None:
    """A ``loom checkpoint convert`` output directory: not inside a training checkpoint root
    (:func:`refuse_checkpoint_root`), not a file, and empty or absent unless ``overwrite``.
    Raises ConfigError starting with ``label`` (e.g. "--to-hf output hf/")."""
    refuse_checkpoint_root(out_dir, label, allow_import=allow_import)
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"{label} is a file, not a directory; choose an output directory")
    refuse_existing(directory_entries(out_dir), label, overwrite, "files",
                    "choose another (or an empty) output directory")
