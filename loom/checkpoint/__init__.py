"""Checkpoints: atomic save, load at any TP/PP layout; directories checked before the first step
(:mod:`loom.checkpoint.safety`: never rewound or overwritten); one job per ``--save``
(:mod:`loom.checkpoint.lock`); outputs a user made never replaced silently
(:mod:`loom.checkpoint.targets`).

The names below are imported on first use, so the torch-free modules (``safety``, ``lock``,
``targets``) stay torch-free (``loom preprocess`` imports them).
"""

from __future__ import annotations

import importlib

_EXPORTS = {"latest_checkpoint": "io", "load_checkpoint": "io", "read_common": "io",
            "save_checkpoint": "io", "check_save_dir": "safety",
            "remove_partial_checkpoints": "safety", "resolve_checkpoint": "safety"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """``loom.checkpoint.NAME`` for the names of ``__all__`` (imported on first use)."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"loom.checkpoint.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'loom.checkpoint' has no attribute {name!r}")
