"""Megatron's non-persistent global checkpoints (``--non-persistent-save-interval``,
``--non-persistent-ckpt-type global``, ``--non-persistent-global-ckpt-dir``;
``megatron/training/checkpointing.py``): between the regular saves, a checkpoint every
``--non-persistent-save-interval`` iterations into ``--non-persistent-global-ckpt-dir``
(default ``--save``/non_persistent), of which only the newest is kept; a resume loads it when
it is at least as new as ``--load``'s latest checkpoint (``--load``/non_persistent by default,
as Megatron reads it). The format is loom's own, with the same checksums and atomic pointer as
every checkpoint. Megatron's ``local`` (node-local, nvidia-resiliency-ext) and ``in_memory``
types are refused by the flag table. Torch-free.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from loom.paths import non_persistent_dir, read_pointer  # noqa: F401 (the trainer's)


def due(ck: Any, iteration: int) -> bool:
    """Whether iteration ``iteration`` saves a non-persistent checkpoint (a regular save at the
    same iteration takes its place, as in Megatron)."""
    return bool(ck.save and ck.non_persistent_save_interval and
                ck.non_persistent_ckpt_type == "global" and
                iteration % ck.non_persistent_save_interval == 0)


def newer_source(ck: Any) -> Optional[tuple[str, int, Optional[int]]]:
    """``(directory, its iteration, --load's iteration or None)`` when the non-persistent
    checkpoint beside ``--load`` is at least as new as ``--load``'s latest (Megatron loads it
    then); None otherwise, without ``--load``, or with ``--ckpt-step`` (an explicit step of
    ``--load``). Raises ConfigError naming a pointer file that is unreadable."""
    if not ck.load or ck.ckpt_step is not None:
        return None
    path = non_persistent_dir(ck, ck.load)
    if path is None or os.path.realpath(path) == os.path.realpath(ck.load):
        return None
    mine = read_pointer(path)
    if mine is None:
        return None
    theirs = read_pointer(ck.load)
    return (path, mine, theirs) if theirs is None or mine >= theirs else None
