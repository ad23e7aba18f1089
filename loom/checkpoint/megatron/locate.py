"""Which directory is a Megatron-LM / Megatron-Core checkpoint, and which iteration of it to
read. Torch-free (``loom train`` runs it before any process group).

Megatron-LM's training loop (``megatron/training/checkpointing.py``) writes under ``--save``::

    latest_checkpointed_iteration.txt        the iteration number, or "release"
    iter_0000100/  (or release/)             one saved iteration

and inside an iteration directory, by ``--ckpt-format``:

- ``torch_dist`` (its default): a ``dist_checkpointing`` directory, also what Megatron-Core's
  ``dist_checkpointing.save`` writes anywhere: ``metadata.json`` (``{"sharded_backend":
  "torch_dist", ...}``), ``common.pt`` (args, iteration, the optimizer's param groups, ...),
  DCP's ``.metadata`` and ``__R_N.distcp`` files holding global tensors;
- ``torch`` (legacy): ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``, one ``torch.save`` per
  tensor / pipeline / expert rank (``distrib_optim.pt`` beside it with the distributed optimizer);
- ``torch_dcp`` / ``fsdp_dtensor``: plain DCP directories (``.metadata``, no ``metadata.json``).

loom's own checkpoints share the pointer and the ``iter_N`` names but write ``metadata.json``
with ``"format": "loom-checkpoint-v2"`` (or ``model_tp*_pp*.pt`` files, v1), so the contents
tell them apart. :func:`locate` answers for a ``--load`` path; :func:`diagnose` gives the one
line for a directory that is neither loom's nor a readable Megatron checkpoint.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Optional

from loom.errors import ConfigError

POINTER = "latest_checkpointed_iteration.txt"
TORCH_DIST, TORCH = "torch_dist", "torch"
_MP_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_ITER = re.compile(r"^iter_(\d+)$")


@dataclass(frozen=True)
class Found:
    """A Megatron checkpoint: ``path`` (the iteration directory), ``format`` (``torch_dist`` or
    ``torch``), ``iteration`` (from the directory name; None for ``release`` or a bare
    directory: then ``common.pt`` / the files say), ``root`` (the ``--load`` directory)."""

    path: str
    format: str
    iteration: Optional[int]
    root: str


def _json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as fh:
            out = json.load(fh)
        return out if isinstance(out, dict) else None
    except (OSError, ValueError):
        return None


def mp_rank_dirs(path: str) -> dict[tuple[int, int, int], str]:
    """``{(tp, pp, ep): directory}`` of the ``mp_rank_*`` directories of ``path`` that hold a
    ``model_optim_rng.pt`` (``torch`` format)."""
    out = {}
    try:
        names = os.listdir(path)
    except OSError:
        return out
    for name in names:
        m = _MP_RANK.match(name)
        if m and os.path.isfile(os.path.join(path, name, "model_optim_rng.pt")):
            out[(int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0))] = \
                os.path.join(path, name)
    return out


def format_of(path: str) -> Optional[str]:
    """``torch_dist`` or ``torch`` when ``path`` is a Megatron checkpoint directory (one
    iteration), else None (loom's, empty, or something else)."""
    meta = _json(os.path.join(path, "metadata.json"))
    if meta is not None and "sharded_backend" in meta:
        return TORCH_DIST
    if mp_rank_dirs(path):
        return TORCH
    return None


def _iteration_of(name: str) -> Optional[int]:
    m = _ITER.match(name)
    return int(m.group(1)) if m else None


def _read_pointer(root: str) -> Optional[str]:
    """The pointer's text (``"100"``, ``"release"``), None when absent or unreadable."""
    try:
        with open(os.path.join(root, POINTER), encoding="utf-8") as fh:
            return fh.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def locate(path: str, step: Optional[int] = None) -> Optional[Found]:
    """The Megatron checkpoint ``--load path`` (``--ckpt-step step``) names, or None when
    ``path`` is not one (a loom checkpoint, a fresh directory, ...: loom's own rules apply).

    ``path`` may be a checkpoint root (pointer + ``iter_N/`` or ``release/``), one iteration
    directory, or a bare ``dist_checkpointing`` directory. Raises ConfigError when ``step``
    names an iteration the root lacks while the root holds Megatron checkpoints."""
    path = os.path.normpath(path)
    if not os.path.isdir(path):
        return None
    here = format_of(path)
    if here is not None and step is None:
        return Found(path, here, _iteration_of(os.path.basename(path)), path)
    if step is not None:
        target = os.path.join(path, f"iter_{step:07d}")
        fmt = format_of(target)
        if fmt is not None:
            return Found(target, fmt, step, path)
        if _megatron_iterations(path):
            raise ConfigError(f"--ckpt-step {step}: {target} is not a Megatron checkpoint; "
                              f"iterations there: {_megatron_iterations(path)}")
        return None
    pointer = _read_pointer(path)
    if pointer is None:
        return None
    name = "release" if pointer == "release" else \
        f"iter_{int(pointer):07d}" if pointer.isdigit() else None
    target = os.path.join(path, name) if name else None
    fmt = format_of(target) if target else None
    if fmt is not None:
        return Found(target, fmt, None if name == "release" else int(pointer), path)
    its = _megatron_iterations(path)
    if its:  # a Megatron root whose pointer names nothing readable
        raise ConfigError(f"checkpoint pointer {os.path.join(path, POINTER)} names "
                          f"{pointer!r}, which is not a Megatron checkpoint there; Megatron "
                          f"iterations there: {its}: give --ckpt-step N to load one")
    return None


def _megatron_iterations(root: str) -> list[int]:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(i for i in map(_iteration_of, names)
                  if i is not None and format_of(os.path.join(root, f"iter_{i:07d}")))


_TT_STEP = re.compile(r"^step-(\d+)$")


def torchtitan_steps(path: str) -> list[int]:
    """The steps of the torchtitan checkpoints in ``path`` (its ``step-N`` DCP directories,
    torchtitan's ``[checkpoint] folder``), oldest first; [] when there are none."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_TT_STEP.match, names)
                  if m and os.path.isfile(os.path.join(path, m.group(0), ".metadata")))


def _torchtitan(step_dir: str) -> str:
    return (f"{step_dir} is a torchtitan checkpoint (torch.distributed.checkpoint of "
            f"torchtitan's names): convert it with `loom checkpoint convert --from-torchtitan "
            f"JOB.toml {step_dir} OUT`, then --load OUT")


def diagnose(path: str) -> Optional[str]:
    """One line saying what ``path`` (a directory that loom's own reader could not use) is, when
    it can be told: a Megatron checkpoint in a format loom does not read, a damaged Megatron
    directory, a torchtitan checkpoint (a ``step-N`` DCP directory, or the folder of them: the
    newest named), a DCP directory of another program. None when nothing is recognized."""
    if not os.path.isdir(path):
        return None
    files = set(os.listdir(path))
    steps = torchtitan_steps(path)
    if steps:
        return _torchtitan(os.path.join(path, f"step-{steps[-1]}"))
    if ".metadata" in files and _TT_STEP.match(os.path.basename(os.path.normpath(path))) \
            and "metadata.json" not in files and "common.pt" not in files:
        return _torchtitan(os.path.normpath(path))
    meta = _json(os.path.join(path, "metadata.json")) if "metadata.json" in files else None
    if meta is not None and "sharded_backend" in meta:
        missing = [f for f in (".metadata", "common.pt") if f not in files]
        if missing:
            return (f"{path} is a Megatron dist-checkpoint ({meta.get('sharded_backend')}) "
                    f"missing {', '.join(missing)}: its save did not finish; load another "
                    f"iteration")
    if ".metadata" in files and meta is None and "common.pt" not in files:
        return (f"{path} is a torch.distributed.checkpoint directory without metadata.json or "
                f"common.pt: Megatron's --ckpt-format torch_dcp / fsdp_dtensor, or another "
                f"program's; loom reads Megatron's torch_dist and torch formats (re-save it "
                f"with --ckpt-format torch_dist)")
    ranks = [f for f in files if _MP_RANK.match(f)]
    empty = [f for f in ranks if not os.path.isfile(os.path.join(path, f, "model_optim_rng.pt"))]
    if empty:
        return (f"{path} holds {', '.join(sorted(empty)[:3])} without model_optim_rng.pt: a "
                f"damaged Megatron --ckpt-format torch checkpoint")
    return None
