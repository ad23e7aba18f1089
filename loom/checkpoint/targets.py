"""Outputs a user made are never replaced silently (``loom preprocess``, ``loom checkpoint
convert --to-hf`` / ``--from-hf``).

Torch-free. Each command checks its target before it writes anything (and before any slow
work): an existing target is refused unless ``--overwrite``; a training checkpoint root (a
directory holding ``iter_N`` directories or a ``latest`` pointer), or any directory inside one,
is refused even with ``--overwrite``: other files there would be taken for, or replace, the
training's checkpoints. A refusal is a :class:`~loom.errors.ConfigError` (one line, exit 2).
The rules themselves live in :mod:`loom.paths` (``loom preprocess`` uses them below the
checkpoint package) and are re-exported here; this module adds the convert output directory.
"""

from __future__ import annotations

import os

from loom.errors import ConfigError
from loom.paths import (checkpoint_root_of, held_iterations,  # noqa: F401 - re-exported
                        refuse_checkpoint_root, refuse_existing)


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
