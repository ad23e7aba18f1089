"""GPT pretraining samples: fixed windows of ``seq_length + 1`` tokens over a document stream.

For epoch ``e`` the documents of the range are concatenated in a seeded random order (numpy
Generator seeded with ``(seed, e)``); sample ``j`` of the epoch covers stream positions
``[j*s, j*s + s + 1)`` (consecutive samples overlap by one token, documents cross sample
boundaries as in Megatron), and the samples of the epoch are visited in a second seeded order.
Index ``k`` is valid for any ``k >= 0``: epoch ``k // len(ds)``, position ``k % len(ds)``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch

from loom.data.indexed import IndexedDataset
from loom.data.split import parse_split, split_document_ranges  # noqa: F401 - re-exported
from loom.errors import ConfigError


class GPTDataset:
    """Samples of ``seq_length`` (tokens, labels) from documents ``[start, end)`` of an IndexedDataset.

    Args:
        indexed: the token store.
        document_range: ``(start, end)`` document indices (end exclusive).
        seq_length: s.
        seed: shuffling seed; the same ``(seed, k)`` gives the same sample in every process.

    ``len(ds) = (tokens_in_range - 1) // s`` (samples per epoch). ``ds[k]`` returns
    ``{"tokens": LongTensor[s], "labels": LongTensor[s]}`` with ``labels[i] = stream[i + 1]``.

    Raises:
        ConfigError: naming ``--split``/``--seq-length`` if the range holds fewer than ``s + 1`` tokens.
        IndexError: for ``k < 0``.
    """

    _CACHE_EPOCHS = 4

    def __init__(self, indexed: IndexedDataset, document_range: tuple[int, int], seq_length: int, seed: int):
        self.indexed = indexed
        start, end = int(document_range[0]), int(document_range[1])
        nd = indexed.num_documents
        if not 0 <= start <= end <= nd:
            raise ValueError(f"document_range {document_range} outside [0, {nd}]")
        if seq_length < 1:
            raise ConfigError(f"--seq-length {seq_length}: give a positive sequence length")
        self.document_range = (start, end)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        di = indexed.document_indices
        # sequences of the documents in range (== documents for loom-written data)
        self._seqs = np.arange(int(di[start]), int(di[end]), dtype=np.int64) if nd else np.zeros(0, np.int64)
        self._sizes = indexed.sizes[self._seqs].astype(np.int64)
        self.num_tokens = int(self._sizes.sum())
        self._len = max(self.num_tokens - 1, 0) // self.seq_length
        if self._len == 0:
            raise ConfigError(
                f"documents {start}..{end} of --data-path {indexed.prefix} hold {self.num_tokens} tokens, fewer than "
                f"one sample of --seq-length {seq_length} + 1; lower --seq-length or give this part of --split "
                f"more weight (or more data)")
        self._epochs: "OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]" = OrderedDict()

    def __len__(self) -> int:
        return self._len

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sequence order int64[n], stream offsets int64[n+1], sample order int64[len]) of epoch e."""
        hit = self._epochs.get(e)
        if hit is not None:
            self._epochs.move_to_end(e)
            return hit
        rng = np.random.default_rng([self.seed, e])
        perm = rng.permutation(len(self._seqs))
        order = self._seqs[perm]
        offsets = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(self._sizes[perm], out=offsets[1:])
        sample_order = rng.permutation(self._len).astype(np.int64)
        self._epochs[e] = (order, offsets, sample_order)
        while len(self._epochs) > self._CACHE_EPOCHS:
            self._epochs.popitem(last=False)
        return self._epochs[e]

    def sample_position(self, k: int) -> tuple[int, int]:
        """(epoch, in-epoch sample index j) of global index k; the sample covers stream [j*s, j*s+s+1)."""
        e, r = divmod(int(k), self._len)
        return e, int(self._epoch(e)[2][r])

    def stream_tokens(self, epoch: int, start: int, length: int) -> np.ndarray:
        """int64[length] tokens ``[start, start + length)`` of epoch ``epoch``'s document stream."""
        order, offsets, _ = self._epoch(epoch)
        out = np.empty(length, dtype=np.int64)
        d = int(np.searchsorted(offsets, start, side="right")) - 1
        pos, filled = start, 0
        while filled < length:
            off = pos - int(offsets[d])
            take = min(length - filled, int(offsets[d + 1]) - pos)
            if take > 0:
                out[filled:filled + take] = self.indexed.get(int(order[d]), off, take)
                filled += take
                pos += take
            d += 1
        return out

    def document_starts(self, k: int) -> torch.Tensor:
        """``LongTensor[s]``: for each input token of sample ``k``, the index in the sample
        where its document starts (0 for the document the sample begins in): the documents'
        own boundaries in the shuffled stream (``--dataloader-inter-document-masking``,
        Megatron-Core's ``document_lengths`` of the sample)."""
        e, j = self.sample_position(k)
        s = self.seq_length
        offsets = self._epoch(e)[1]
        at = np.arange(j * s, j * s + s, dtype=np.int64)
        first = offsets[np.searchsorted(offsets, at, side="right") - 1]  # its document's offset
        return torch.from_numpy(np.maximum(first - j * s, 0))

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        k = int(k)
        if k < 0:
            raise IndexError(f"sample index {k} < 0")
        e, j = self.sample_position(k)
        s = self.seq_length
        toks = torch.from_numpy(self.stream_tokens(e, j * s, s + 1))
        return {"tokens": toks[:-1], "labels": toks[1:]}


