"""The one way a configuration field is declared: its default, help text and bounds."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, **bounds: Any) -> Any:  # noqa: A002 - argparse's word
    """A dataclass field with its help text and numeric bounds (``ge``, ``gt``, ``lt``; and
    ``auto=True`` where the flag also accepts the word ``auto``)."""
    return field(default=default, metadata={"help": help, **bounds})
