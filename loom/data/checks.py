"""Dataset cross-checks before training: ``PREFIX.meta.json`` against ``PREFIX.bin``/``.idx``
and against ``--vocab-size``; every token id below V.

The largest token id comes from ``meta.json`` (``max_token_id``, written by ``loom preprocess``)
or from one pass over the memory-mapped ``.bin``, cached in ``PREFIX.maxid.json`` keyed by the
``.bin``'s size and modification time.
"""

from __future__ import annotations

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


def max_token_id(ds: IndexedDataset, meta: Optional[dict] = None) -> int:
    """Largest token id of ``ds`` (-1 when empty): ``meta["max_token_id"]``, the cache file, or
    one pass over the ``.bin`` (then cached, if the directory is writable)."""
    if meta and isinstance(meta.get("max_token_id"), int):
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
    tokens = np.frombuffer(ds._bin, dtype=ds.dtype) if len(ds._bin) else np.zeros(0, ds.dtype)
    top = int(tokens.max()) if tokens.size else -1
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
    ds = IndexedDataset(prefix, flag)
    meta = _read_meta(prefix)
    meta_path = f"{prefix}.meta.json"
    if meta is not None:
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
