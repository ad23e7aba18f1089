"""Reading the documents of ``.txt`` / ``.jsonl`` inputs (``loom preprocess``, tokenizer training).

``.jsonl``: one JSON object per line; the ``--json-keys`` fields, joined by a blank line when
several, form one document. ``.txt``: documents separated by lines holding only
``<|endoftext|>`` when the file has such lines, else each non-empty line is one document. Input
that is not UTF-8 text (or holds NUL bytes, as binary files do) is refused naming the file and
the line.
"""

from __future__ import annotations

import itertools
import os
from typing import Iterator, Sequence

from loom.errors import ConfigError
from loom.jsonl import json_lines

EOD_TOKEN = "<|endoftext|>"
MAX_DOCUMENT_BYTES = 8 << 20  # one line (document) at most; --max-document-bytes


def _decode(raw: bytes, path: str, line: int) -> str:
    if b"\x00" in raw:
        raise ConfigError(f"--input {path}: line {line} holds NUL bytes; this looks like a binary "
                          f"file, give UTF-8 .txt or .jsonl text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--input {path}: line {line} is not UTF-8 (byte 0x{raw[e.start]:02x} "
                          f"at column {e.start + 1}); convert the file to UTF-8") from None


def _lines(path: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line, streamed: one line in memory at a time, and a line
    longer than ``max_bytes`` refused naming it before more of it is read."""
    try:
        with open(path, "rb") as f:
            n = 0
            while True:
                raw = f.readline(max_bytes + 1)
                if not raw:
                    return
                n += 1
                if len(raw) > max_bytes and not raw.endswith(b"\n"):
                    raise ConfigError(
                        f"--input {path}: line {n} is longer than {max_bytes} bytes "
                        f"(--max-document-bytes); split the document, or raise the limit "
                        f"(memory grows with it)")
                yield n, _decode(raw, path, n)
    except OSError as e:
        raise ConfigError(f"--input {path}: cannot read ({e.strerror})") from None


def _field(obj, key: str, path: str, n: int, json_keys: Sequence[str]) -> str:
    """``obj[key]``, which must be a string (never tokenized as a Python repr)."""
    try:
        value = obj[key]
    except (KeyError, TypeError, IndexError):
        raise ConfigError(f"--json-keys {' '.join(json_keys)}: line {n} of {path} lacks one of "
                          f"them; its keys are "
                          f"{list(obj) if isinstance(obj, dict) else type(obj).__name__}") from None
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise ConfigError(f"--input {path}: line {n}: {key!r} is {kind}, not a string; give "
                          f"text (or drop the line)")
    return value


def read_documents(path: str, json_keys: Sequence[str] = ("text",),
                   max_bytes: int = MAX_DOCUMENT_BYTES) -> Iterator[str]:
    """Yield the documents (str) of one ``.txt`` or ``.jsonl`` file (see module doc); empty ones
    skipped. Streamed: memory holds one line (at most ``max_bytes``) and one document.

    Raises ConfigError naming ``--input`` and the line (missing file, unknown extension, bad JSON
    line, a field that is not a string, a line over ``max_bytes``, not UTF-8, binary) or
    ``--json-keys`` (key absent from a JSON line).
    """
    path = str(path)
    if not os.path.isfile(path):
        raise ConfigError(f"--input {path}: no such file")
    if path.endswith(".jsonl") or path.endswith(".json"):
        for n, obj in json_lines(_lines(path, max_bytes), f"--input {path}",
                                 "; give one JSON object per line"):
            if not isinstance(obj, dict):
                kind = "null" if obj is None else type(obj).__name__
                raise ConfigError(f"--input {path}: line {n} is a JSON {kind}, not an object "
                                  f"with a {json_keys[0]!r} string")
            text = "\n\n".join(_field(obj, k, path, n, json_keys) for k in json_keys)
            if text.strip():
                yield text
    elif path.endswith(".txt") or path.endswith(".utf8"):
        separated = any(ln.strip() == EOD_TOKEN for _, ln in _lines(path, max_bytes))
        if separated:  # a second streamed pass: documents between <|endoftext|> lines
            doc: list[str] = []
            size = 0
            for n, ln in itertools.chain(_lines(path, max_bytes), [(0, EOD_TOKEN)]):
                if ln.strip() == EOD_TOKEN:
                    d = "\n".join(doc).strip()
                    if d:
                        yield d
                    doc, size = [], 0
                else:
                    size += len(ln)
                    if size > max_bytes:
                        raise ConfigError(
                            f"--input {path}: the document ending at line {n} is longer than "
                            f"{max_bytes} bytes (--max-document-bytes); split it, or raise the "
                            f"limit (memory grows with it)")
                    doc.append(ln.rstrip("\n"))
        else:
            for _, ln in _lines(path, max_bytes):
                if ln.strip():
                    yield ln.rstrip("\n").rstrip("\r")
    else:
        raise ConfigError(f"--input {path}: unknown file type; give .txt or .jsonl files")
