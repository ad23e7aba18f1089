"""Blends of datasets: Megatron's ``--data-path W1 PREFIX1 W2 PREFIX2 ...``.

A blend is a list of ``(weight, prefix)``; weights are normalized to sum to 1. Sample ``k`` of
a :class:`BlendedDataset` is sample ``j`` of dataset ``d``, where ``(d, j)`` depends only on the
weights and ``k``: not on the seed, the data-parallel size, or which samples were read before,
so a restart at any ``consumed_samples`` continues the same sequence. As in Megatron's
``BlendedDataset`` each dataset's share of the first ``n`` samples is within one sample of
``w_d n`` for every ``n``: dataset ``d``'s ``j``-th sample is due at ``t = (j + 1/2) / w_d``
and samples are taken in order of due time (ties: lower ``d`` first; the Sainte-Laguë
apportionment, computed vectorized instead of Megatron's sequential greedy loop).

Each dataset reads its own samples in its own seeded order (:class:`GPTDataset`), epoch after
epoch when its share outgrows it. With a blend, ``--split`` cuts every dataset and the
validation/test sets are the blends of the parts (Megatron's behaviour).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from loom.config.blend import parse_blend  # noqa: F401 (re-exported: loom.data's name)
from loom.errors import ConfigError


def blend_prefixes(text: Optional[str], flag: str = "--data-path") -> list[str]:
    """The prefixes of a ``--data-path``-style value ([] for None)."""
    return [p for _, p in parse_blend(text, flag) or []]


def blend_order(weights: Sequence[float], n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset int64[n], sample within that dataset int64[n])`` of blended samples 0..n-1.

    Weights must be >= 0 with a positive sum (normalized here). Sample ``k`` goes to the
    dataset whose next sample is due earliest (due times ``(j + 1/2) / w_d``), so each
    dataset's count among the first ``m`` samples differs from ``w_d m`` by at most one.
    """
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    times, ds, js = [], [], []
    for d, wd in enumerate(w):
        if wd <= 0:
            continue
        j = np.arange(int(np.ceil(wd * n)) + 2, dtype=np.int64)
        times.append((j + 0.5) / wd)
        ds.append(np.full(len(j), d, dtype=np.int64))
        js.append(j)
    t, d_all, j_all = np.concatenate(times), np.concatenate(ds), np.concatenate(js)
    order = np.lexsort((d_all, t))[:n]  # by due time, ties by dataset index
    return d_all[order], j_all[order]


class BlendedDataset:
    """Samples drawn from ``datasets`` in the proportions ``weights`` (see the module text).

    ``len()`` is 2**40 (every index is valid: each dataset repeats in epochs). ``ds[k]`` is the
    sample of the chosen dataset. ``names`` label the datasets in :meth:`describe`.
    ``by_size``: the weights are the datasets' samples per epoch, and ``epoch_samples`` (their
    sum; else None) the samples of one epoch of every dataset (``--full-validation``).
    Raises ConfigError if the lists differ in length or no weight is positive.
    """

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], names: Sequence[str],
                 by_size: bool = False):
        if not (len(datasets) == len(weights) == len(names)) or not datasets:
            raise ConfigError("a blend needs one weight and one name per dataset")
        total = float(sum(weights))
        if not total > 0 or min(weights) < 0:
            raise ConfigError(f"blend weights {list(weights)} must be >= 0 with a positive sum")
        self.datasets, self.names = list(datasets), list(names)
        self.weights = [float(w) / total for w in weights]
        # weights = the datasets' samples per epoch: the first sum of them are one epoch of each
        # (dataset d's j-th sample is due at (j + 1/2) N / n_d < N exactly for j < n_d)
        self.epoch_samples = sum(len(ds) for ds in datasets) if by_size else None
        self._dataset = np.zeros(0, np.int64)
        self._sample = np.zeros(0, np.int64)

    def __len__(self) -> int:
        return 1 << 40

    def locate(self, k: int) -> tuple[int, int]:
        """(dataset index, sample index within it) of blended sample ``k >= 0``."""
        if k < 0:
            raise IndexError(f"sample index {k} < 0")
        if k >= len(self._dataset):  # the order is a prefix-stable function of n: grow it
            n = max(2 * len(self._dataset), k + 1, 4096)
            self._dataset, self._sample = blend_order(self.weights, n)
        return int(self._dataset[k]), int(self._sample[k])

    def __getitem__(self, k: int) -> dict:
        d, j = self.locate(int(k))
        return self.datasets[d][j]

    def document_starts(self, k: int):
        """The document starts of sample ``k`` (its dataset's ``document_starts``)."""
        d, j = self.locate(int(k))
        return self.datasets[d].document_starts(j)

    def describe(self) -> str:
        """One line: each dataset's weight and samples per epoch, e.g. ``30.0% A (812 samples)``."""
        return ", ".join(f"{100 * w:.1f}% {n} ({len(ds):,} samples/epoch)"
                         for w, n, ds in zip(self.weights, self.names, self.datasets))


def build_blend(parts: Sequence[tuple[Optional[float], str, Any]]) -> Any:
    """One dataset from ``[(weight or None, name, dataset or None)]``: datasets that are None
    (an empty split) are dropped; ``None`` weights become each dataset's samples per epoch.
    Returns None when nothing is left, the dataset itself when one is left with no blend
    asked, else a :class:`BlendedDataset`."""
    kept = [(w, n, ds) for w, n, ds in parts if ds is not None]
    if not kept:
        return None
    if len(parts) == 1:
        return kept[0][2]
    weights = [len(ds) if w is None else w for w, _, ds in kept]
    if not sum(weights) > 0:
        return None
    return BlendedDataset([ds for _, _, ds in kept], weights, [n for _, n, _ in kept],
                          by_size=all(w is None for w, _, _ in kept))


