"""``loom data check PREFIX``: is this dataset what ``loom preprocess`` wrote, and trainable?

Checks, reading every byte once: ``PREFIX.meta.json`` readable; the ``.bin``, ``.idx`` and
``.tokenizer.json`` sizes and blake2b checksums against it (a file swapped for another
dataset's, or edited, is named); the index against the ``.bin``; the counts against
``meta.json``; and a full scan of the token ids against the vocabulary (``--vocab-size``, else
the stored tokenizer's): an id >= V is named with its document. Prints one line per check;
exit status 0 when all pass, 2 (one ``error:`` line) at the first that fails.
"""

from __future__ import annotations

import argparse

import numpy as np

from loom.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["check"],
                        help="check: checksums, index, counts and every token id of a dataset")
    parser.add_argument("prefix", help="the dataset prefix (PREFIX.bin, PREFIX.idx, ...)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="V to check the ids against (default: the stored tokenizer's)")


def first_out_of_vocab(ds, vocab_size: int):
    """``(document, position, id)`` of the first token id >= ``vocab_size``, or None."""
    tokens = np.frombuffer(ds._bin, dtype=ds.dtype) if len(ds._bin) else np.zeros(0, ds.dtype)
    bad = np.flatnonzero(tokens >= vocab_size)
    if bad.size == 0:
        return None
    at = int(bad[0])
    starts = np.cumsum([0] + [len(ds.get(i)) for i in range(len(ds))])
    doc = int(np.searchsorted(starts, at, side="right") - 1)
    return doc, at - int(starts[doc]), int(tokens[at])


def run(args: argparse.Namespace) -> int:
    from loom.data.checks import _read_meta, verify_files
    from loom.data.indexed import IndexedDataset
    prefix, flag = args.prefix, "loom data check"
    meta = _read_meta(prefix)
    if meta is None:
        raise ConfigError(f"{prefix}: {prefix}.meta.json does not exist; give a prefix written "
                          f"by `loom preprocess`")
    if verify_files(prefix, meta, flag):
        print(f"checksums: ok ({', '.join(prefix + e for e in meta['files'])})")
    else:
        print(f"checksums: none recorded ({prefix}.meta.json predates them); sizes and ids "
              f"checked only")
    ds = IndexedDataset(prefix, flag)
    for key, actual in (("num_tokens", ds.num_tokens), ("num_documents", ds.num_documents)):
        if key in meta and meta[key] != actual:
            raise ConfigError(f"{prefix}: {prefix}.meta.json says {key} = {meta[key]} but the "
                              f"index holds {actual}: the files come from different runs")
    print(f"index: ok ({ds.num_documents} documents, {ds.num_tokens} tokens, {ds.dtype.name})")
    vocab = args.vocab_size or meta.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"{prefix}: no vocabulary size in {prefix}.meta.json: give "
                          f"--vocab-size V")
    bad = first_out_of_vocab(ds, vocab)
    if bad is not None:
        doc, pos, tok = bad
        raise ConfigError(f"{prefix}.bin: token id {tok} (document {doc}, position {pos}) is "
                          f">= the vocabulary size {vocab}: the .bin was edited or tokenized "
                          f"with another tokenizer; re-run `loom preprocess`")
    print(f"token ids: ok (all < {vocab})")
    return 0
