"""Dataset cross-checks before training: ``PREFIX.meta.json`` against ``PREFIX.bin``/``.idx``
(sizes and blake2b checksums of the ``.bin``, ``.idx`` and tokenizer, ``files``, written by
``loom preprocess``) and against ``--vocab-size``; every token id below V.

The largest token id comes from ``meta.json`` (``max_token_id``) when the checksums vouch for
the ``.bin``, else from one pass over the memory-mapped ``.bin``, cached in
``PREFIX.maxid.json`` keyed by the ``.bin``'s size and modification time.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy as np

from loom.data.indexed import IndexedDataset
from loom.errors import ConfigError


def _read_meta(prefix: str) -> Optional[dict]:
    path = f"{prefix}.meta.json"
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--data-path {prefix}: cannot read {path} ({e}); re-run `loom preprocess`") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"--data-path {prefix}: {path} is not a JSON object; re-run `loom preprocess`")
    return meta


def tokenizer_vocab_size(path: str) -> Optional[int]:
    """Distinct ids a ``tokenizer.json`` defines, added tokens included (what ``tokenizers``
    reports as ``get_vocab_size(with_added_tokens=True)``); None without a ``model.vocab``
    mapping."""
    with open(path, encoding="utf-8") as fh:
        tok = json.load(fh)
    vocab = (tok.get("model") or {}).get("vocab")
    if not isinstance(vocab, dict):
        return None
    ids = list(vocab.values()) + [t.get("id", -1) for t in tok.get("added_tokens") or []]
    return len(set(ids) - {-1})


HASHED = (".bin", ".idx", ".tokenizer.json")  # the dataset files meta.json's "files" covers


def file_digest(path: str) -> str:
    """blake2b (32-byte) hex digest of a file, read in 4 MiB chunks."""
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def dataset_files(prefix: str) -> dict:
    """``{".bin": {"size", "blake2b"}, ".idx": ..., ".tokenizer.json": ...}`` of the files
    there (what ``loom preprocess`` writes into ``meta.json``'s ``files``)."""
    return {ext: {"size": os.path.getsize(prefix + ext), "blake2b": file_digest(prefix + ext)}
            for ext in HASHED if os.path.isfile(prefix + ext)}


def dataset_identity(meta: dict) -> Optional[dict]:
    """``{"content": hash of the .bin and .idx hashes, "tokenizer": the tokenizer's hash}`` from
    a ``meta.json`` with ``files`` (None for a dataset preprocessed before loom hashed them):
    what a checkpoint records of the data it was trained on."""
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or ".bin" not in files or ".idx" not in files:
        return None
    content = hashlib.blake2b((files[".bin"]["blake2b"] + files[".idx"]["blake2b"]).encode(),
                              digest_size=16).hexdigest()
    tok = files.get(".tokenizer.json", {}).get("blake2b")
    return {"content": content, "tokenizer": tok}


def verify_files(prefix: str, meta: Optional[dict], flag: str = "--data-path",
                 hashes: bool = True) -> bool:
    """Refuse dataset files whose size or blake2b differs from ``meta.json``'s ``files`` (an
    ``.idx``, ``.bin`` or tokenizer swapped for another dataset's, an edited ``.bin``); one
    ConfigError naming the file. ``hashes``: re-read every byte (about 1 GB/s), else sizes
    only. False when ``meta.json`` records no files (preprocessed before loom hashed them)."""
    files = (meta or {}).get("files")
    if not isinstance(files, dict):
        return False
    for ext, want in files.items():
        path = prefix + ext
        if not os.path.isfile(path):
            raise ConfigError(f"{flag} {prefix}: {path} is missing; {prefix}.meta.json lists it")
        size = os.path.getsize(path)
        if size != want.get("size") or (hashes and file_digest(path) != want.get("blake2b")):
            what = f"has {size} bytes, {want.get('size')} when written" \
                if size != want.get("size") else "changed since `loom preprocess` wrote it " \
                                                 "(its blake2b differs from meta.json)"
            raise ConfigError(f"{flag} {prefix}: {path} {what}: it belongs to another dataset "
                              f"or was edited; re-run `loom preprocess --output-prefix {prefix} "
                              f"--overwrite`, or restore the file")
    return True


def scan_max_token_id(ds: IndexedDataset) -> int:
    """Largest token id in the ``.bin`` (one pass; -1 when empty)."""
    tokens = np.frombuffer(ds._bin, dtype=ds.dtype) if len(ds._bin) else np.zeros(0, ds.dtype)
    return int(tokens.max()) if tokens.size else -1


def max_token_id(ds: IndexedDataset, meta: Optional[dict] = None) -> int:
    """Largest token id of ``ds`` (-1 when empty): ``meta["max_token_id"]`` when its files'
    checksums were verified (:func:`verify_files`: the ``.bin`` is the one it describes), the
    cache file, or one pass over the ``.bin`` (then cached, if the directory is writable)."""
    if meta and isinstance(meta.get("max_token_id"), int) and isinstance(meta.get("files"), dict):
        return int(meta["max_token_id"])
    bin_path = ds.prefix + ".bin"
    st = os.stat(bin_path)
    key = {"bin_size": st.st_size, "bin_mtime_ns": st.st_mtime_ns}
    cache = ds.prefix + ".maxid.json"
    try:
        with open(cache, encoding="utf-8") as fh:
            cached = json.load(fh)
        if {k: cached.get(k) for k in key} == key and isinstance(cached.get("max_token_id"), int):
            return int(cached["max_token_id"])
    except (OSError, ValueError):
        pass
    top = scan_max_token_id(ds)
    tmp = f"{cache}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({**key, "max_token_id": top}, fh)
        os.replace(tmp, cache)
    except OSError:  # a read-only dataset directory: the scan is simply repeated next time
        pass
    return top


def check_dataset(prefix: str, vocab_size: Optional[int], flag: str = "--data-path") -> IndexedDataset:
    """Open ``prefix`` and cross-check it; returns the dataset.

    Checks: ``.idx`` belongs to ``.bin`` (see :class:`IndexedDataset`); ``meta.json``'s
    ``num_tokens``, ``num_documents`` and ``dtype`` match the index and its ``vocab_size`` the
    stored ``PREFIX.tokenizer.json``; its ``vocab_size`` is at most
    ``vocab_size`` (``--vocab-size``); no token id is >= ``vocab_size``. Raises ConfigError naming
    ``flag`` and the file.
    """
    meta = _read_meta(prefix)
    if meta is not None:  # sizes first: a swapped .idx is named before the index is parsed
        verify_files(prefix, meta, flag, hashes=False)
    ds = IndexedDataset(prefix, flag)
    meta_path = f"{prefix}.meta.json"
    if meta is not None:
        verify_files(prefix, meta, flag)
        for key, actual in (("num_tokens", ds.num_tokens), ("num_documents", ds.num_documents),
                            ("dtype", ds.dtype.name)):
            if key in meta and meta[key] != actual:
                raise ConfigError(
                    f"{flag} {prefix}: {meta_path} says {key} = {meta[key]} but {prefix}.idx / "
                    f"{prefix}.bin hold {actual}: the files come from different runs; re-run "
                    f"`loom preprocess --output-prefix {prefix}`")
        meta_v = meta.get("vocab_size")
        tok_path = f"{prefix}.tokenizer.json"
        if isinstance(meta_v, int) and os.path.isfile(tok_path):
            try:
                tok_v = tokenizer_vocab_size(tok_path)
            except (OSError, UnicodeDecodeError, ValueError) as e:
                raise ConfigError(f"{flag} {prefix}: cannot read {tok_path} ({e}); re-run "
                                  f"`loom preprocess`") from None
            if tok_v is not None and tok_v != meta_v:
                raise ConfigError(
                    f"{flag} {prefix}: {tok_path} defines {tok_v} ids but {meta_path} says "
                    f"vocab_size = {meta_v}: the tokenizer is not the one the data was "
                    f"tokenized with; re-run `loom preprocess --output-prefix {prefix}`")
        if vocab_size is not None and isinstance(meta_v, int) and meta_v > vocab_size:
            raise ConfigError(
                f"--vocab-size {vocab_size} is smaller than the tokenizer's vocabulary "
                f"{meta_v} ({meta_path}): drop --vocab-size or give at least {meta_v}")
    if vocab_size is not None:
        top = max_token_id(ds, meta)
        if top >= vocab_size:
            raise ConfigError(
                f"{flag} {prefix}: token id {top} in {prefix}.bin is >= --vocab-size "
                f"{vocab_size} (ids must be 0..V-1): give --vocab-size {top + 1} or more, or "
                f"re-tokenize with the matching tokenizer")
    return ds


def check_model_family(prefix: str, model_type: str, wordpiece: bool,
                       flag: str = "--data-path") -> None:
    """Refuse data tokenized for another model family: a WordPiece vocabulary (``meta.json``'s
    ``tokenizer_type`` BertWordPiece*) is BERT's ([CLS], [SEP], [MASK]), which a causal model
    (``--model-type`` gpt, gemma3, mamba) would silently train a GPT on. Megatron picks the
    family by entry script (pretrain_bert.py); loom needs ``--model-type bert``. ``wordpiece``:
    whether ``model_type``'s family trains on such data (``ModelFamily.wordpiece_data``).
    Raises ConfigError naming ``--model-type``."""
    meta = _read_meta(prefix) or {}
    tok = meta.get("tokenizer_type")
    if isinstance(tok, str) and tok.startswith("BertWordPiece") and not wordpiece:
        raise ConfigError(f"{flag} {prefix} was tokenized with {tok} ({prefix}.meta.json), "
                          f"BERT's WordPiece vocabulary, but --model-type is {model_type} (a "
                          f"causal model): add --model-type bert (Megatron's pretrain_bert.py), "
                          f"or preprocess the text with a GPT tokenizer")
