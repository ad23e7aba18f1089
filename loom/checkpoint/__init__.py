"""Checkpoints: atomic save, load at any TP/PP layout."""

from loom.checkpoint.io import (latest_checkpoint, load_checkpoint, read_common,  # noqa: F401
                                save_checkpoint)