class MockGPTDataset:
    """Random tokens in ``[0, vocab_size)``, deterministic per ``(seed, k)``; same interface as GPTDataset.

    ``len()`` is 2**40 (effectively infinite); ``ds[k]`` = ``{"tokens": LongTensor[s], "labels": LongTensor[s]}``.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        if not vocab_size or vocab_size < 2:
            raise ConfigError(f"--vocab-size {vocab_size}: --mock-data needs a vocabulary of at least 2")
        self.vocab_size, self.seq_length, self.seed = int(vocab_size), int(seq_length), int(seed)

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        k = int(k)
        if k < 0:
            raise IndexError(f"sample index {k} < 0")
        rng = np.random.default_rng([self.seed, k])
        toks = torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64))
        return {"tokens": toks[:-1], "labels": toks[1:]}


def build_gpt_datasets(data_path: Optional[str], split: str, seq_length: int, seed: int,
                       valid_data_path: Optional[str] = None
                       ) -> tuple[Optional[GPTDataset], Optional[GPTDataset], Optional[GPTDataset]]:
    """(train, valid, test) GPTDatasets from ``--data-path`` / ``--split`` (None for empty splits).

    With ``valid_data_path``, that whole dataset is the validation set and train takes every document of
    ``data_path`` before the test share. Raises ConfigError naming ``--data-path`` (missing/corrupt),
    ``--valid-data-path`` or ``--split``/``--seq-length`` (a split too small for one sample).
    """
    if not data_path:
        raise ConfigError("--data-path is required (a prefix written by `loom preprocess`), or use --mock-data")
    ds = IndexedDataset(data_path)
    (a, b), (c, d), (e, f) = split_document_ranges(ds.num_documents, split)
    ranges = [(a, b), (c, d), (e, f)]
    if valid_data_path:
        ranges[0] = (a, d)
        ranges[1] = None
    out: list[Optional[GPTDataset]] = []
    for i, r in enumerate(ranges):
        if r is None:
            vds = IndexedDataset(valid_data_path)
            try:
                out.append(GPTDataset(vds, (0, vds.num_documents), seq_length, seed) if vds.num_documents else None)
            except ConfigError:
                raise ConfigError(f"--valid-data-path {valid_data_path}: {vds.num_tokens} tokens, fewer than one "
                                  f"sample of --seq-length {seq_length} + 1; lower --seq-length or add data") from None
        elif r[1] > r[0]:
            out.append(GPTDataset(ds, r, seq_length, seed))
        else:
            out.append(None)
    return out[0], out[1], out[2]
