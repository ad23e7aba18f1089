"""Reading the documents of ``.txt`` / ``.jsonl`` inputs (``loom preprocess``, tokenizer training).

``.jsonl``: one JSON object per line; the ``--json-keys`` fields, joined by a blank line when
several, form one document. ``.txt``: documents separated by lines holding only
``<|endoftext|>`` when the file has such lines, else each non-empty line is one document. Input
that is not UTF-8 text (or holds NUL bytes, as binary files do) is refused naming the file and
the line.
"""

from __future__ import annotations

import json
import os
from typing import Iterator, Sequence

from loom.errors import ConfigError

EOD_TOKEN = "<|endoftext|>"


def _decode(raw: bytes, path: str, line: int) -> str:
    if b"\x00" in raw:
        raise ConfigError(f"--input {path}: line {line} holds NUL bytes; this looks like a binary "
                          f"file, give UTF-8 .txt or .jsonl text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--input {path}: line {line} is not UTF-8 (byte 0x{raw[e.start]:02x} "
                          f"at column {e.start + 1}); convert the file to UTF-8") from None


def _lines(path: str) -> Iterator[tuple[int, str]]:
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                yield n, _decode(raw, path, n)
    except OSError as e:
        raise ConfigError(f"--input {path}: cannot read ({e.strerror})") from None


def read_documents(path: str, json_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Yield the documents (str) of one ``.txt`` or ``.jsonl`` file (see module doc); empty ones
    skipped.

    Raises ConfigError naming ``--input`` and the line (missing file, unknown extension, bad JSON
    line, not UTF-8, binary) or ``--json-keys`` (key absent from a JSON line).
    """
    path = str(path)
    if not os.path.isfile(path):
        raise ConfigError(f"--input {path}: no such file")
    if path.endswith(".jsonl") or path.endswith(".json"):
        for n, line in _lines(path):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--input {path}: line {n} is not JSON ({e}); give one JSON object "
                                  f"per line") from None
            try:
                text = "\n\n".join(str(obj[k]) for k in json_keys)
            except (KeyError, TypeError):
                raise ConfigError(f"--json-keys {' '.join(json_keys)}: line {n} of {path} lacks one of "
                                  f"them; its keys are "
                                  f"{list(obj) if isinstance(obj, dict) else type(obj).__name__}") from None
            if text.strip():
                yield text
    elif path.endswith(".txt") or path.endswith(".utf8"):
        lines = [ln.rstrip("\n") for _, ln in _lines(path)]
        if any(ln.strip() == EOD_TOKEN for ln in lines):
            doc: list[str] = []
            for ln in lines + [EOD_TOKEN]:
                if ln.strip() == EOD_TOKEN:
                    d = "\n".join(doc).strip()
                    if d:
                        yield d
                    doc = []
                else:
                    doc.append(ln)
        else:
            for ln in lines:
                if ln.strip():
                    yield ln.rstrip("\r")
    else:
        raise ConfigError(f"--input {path}: unknown file type; give .txt or .jsonl files")
