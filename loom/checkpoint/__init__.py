"""Checkpoints: atomic save, load at any TP/PP layout; directories checked before the first step
(:mod:`loom.checkpoint.safety`: never rewound or overwritten)."""

from loom.checkpoint.io import (latest_checkpoint, load_checkpoint, read_common,  # noqa: F401
                                save_checkpoint)
from loom.checkpoint.safety import (check_save_dir, remove_partial_checkpoints,  # noqa: F401
                                    resolve_checkpoint)
