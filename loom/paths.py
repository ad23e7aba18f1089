"""Where loom's outputs live on disk, and the rules that keep them from being lost. Torch-free and
importing nothing of loom but :mod:`loom.errors`, so every layer can use it (``loom preprocess``
refuses writing into a checkpoint root; ``loom train`` checks ``--load`` and ``--save`` before
any process group exists).

A checkpoint root (``--save`` / ``--load``) holds ``iter_NNNNNNN`` directories (one per saved
iteration; complete when it holds ``metadata.json`` and ``common.pt``; ``iter_N.tmp`` while
being written) and the pointer ``latest_checkpointed_iteration.txt`` naming the last complete
one. :func:`resolve_checkpoint` picks the checkpoint ``--load`` names. Outputs a user made are
never replaced silently: :func:`refuse_existing` (unless ``--overwrite``) and
:func:`refuse_checkpoint_root` (a training checkpoint root, or any directory inside one, is
refused even with ``--overwrite``: other files there would be taken for, or replace, its
checkpoints). Every refusal is a :class:`~loom.errors.ConfigError` (one line, exit 2).
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional, Sequence

from loom.errors import ConfigError

LATEST = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"^iter_(\d+)$")
_ITER_ANY = re.compile(r"^iter_(\d+)(\.tmp)?$")


def iteration_dir(root: str, iteration: int) -> str:
    """``ROOT/iter_NNNNNNN``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def is_complete(path: str) -> bool:
    """A finished checkpoint directory: it holds ``metadata.json`` and ``common.pt``."""
    return all(os.path.isfile(os.path.join(path, f)) for f in ("metadata.json", "common.pt"))


def saved_iterations(root: str, complete_only: bool = False) -> list[int]:
    """Sorted iterations of the ``iter_NNNNNNN`` directories under ``root`` (none if absent)."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _ITER.match(name)
        if m and os.path.isdir(os.path.join(root, name)) and (
                not complete_only or is_complete(os.path.join(root, name))):
            out.append(int(m.group(1)))
    return sorted(out)


def available_checkpoints(root: str) -> str:
    """``complete checkpoints there: 1, 2`` (or ``no complete checkpoint there``) for messages."""
    its = saved_iterations(root, complete_only=True)
    return f"complete checkpoints there: {', '.join(map(str, its))}" if its else \
        "no complete checkpoint there"


def read_pointer(root: str) -> Optional[int]:
    """The iteration in ``ROOT/latest_checkpointed_iteration.txt``; None when the file is absent.

    Raises ConfigError naming the file when it is unreadable or holds no iteration number.
    """
    path = os.path.join(root, LATEST)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read().strip()
        iteration = int(text)
        if iteration < 0:
            raise ValueError(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) else "it does not hold an iteration number"
        raise ConfigError(
            f"checkpoint pointer {path} is unreadable ({why}); {available_checkpoints(root)}: give "
            f"--ckpt-step N to load one of them, or repair the file") from None
    return iteration


def resolve_checkpoint(root: str, step: Optional[int] = None) -> Optional[str]:
    """The checkpoint directory to load from ``root`` (``--load``), or None for a fresh start.

    ``step`` (``--ckpt-step``) selects ``iter_{step}`` explicitly, ignoring the pointer. Returns
    None only when ``root`` holds no checkpoint at all (absent, or no ``iter_*`` and no pointer).
    Raises ConfigError naming the file when ``root`` is not a directory, the pointer is
    unreadable or names a missing/incomplete iteration, a pointer is missing beside saved
    iterations, or ``step`` names no complete checkpoint.
    """
    if os.path.exists(root) and not os.path.isdir(root):
        raise ConfigError(f"--load {root} is a file, not a checkpoint directory")
    if step is not None:
        path = iteration_dir(root, step)
        if not is_complete(path):
            raise ConfigError(f"--ckpt-step {step}: {path} is not a complete checkpoint; "
                              f"{available_checkpoints(root)}")
        return path
    iteration = read_pointer(root)
    if iteration is None:
        its = saved_iterations(root)
        if its:
            raise ConfigError(
                f"--load {root} holds iter_* directories ({', '.join(map(str, its))}) but no "
                f"{LATEST}: give --ckpt-step N to choose one, or restore the pointer")
        return None
    path = iteration_dir(root, iteration)
    if not is_complete(path):
        raise ConfigError(
            f"checkpoint pointer {os.path.join(root, LATEST)} names iteration {iteration}, but "
            f"{path} is {'incomplete' if os.path.isdir(path) else 'missing'}; "
            f"{available_checkpoints(root)}: give --ckpt-step N to load one of them, or restore "
            f"{path}")
    return path


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


NON_PERSISTENT = "non_persistent"
"""Megatron's ``_NON_PERSISTENT_CKPT_SUBDIR``: the non-persistent checkpoints' directory in a root
(:mod:`loom.training.non_persistent`)."""


def non_persistent_dir(ck: Any, root: Optional[str]) -> Optional[str]:
    """The global non-persistent directory of a CheckpointConfig ``ck`` beside checkpoint root
    ``root`` (``--save`` when saving, ``--load`` when loading): ``--non-persistent-global-ckpt-dir``,
    else ``root``/non_persistent; None without ``--non-persistent-ckpt-type global``."""
    if ck.non_persistent_ckpt_type != "global":
        return None
    if ck.non_persistent_global_ckpt_dir:
        return ck.non_persistent_global_ckpt_dir
    return os.path.join(root, NON_PERSISTENT) if root else None
