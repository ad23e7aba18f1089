"""Small datasets the tests write and read: :func:`write_dataset` (an indexed dataset with its
``PREFIX.meta.json``, as ``loom preprocess`` writes them) and :class:`Recording` (which samples
a run read)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from loom.data.checks import dataset_files
from loom.data.indexed import IndexedDatasetBuilder


def write_dataset(prefix: Path, lo: int, hi: int, n_docs: int = 40, seed: int = 0,
                  docs: Optional[Sequence[Sequence[int]]] = None) -> str:
    """``PREFIX.bin/.idx/.meta.json`` (V 100, EOD 0; the files' hashes, a checkpoint's record
    of its data) of ``n_docs`` documents of 10-29 tokens drawn from ``[lo, hi]`` with ``seed``
    (or the given ``docs``); returns the prefix."""
    rng = np.random.default_rng(seed)
    if docs is None:
        docs = [rng.integers(lo, hi + 1, int(rng.integers(10, 30))).tolist()
                for _ in range(n_docs)]
    b = IndexedDatasetBuilder(str(prefix))
    for doc in docs:
        b.add_document(list(doc))
    b.finalize()
    meta = dict(vocab_size=100, eod=0, num_documents=len(docs),
                num_tokens=sum(len(d) for d in docs), dtype="uint16", max_token_id=hi,
                files=dataset_files(str(prefix)))  # as loom preprocess: the data's identity
    (prefix.parent / (prefix.name + ".meta.json")).write_text(json.dumps(meta))
    return str(prefix)


class Recording:
    """A dataset that records which sample indices were read (``read``)."""

    def __init__(self, ds):
        self.ds, self.read = ds, []

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, k):
        self.read.append(int(k))
        return self.ds[k]
