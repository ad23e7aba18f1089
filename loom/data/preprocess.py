"""``loom preprocess``: tokenize .txt/.jsonl files into a Megatron indexed dataset.

Writes ``PREFIX.bin``, ``PREFIX.idx``, the tokenizer as ``PREFIX.tokenizer.json`` and
``PREFIX.meta.json`` (``vocab_size``, ``eod``, ``num_documents``, ``num_tokens``, ``dtype``), so
``loom train --data-path PREFIX`` needs no tokenizer flags.

Input formats: ``.jsonl`` (one JSON object per line; the ``--json-keys`` fields, joined by a blank
line when several, form one document); ``.txt``: documents separated by lines holding only
``<|endoftext|>`` when the file has such lines, else each non-empty line is one document.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import multiprocessing
import os
import re
import sys
import time
from typing import Iterator, Optional, Sequence

import numpy as np

from loom.errors import ConfigError
from loom.data.checks import dataset_files
from loom.data.documents import MAX_DOCUMENT_BYTES, read_documents  # noqa: F401 - API
from loom.data.indexed import IndexedDatasetBuilder, best_dtype
from loom.data.tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer
from loom.paths import refuse_checkpoint_root, refuse_existing, resolve_checkpoint

_BATCH = 512


# ---- multiprocessing workers: one tokenizer per worker process, built once from its JSON ----
@functools.lru_cache(maxsize=1)
def _worker_tokenizer(tok_json: str) -> Tokenizer:
    return Tokenizer.from_str(tok_json)


def _encode_batch(tok_json: str, texts: list[str]) -> list[list[int]]:
    return _worker_tokenizer(tok_json).encode_batch(texts)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _batches(inputs: Sequence[str], json_keys: Sequence[str],
             max_bytes: int = MAX_DOCUMENT_BYTES) -> Iterator[list[str]]:
    buf: list[str] = []
    for path in inputs:
        for doc in read_documents(path, json_keys, max_bytes):
            buf.append(doc)
            if len(buf) >= _BATCH:
                yield buf
                buf = []
    if buf:
        yield buf


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def check_output_prefix(prefix: str) -> None:
    """Refuse an ``--output-prefix`` whose directory cannot be created or written (a regular
    file on the path, a read-only directory), that is itself a directory, or that lies inside a
    training checkpoint directory (:func:`loom.paths.refuse_checkpoint_root`).
    Raises ConfigError naming ``--output-prefix``."""
    if not prefix or os.path.isdir(prefix) or prefix.endswith(os.sep):
        raise ConfigError(f"--output-prefix {prefix!r}: give a path prefix such as data/train "
                          f"(files PREFIX.bin, PREFIX.idx, ... are written), not a directory")
    base = os.path.dirname(os.path.abspath(prefix))
    while not os.path.lexists(base):
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        raise ConfigError(f"--output-prefix {prefix}: {base} is a file, not a directory; choose "
                          f"another output prefix")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"--output-prefix {prefix}: {base} is not writable")
    refuse_checkpoint_root(prefix, f"--output-prefix {prefix}")


OUTPUT_SUFFIXES = (".bin", ".idx", ".meta.json", ".tokenizer.json")


def check_new_dataset(prefix: str, overwrite: bool = False) -> None:
    """Refuse an ``--output-prefix`` that already names a dataset (any of ``PREFIX.bin``,
    ``.idx``, ``.meta.json``, ``.tokenizer.json``) unless ``overwrite`` (``--overwrite``), and
    one inside a training checkpoint directory even then. Raises ConfigError naming the files."""
    check_output_prefix(prefix)
    refuse_existing([prefix + ext for ext in OUTPUT_SUFFIXES], f"--output-prefix {prefix}",
                    overwrite, "a dataset", "choose another --output-prefix")


def preprocess(inputs: Sequence[str], output_prefix: str, tokenizer: Tokenizer, append_eod: bool = True,
               workers: int = 1, json_keys: Sequence[str] = ("text",),
               tokenizer_type: Optional[str] = None,
               max_document_bytes: int = MAX_DOCUMENT_BYTES) -> dict:
    """Tokenize ``inputs`` (.txt/.jsonl paths) into ``output_prefix``.{bin,idx,tokenizer.json,meta.json}.

    One indexed-dataset document per input document, in input order, with ``tokenizer.eod``
    appended when ``append_eod``. ``workers > 1`` encodes in a multiprocessing pool.

    Returns the meta dict ``{"vocab_size", "eod", "num_documents", "num_tokens", "dtype", ...}``.
    Raises ConfigError for unreadable inputs (see :func:`read_documents`).
    """
    if not inputs:
        raise ConfigError("--input: give at least one .txt or .jsonl file")
    for p in inputs:
        if not os.path.isfile(p):
            raise ConfigError(f"--input {p}: no such file")
    check_output_prefix(output_prefix)
    dtype = best_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(output_prefix, dtype)
    eod = [tokenizer.eod] if append_eod else []
    n_docs = 0
    try:
        if workers > 1:
            ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
            encode = functools.partial(_encode_batch, tokenizer.to_str())
            with ctx.Pool(workers) as pool:  # at most 2 batches per worker in flight (memory)
                pending: collections.deque = collections.deque()
                for batch in _batches(inputs, json_keys, max_document_bytes):
                    pending.append(pool.apply_async(encode, (batch,)))
                    while len(pending) > 2 * workers or (pending and pending[0].ready()):
                        for ids in pending.popleft().get():
                            builder.add_document(ids + eod)
                            n_docs += 1
                while pending:
                    for ids in pending.popleft().get():
                        builder.add_document(ids + eod)
                        n_docs += 1
        else:
            for batch in _batches(inputs, json_keys, max_document_bytes):
                for ids in tokenizer.encode_batch(batch):
                    builder.add_document(ids + eod)
                    n_docs += 1
    except BaseException:
        builder.abort()
        raise
    if n_docs == 0:
        builder.abort()
        raise ConfigError(f"--input {' '.join(inputs)}: no documents (every line empty, or no "
                          f"non-empty --json-keys {' '.join(json_keys)} field); nothing written")
    tokenizer.save(output_prefix + ".tokenizer.json")
    builder.finalize()
    meta = {"files": dataset_files(output_prefix),
            "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod, "num_documents": n_docs,
            "num_tokens": builder.num_tokens, "dtype": np.dtype(dtype).name,
            "max_token_id": builder.max_token_id,
            "append_eod": bool(append_eod), "inputs": [os.path.abspath(p) for p in inputs]}
    if tokenizer_type:  # `loom train --tokenizer-type` is checked against it
        meta["tokenizer_type"] = tokenizer_type
    _atomic_write_text(output_prefix + ".meta.json", json.dumps(meta, indent=1) + "\n")
    return meta


def missing_dataset_hint(prefix: str) -> str:
    """The fix for a dataset prefix that names no dataset: drop a file extension the user gave
    (``data/corpus.bin`` -> ``data/corpus``) or Megatron's ``_text_document`` suffix where
    ``loom preprocess`` wrote the prefix itself, else build it with ``loom preprocess``."""
    for ext in (".bin", ".idx", ".meta.json", ".tokenizer.json"):
        stem = prefix[:-len(ext)] if prefix.endswith(ext) else None
        if stem and os.path.isfile(stem + ".meta.json"):
            return f"give the prefix without {ext}: --data-path {stem}"
    m = re.fullmatch(r"(.+)_\w+_(?:document|sentence)", prefix)  # Megatron's naming
    if m and os.path.isfile(m[1] + ".meta.json"):
        return (f"loom preprocess names the dataset --output-prefix itself, where Megatron's "
                f"preprocess_data.py appends _KEY_document: --data-path {m[1]}")
    return f"build the dataset with `loom preprocess --input ... --output-prefix {prefix}`"


def read_meta(prefix: str) -> dict:
    """``PREFIX.meta.json`` as a dict; ConfigError naming ``--data-path`` if absent or unreadable."""
    path = f"{prefix}.meta.json"
    if not os.path.isfile(path):
        raise ConfigError(f"--data-path {prefix}: {path} does not exist; "
                          f"{missing_dataset_hint(prefix)}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--data-path {prefix}: cannot read {path} ({e}); re-run `loom preprocess`") from None


def load_tokenizer_for(prefix: str) -> Tokenizer:
    """The tokenizer stored beside a dataset (``PREFIX.tokenizer.json``).

    Raises ConfigError naming ``--data-path`` if it is absent.
    """
    path = f"{prefix}.tokenizer.json"
    if not os.path.isfile(path):
        raise ConfigError(f"--data-path {prefix}: {path} does not exist; "
                          f"{missing_dataset_hint(prefix)}")
    tok = Tokenizer.load(path)
    try:
        meta = read_meta(prefix)
        tok.eod = int(meta.get("eod", tok.eod))
    except ConfigError:
        pass
    return tok


def checkpoint_tokenizer(path: str) -> Tokenizer:
    """The ``tokenizer.json`` saved in a loom checkpoint (``--save`` directory or one
    ``iter_N/``). Raises ConfigError naming ``--tokenizer-from`` when there is none."""
    ckpt = path if os.path.exists(os.path.join(path, "common.pt")) else resolve_checkpoint(path)
    tok = os.path.join(ckpt, "tokenizer.json") if ckpt else None
    if tok is None or not os.path.isfile(tok):
        raise ConfigError(f"--tokenizer-from {path}: neither a dataset prefix nor a checkpoint "
                          f"holding a tokenizer.json")
    return Tokenizer.load(tok)


MEGATRON_ONLY = (
    # (flags, argparse kwargs, Megatron's default, what it did there and why it changes nothing
    # here); Megatron-LM tools/preprocess_data.py, v2.6 .. d98e8a6
    ("--dataset-impl", dict(choices=("lazy", "cached", "mmap")), None,
     "the indexed-dataset format of Megatron <= 23.06; loom writes the mmap one (.bin/.idx), "
     "which every later Megatron reads"),
    ("--partitions", dict(type=int), 1, "input files cut into parts encoded in parallel; the same "
                                        "documents in the same order"),
    ("--keep-sequential-samples", dict(action="store_true"), False,
     "document order kept across --partitions; loom keeps the input order"),
    ("--log-interval", dict(type=int), 1000, "progress every N documents; loom prints one summary"),
    ("--find-optimal-num-workers", dict(action="store_true"), False,
     "timing trial runs to choose --workers"),
    ("--workers-to-check", dict(type=int, nargs="+"), [16, 32, 64],
     "the --workers of those trial runs"),
    ("--max-documents", dict(type=int), 100_000, "the documents of those trial runs"),
    ("--legacy-tokenizer", dict(action="store_true"), False,
     "Megatron's older tokenizer classes; loom's tokenizers are the same vocabularies"),
    ("--keep-newlines", dict(action="store_true"), False,
     "newlines kept between the sentences --split-sentences cuts"),
    ("--lang", dict(), "english", "the language of --split-sentences's sentence splitter"),
)
"""Megatron preprocess_data.py flags ``loom preprocess`` takes without effect, named once."""


def megatron_only_report(args: argparse.Namespace) -> Optional[str]:
    """The line naming the :data:`MEGATRON_ONLY` flags given another value than Megatron's
    default, or None; ConfigError for ``--split-sentences`` (loom writes one sequence per
    document)."""
    if getattr(args, "split_sentences", False):
        raise ConfigError("--split-sentences: loom preprocess writes one sequence per document "
                          "(no sentence splitter); drop it")
    named = []
    for flag, _, default, why in MEGATRON_ONLY:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value != default:
            words = value if isinstance(value, list) else [] if value is True else [value]
            named.append(" ".join([flag, *map(str, words)]) + f" ({why})")
    return ("loom preprocess: no effect (Megatron-LM preprocess_data.py flags): "
            + "; ".join(named)) if named else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron ``preprocess_data.py`` flags for ``loom preprocess`` (those without effect
    here: :data:`MEGATRON_ONLY`, listed under their own heading)."""
    parser.add_argument("--input", nargs="+", required=True, help=".txt or .jsonl files")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl fields forming a document")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin/.idx/.tokenizer.json/.meta.json")
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                        help="GPT2BPETokenizer (--vocab-file, --merge-file), HuggingFaceTokenizer "
                             "(--tokenizer-model), ByteLevelBPETrained (trained on --input) or "
                             "BertWordPieceLowerCase / BertWordPieceCase (--vocab-file vocab.txt, "
                             "or trained on --input with --vocab-size)")
    parser.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json / encoder.json, or "
                                                           "BERT's WordPiece vocab.txt")
    parser.add_argument("--merge-file", default=None, help="GPT-2 merges.txt / vocab.bpe")
    parser.add_argument("--tokenizer-model", default=None, help="a tokenizer.json (HuggingFaceTokenizer)")
    parser.add_argument("--vocab-size", type=int, default=None, help="ids of a trained tokenizer (ByteLevelBPETrained: >= 257; BertWordPiece*)")
    parser.add_argument("--append-eod", action="store_true", help="append <|endoftext|> to every document")
    parser.add_argument("--workers", type=int, default=1,
                        help="encoding processes (1 = in-process; capped to the usable cores)")
    parser.add_argument("--max-document-bytes", type=int, default=MAX_DOCUMENT_BYTES,
                        metavar="N", help="refuse a line (document) longer than N bytes, naming "
                                          "it (default: %(default)s; memory grows with it)")
    parser.add_argument("--tokenizer-from", default=None, metavar="PREFIX",
                        help="reuse the tokenizer stored beside dataset PREFIX (same ids for held-out "
                             "data), or the one saved in checkpoint directory PREFIX (fine-tuning "
                             "an imported model)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the dataset already at --output-prefix (default: refuse "
                             "it; never inside a training checkpoint directory)")
    group = parser.add_argument_group("Megatron-LM preprocess_data.py flags without effect "
                                      "(named once)")
    for flag, kwargs, _, why in MEGATRON_ONLY:
        group.add_argument(flag, default=None, help=why, **kwargs)
    group.add_argument("--split-sentences", action="store_true",
                       help="refused: loom preprocess writes one sequence per document")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``loom preprocess``."""
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: give 1 or more")
    note = megatron_only_report(args)
    if note:
        print(note, file=sys.stderr, flush=True)
    cores = usable_cores()
    if args.workers > cores:  # each worker holds a tokenizer and a batch: more only thrash
        print(f"loom preprocess: --workers {args.workers} capped to {cores}, the cores this "
              f"process may use", file=sys.stderr, flush=True)
        args.workers = cores
    if args.max_document_bytes < 1:
        raise ConfigError(f"--max-document-bytes {args.max_document_bytes}: give 1 or more")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise ConfigError(f"--vocab-size {args.vocab_size}: give a positive vocabulary size")
    for p in args.input:
        if not os.path.isfile(p):
            raise ConfigError(f"--input {p}: no such file")
    check_new_dataset(args.output_prefix, args.overwrite)
    if args.tokenizer_from:
        if args.tokenizer_type:
            raise ConfigError("--tokenizer-from and --tokenizer-type are exclusive; give one")
        if os.path.isdir(args.tokenizer_from):  # a checkpoint (e.g. an imported model)
            tok, tokenizer_type = checkpoint_tokenizer(args.tokenizer_from), "HuggingFaceTokenizer"
        else:
            tok = load_tokenizer_for(args.tokenizer_from)
            tokenizer_type = read_meta(args.tokenizer_from).get("tokenizer_type")
    else:
        if not args.tokenizer_type:
            raise ConfigError(f"--tokenizer-type is required (one of {', '.join(TOKENIZER_TYPES)}), "
                              f"or --tokenizer-from PREFIX")
        tok = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                              tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
                              train_files=args.input, json_keys=args.json_keys)
        tokenizer_type = args.tokenizer_type
    t0 = time.time()
    meta = preprocess(args.input, args.output_prefix, tok, append_eod=args.append_eod,
                      workers=args.workers, json_keys=args.json_keys,
                      tokenizer_type=tokenizer_type, max_document_bytes=args.max_document_bytes)
    print(f"wrote {args.output_prefix}.{{bin,idx,tokenizer.json,meta.json}}: {meta['num_documents']} documents, "
          f"{meta['num_tokens']} tokens, vocab {meta['vocab_size']}, {meta['dtype']} ({time.time() - t0:.1f}s)")
    return 0
