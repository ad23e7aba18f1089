"""Evaluation data: a token stream from a text file, a jsonl file or an indexed dataset, cut into
Megatron's sliding windows; LAMBADA-format cloze examples.

Semantics follow Megatron-LM's ``tasks/zeroshot_gpt/datasets.py``:

* **Windows** (``_LMDataset``): window ``i`` starts at token ``i x stride`` and holds
  ``seq_length + 1`` tokens (inputs and shifted labels), padded with the end-of-document id at
  the end of the stream. The first window scores all its targets; every later one only its last
  ``stride`` (``--overlapping-eval``), so each of the ``N - 1`` targets of an ``N``-token stream
  is scored exactly once, with up to ``seq_length - stride`` tokens of context before it.
  Windows that would score nothing (past the end) are dropped.
* **Word count** (``num_original_tokens``): ``len(text.strip().split(" "))``, Megatron's count
  of WikiText-103's space-separated words (a newline between two spaces counts as a word, as
  in WikiText's ``" \\n "``), summed over documents.
* **Cloze** (``_LambadaDataset``): by default the target is the last token of the text; with
  ``--strict-lambada`` the last whitespace-separated word, tokenized as ``" " + word`` after the
  context ``text[:start].strip()``. A context longer than the window is cut from the left.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from loom.errors import ConfigError
from loom.jsonl import json_lines


@dataclass(frozen=True)
class Sample:
    """One row of a micro-batch: ``inputs``, ``labels`` (int32), ``mask`` (int8; 1: this
    position's label counts), each a numpy array of ``seq_length``; ``padding`` (optional, 1 =
    a real token, 0 = padding) for the bidirectional families (the batch's ``padding_mask``)."""

    inputs: np.ndarray
    labels: np.ndarray
    mask: np.ndarray
    padding: Optional[np.ndarray] = None


def make_sample(ids, mask) -> Sample:
    """A :class:`Sample` from ``seq_length + 1`` token ids and ``seq_length`` mask values."""
    ids = np.asarray(ids, dtype=np.int32)
    return Sample(ids[:-1], ids[1:], np.asarray(mask, dtype=np.int8))


@dataclass(frozen=True)
class TextStream:
    """The evaluation text as one token stream, and Megatron's word count of its original
    text (None when there is no original text to count)."""

    tokens: list
    words: int
    documents: int
    source: str


def megatron_word_count(text: str) -> int:
    """Megatron's ``num_original_tokens`` of ``text``: ``len(text.strip().split(" "))``."""
    return len(text.strip().split(" "))


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read ({e.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{flag} {path}: line {line} is not UTF-8 text; convert the file to "
                          f"UTF-8") from None


def read_jsonl(path: str, key: str, flag: str = "--eval-data",
               what: str = "") -> Iterator[tuple[int, str]]:
    """``(line number, obj[key])`` of each non-blank line of a jsonl file. Raises ConfigError
    naming the file and the line: not JSON, not an object, ``key`` missing or not a string."""
    for n, obj in json_lines(enumerate(_read_text(path, flag).splitlines(), 1),
                             f"{flag} {path}", "; give one JSON object per line"):
        if not isinstance(obj, dict) or key not in obj:
            keys = list(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ConfigError(f"{flag} {path}: line {n} has no {key!r} key (it has {keys}){what}")
        if not isinstance(obj[key], str):
            raise ConfigError(f"{flag} {path}: line {n}: {key!r} is a "
                              f"{type(obj[key]).__name__}, not a string")
        yield n, obj[key]


def _is_jsonl(path: str) -> bool:
    return path.endswith(".jsonl") or path.endswith(".json")


def read_stream(path: str, tokenizer, json_key: str = "text",
                flag: str = "--eval-data") -> TextStream:
    """The token stream of ``path``: a ``.jsonl`` file (each document's ``json_key`` text
    followed by the end-of-document token, as ``loom preprocess`` writes them), an indexed
    dataset prefix (``PREFIX.bin/.idx``: its documents as stored; words counted on their
    decoded text), or any other file read whole as one text (Megatron's WikiText-103)."""
    if os.path.isfile(path) and _is_jsonl(path):
        tokens, words, docs = [], 0, 0
        for _, text in read_jsonl(path, json_key, flag, "; give --json-key KEY"):
            if text.strip():
                tokens += tokenizer.encode(text) + [tokenizer.eod]
                words += megatron_word_count(text)
                docs += 1
        return TextStream(tokens, words, docs, f"{path} (jsonl, key {json_key!r})")
    if os.path.isfile(path):
        text = _read_text(path, flag)
        return TextStream(tokenizer.encode(text), megatron_word_count(text), 1, f"{path} (text)")
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    if os.path.isfile(prefix + ".idx") or os.path.isfile(prefix + ".bin"):
        return _indexed_stream(prefix, tokenizer, flag)
    raise ConfigError(f"{flag} {path}: no such file (nor an indexed dataset {path}.bin/.idx); "
                      f"give a .txt or .jsonl file or a `loom preprocess` prefix")


def _indexed_stream(prefix: str, tokenizer, flag: str) -> TextStream:
    from loom.data.checks import check_dataset
    from loom.data.tokenizer import Tokenizer
    stored = prefix + ".tokenizer.json"
    if os.path.isfile(stored) and Tokenizer.load(stored).to_str() != tokenizer.to_str():
        raise ConfigError(f"{flag} {prefix}: the dataset was tokenized with {stored}, not the "
                          f"model's tokenizer; its token ids would mean other words. Re-run "
                          f"`loom preprocess` with the checkpoint's tokenizer.json")
    ds = check_dataset(prefix, tokenizer.vocab_size, flag)  # an edited .bin: one line
    tokens, words = [], 0
    for i in range(len(ds)):
        doc = [int(t) for t in ds[i]]
        tokens += doc
        text = tokenizer.decode([t for t in doc if t != tokenizer.eod])
        words += megatron_word_count(text) if text.strip() else 0
    return TextStream(tokens, words, ds.num_documents, f"{prefix} (indexed dataset)")


def lm_windows(tokens: list, seq_length: int, stride: int, pad: int) -> list[Sample]:
    """Megatron's sliding windows over ``tokens`` (see the module docstring)."""
    tokens = np.asarray(tokens, dtype=np.int32)
    targets = len(tokens) - 1
    count = max(math.ceil(max(targets - stride, 0) / stride) + 1, 1)
    out = []
    for i in range(count):
        start = i * stride
        real = tokens[start:start + seq_length + 1]
        window = np.full(seq_length + 1, pad, dtype=np.int32)
        window[:len(real)] = real
        mask = np.zeros(seq_length, dtype=np.int8)
        mask[:max(len(real) - 1, 0)] = 1
        if i > 0 and stride != seq_length:
            mask[:seq_length - stride] = 0
        if mask.any():
            out.append(Sample(window[:-1], window[1:], mask))
    return out


def cloze_example(text: str, tokenizer, strict: bool) -> tuple[list, list]:
    """``(context ids, target ids)`` of one LAMBADA text (Megatron's ``get_tokens``)."""
    if not strict:
        ids = tokenizer.encode(text)
        return ids[:-1], ids[-1:]
    last = text.split()[-1]
    start = text.rfind(last)
    return tokenizer.encode(text[:start].strip()), tokenizer.encode(" " + last)


def cloze_samples(path: str, tokenizer, seq_length: int, strict: bool,
                  flag: str = "--eval-data") -> list[Sample]:
    """One sample per line of a LAMBADA-format jsonl file (``{"text": ...}``): the labels of
    the target tokens are masked in. Raises ConfigError naming the file and the line."""
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file; give a LAMBADA-format .jsonl file "
                          f"(one {{\"text\": ...}} object per line)")
    out = []
    hint = "; a cloze file holds one {\"text\": ...} object per line (LAMBADA format)"
    for n, text in read_jsonl(path, "text", flag, hint):
        if not text.split():
            raise ConfigError(f"{flag} {path}: line {n}: the text is empty")
        context, target = cloze_example(text, tokenizer, strict)
        if not context or not target:
            raise ConfigError(f"{flag} {path}: line {n}: nothing precedes the "
                              f"{'last word' if strict else 'last token'} to predict it from")
        if len(target) > seq_length:
            raise ConfigError(f"{flag} {path}: line {n}: the target ({len(target)} tokens) is "
                              f"longer than --seq-length {seq_length}")
        ids = (context + target)[-(seq_length + 1):]
        first = len(ids) - len(target) - 1  # label position of the first target token
        mask = [0] * first + [1] * len(target) + [0] * (seq_length - first - len(target))
        ids += [tokenizer.eod] * (seq_length + 1 - len(ids))
        out.append(make_sample(ids, mask))
    if not out:
        raise ConfigError(f"{flag} {path}: no examples (the file is empty)")
    return out