class DatasetList(list):
    """Several datasets in one slot of ``(train, valid, test)``: the validation sets of
    ``--multiple-validation-sets``, one per dataset of ``--valid-data-path``, in its order
    (``names``: their prefixes)."""

    def __init__(self, datasets: Sequence[Any], names: Sequence[str]):
        super().__init__(datasets)
        self.names = list(names)


def map_sets(fn: Any, sets: Sequence[Any]) -> tuple:
    """``sets`` (train, valid, test) with every dataset passed through ``fn`` (None stays None;
    a :class:`DatasetList` member by member): the wrappers a run adds (loss masks, document
    resets, FIM, BERT's masking)."""
    def one(ds):
        if isinstance(ds, DatasetList):
            return DatasetList([fn(d) for d in ds], ds.names)
        return None if ds is None else fn(ds)
    return tuple(one(ds) for ds in sets)


def build_datasets(data: Any, seq_length: int, seed: int, separate_valid: bool = False
                   ) -> tuple[Any, Any, Any]:
    """(train, valid, test) of a :class:`~loom.config.DataConfig` (blends included; None for
    a set that has no data).

    ``--data-path`` is cut by ``--split`` (each dataset of a blend alike; with
    ``--valid-data-path`` its valid share goes to training); ``--train-data-path``,
    ``--valid-data-path`` and ``--test-data-path`` are whole datasets and replace the
    corresponding part. ``separate_valid`` (``--multiple-validation-sets``): a
    ``--valid-data-path`` of several datasets is a :class:`DatasetList` of them, not their
    blend (Megatron's ``BlendedMegatronDatasetBuilder``). Raises ConfigError naming the flag
    (missing or corrupt files, a set too small for one sample, an empty validation dataset).
    """
    from loom.data.gpt_dataset import GPTDataset
    from loom.data.indexed import IndexedDataset
    from loom.data.split import split_document_ranges
    sets: list[Any] = [None, None, None]
    if data.data_path:
        blend = parse_blend(data.data_path)
        cut = []
        for _, p in blend:
            ds = IndexedDataset(p)
            ranges = split_document_ranges(ds.num_documents, data.split)
            if data.valid_data_path:  # the valid share trains; the held-out set evaluates
                ranges = [(ranges[0][0], ranges[1][1]), (0, 0), ranges[2]]
            cut.append([GPTDataset(ds, r, seq_length, seed) if r[1] > r[0] else None
                        for r in ranges])
        sets = [build_blend([(w, p, c[i]) for (w, p), c in zip(blend, cut)]) for i in range(3)]
    for i, (flag, text) in enumerate((("--train-data-path", data.train_data_path),
                                      ("--valid-data-path", data.valid_data_path),
                                      ("--test-data-path", data.test_data_path))):
        if not text:
            continue
        parts = []
        for w, p in parse_blend(text, flag):
            ds = IndexedDataset(p, flag)
            try:
                parts.append((w, p, GPTDataset(ds, (0, ds.num_documents), seq_length, seed)
                              if ds.num_documents else None))
            except ConfigError:
                raise ConfigError(f"{flag} {p}: {ds.num_tokens} tokens, fewer than one sample "
                                  f"of --seq-length {seq_length} + 1; lower --seq-length or add "
                                  f"data") from None
        if i == 1 and separate_valid and len(parts) > 1:
            empty = [p for _, p, ds in parts if ds is None]
            if empty:
                raise ConfigError(f"{flag} {empty[0]}: no documents, so no validation set: "
                                  f"drop it from --valid-data-path")
            sets[i] = DatasetList([ds for _, _, ds in parts], [p for _, p, _ in parts])
        else:
            sets[i] = build_blend(parts)
    return sets[0], sets[1], sets[2]


def data_prefixes(data: Any) -> list[tuple[str, str]]:
    """``[(flag, prefix)]`` of every dataset a :class:`~loom.config.DataConfig` names."""
    return [(flag, p) for flag, text in (("--data-path", data.data_path),
                                         ("--train-data-path", data.train_data_path),
                                         ("--valid-data-path", data.valid_data_path),
                                         ("--test-data-path", data.test_data_path))
            for p in blend_prefixes(text, flag)]


def blend_vocab_size(data: Any) -> Optional[int]:
    """V of the datasets' stored tokenizer (``PREFIX.meta.json``), None without data.

    Raises ConfigError naming both prefixes when two datasets were tokenized with vocabularies
    of different sizes (a blend needs one tokenizer).
    """
    from loom.data.preprocess import read_meta
    if getattr(data, "sft", False):  # JSONL conversations: V is the SFT tokenizer's
        from loom.data.sft import sft_tokenizer
        return sft_tokenizer(data).vocab_size
    seen: dict[int, str] = {}
    for flag, p in data_prefixes(data):
        try:
            v = int(read_meta(p)["vocab_size"])
        except ConfigError as e:  # read_meta names --data-path; name the flag given
            raise ConfigError(str(e).replace("--data-path", flag, 1)) from None
        if seen and v not in seen:
            other_v, other = next(iter(seen.items()))
            raise ConfigError(f"{flag} {p} was tokenized with a vocabulary of {v} but {other} "
                              f"with {other_v}: every dataset of a run needs the same tokenizer "
                              f"(re-run `loom preprocess --tokenizer-from`)")
        seen.setdefault(v, p)
    return next(iter(seen), None)
