"""The one way a configuration field is declared (its default, help text and bounds) and named
on the command line (:func:`flag`)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, **bounds: Any) -> Any:  # noqa: A002 - argparse's word
    """A dataclass field with its help text and numeric bounds (``ge``, ``gt``, ``lt``, ``le``; and
    ``auto=True`` where the flag also accepts the word ``auto``; ``zero_is_off=True`` where
    Megatron reads 0 as the feature off (``if args.exit_interval and ...``), which loom stores
    as None; ``spellings``: more
    spellings of a command's option; Megatron's other spellings of a config field, e.g.
    ``--use-checkpoint-opt_param-scheduler``, are rows of the flag table)."""
    return field(default=default, metadata={"help": help, **bounds})


def flag(name: str) -> str:
    """``tensor_model_parallel_size`` -> ``--tensor-model-parallel-size``."""
    return "--" + name.replace("_", "-")
