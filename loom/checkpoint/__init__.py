"""Checkpoints: atomic save, load at any TP/PP layout; directories checked before the first step
(:mod:`loom.checkpoint.safety`: never rewound or overwritten); one job per ``--save``
(:mod:`loom.checkpoint.lock`); outputs a user made never replaced silently
(:mod:`loom.checkpoint.targets`).

The names below are imported on first use, so the torch-free modules (``safety``, ``lock``,
``targets``) stay torch-free (``loom preprocess`` imports them).
"""

from __future__ import annotations

import importlib

_IO = ("latest_checkpoint", "load_checkpoint", "read_common", "save_checkpoint")
_SAFETY = ("check_save_dir", "remove_partial_checkpoints", "resolve_checkpoint")
__all__ = sorted(_IO + _SAFETY)


def __getattr__(name: str):
    """``loom.checkpoint.NAME`` for the names of ``__all__`` (imported on first use)."""
    if name in _IO:
        return getattr(importlib.import_module("loom.checkpoint.io"), name)
    if name in _SAFETY:
        return getattr(importlib.import_module("loom.checkpoint.safety"), name)
    raise AttributeError(f"module 'loom.checkpoint' has no attribute {name!r}")
