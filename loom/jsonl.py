"""JSON Lines (one JSON value per line, https://jsonlines.org), read with errors that name the
file and the line: the loop that loom's JSON inputs share (``loom preprocess --input``, SFT
conversations, ``--eval-data``, ``loom train --log-json`` files). What a value must hold is the
caller's to check."""

from __future__ import annotations

import json
from typing import Iterable, Iterator

from loom.errors import ConfigError


def json_lines(numbered: Iterable[tuple[int, str]], where: str,
               hint: str = "") -> Iterator[tuple[int, object]]:
    """``(line number, value)`` of each non-blank line of ``numbered`` (``(number, text)``
    pairs, e.g. ``enumerate(file, 1)``). Raises ConfigError ``"{where}: line {n} is not JSON
    ({reason}){hint}"`` at the first line that does not parse."""
    for n, line in numbered:
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: line {n} is not JSON ({e.msg}){hint}") from None
        yield n, value
