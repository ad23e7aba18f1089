"""BERT pretraining samples: masked-LM (and sentence-order) samples over the indexed datasets.

A sample is built from a window of the same seeded document stream the GPT samples read
(:class:`~loom.data.gpt_dataset.GPTDataset`, blends included): ``s - 2`` tokens (``s - 3``
with the binary head); with probability ``--short-seq-prob`` a random shorter prefix of it, the
rest of the sample then being [PAD] (``padding_mask`` 0). Documents cross windows as in the GPT
stream; the [SEP] the WordPiece tokenizer appends to every document marks their ends.

* without the binary head: ``[CLS] A [SEP]``, token types 0;
* with it (sentence-order prediction, Lan et al. 2020): the window is cut at a random point
  into segments A and B, swapped with probability 0.5 (``sop_labels`` 1 when swapped):
  ``[CLS] A [SEP] B [SEP]``, token types 0 up to the first [SEP], 1 after.

Masking (Devlin et al. 2019, Megatron's ``create_masked_lm_predictions``): of the ``n`` tokens
that are not [CLS]/[SEP]/[PAD], ``round(n * --mask-prob)`` (at least 1) are predicted, chosen as
whole words when the tokenizer marks word pieces (WordPiece ``##`` continuations): words are
taken in random order, a word that would overshoot the count is skipped. Each predicted token
becomes [MASK] with probability 0.8, a random non-special token 0.1, and stays 0.1. Every draw
comes from a generator seeded with ``(seed, k)``, so sample ``k`` is the same in every process.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from loom.errors import ConfigError

SPECIALS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")


def special_ids(tokenizer) -> dict[str, int]:
    """``{"[PAD]": id, "[CLS]": ..., "[SEP]": ..., "[MASK]": ...}`` of a loom Tokenizer;
    ConfigError when one is missing (a non-BERT tokenizer)."""
    out = {t: tokenizer.hf.token_to_id(t) for t in SPECIALS}
    missing = [t for t, i in out.items() if i is None]
    if missing:
        raise ConfigError(f"--model-type bert needs a tokenizer with {' '.join(SPECIALS)}; this "
                          f"dataset's lacks {missing}: preprocess it with --tokenizer-type "
                          f"BertWordPieceLowerCase (or BertWordPieceCase)")
    return {t: int(i) for t, i in out.items()}


def word_starts(tokenizer) -> np.ndarray:
    """bool[V]: the token begins a word (WordPiece: it does not start with ``##``)."""
    starts = np.ones(tokenizer.vocab_size, dtype=bool)
    for token, i in tokenizer.hf.get_vocab(with_added_tokens=True).items():
        if token.startswith("##") and i < len(starts):
            starts[i] = False
    return starts


class BertDataset:
    """Masked-LM samples of ``seq_length`` over ``source`` (any dataset whose ``[k]["tokens"]``
    holds at least ``seq_length - 2`` tokens; a GPTDataset, a blend, or mock tokens).

    ``ds[k]``: ``tokens`` (masked input), ``labels`` (original tokens), ``loss_mask`` (1 at
    predicted positions), ``types``, ``padding_mask`` (1 = real token), all ``LongTensor[s]``,
    and ``sop_labels`` (``LongTensor[]``: 1 when A and B were swapped; 0 without the binary
    head). ``len()`` is the source's.
    """

    def __init__(self, source: Any, seq_length: int, specials: dict[str, int], vocab_size: int,
                 seed: int, *, mask_prob: float = 0.15, short_seq_prob: float = 0.1,
                 binary_head: bool = False, starts: Optional[np.ndarray] = None):
        self.source, self.s, self.seed = source, int(seq_length), int(seed)
        self.pad, self.cls = specials["[PAD]"], specials["[CLS]"]
        self.sep, self.mask = specials["[SEP]"], specials["[MASK]"]
        self.mask_prob, self.short_seq_prob, self.binary_head = mask_prob, short_seq_prob, binary_head
        self.starts = starts
        special = set(specials.values())
        self.random_ids = np.array([i for i in range(vocab_size) if i not in special], np.int64)

    def __len__(self) -> int:
        return len(self.source)

    def _words(self, seq: np.ndarray, candidate: np.ndarray) -> list[np.ndarray]:
        """Positions of ``seq`` grouped into words (runs of candidates continuing a word)."""
        words: list[list[int]] = []
        for i in np.flatnonzero(candidate):
            starts = self.starts is None or bool(self.starts[seq[i]])
            if starts or not words or not candidate[i - 1]:
                words.append([i])
            else:
                words[-1].append(i)
        return [np.array(w, dtype=np.int64) for w in words]

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        k = int(k)
        rng = np.random.default_rng([self.seed, k, 0xB3])
        window = np.asarray(self.source[k]["tokens"], dtype=np.int64)
        n_max = self.s - (3 if self.binary_head else 2)
        n = n_max
        if rng.random() < self.short_seq_prob:
            n = int(rng.integers(2 if self.binary_head else 1, n_max + 1))
        toks = window[:n]
        swapped = False
        if self.binary_head:
            cut = int(rng.integers(1, n))
            a, b = toks[:cut], toks[cut:]
            swapped = bool(rng.random() < 0.5)
            if swapped:
                a, b = b, a
            seq = np.concatenate([[self.cls], a, [self.sep], b, [self.sep]])
            types = np.concatenate([np.zeros(len(a) + 2, np.int64), np.ones(len(b) + 1, np.int64)])
        else:
            seq = np.concatenate([[self.cls], toks, [self.sep]])
            types = np.zeros(len(seq), np.int64)
        seq = seq.astype(np.int64)
        candidate = np.ones(len(seq), dtype=bool)
        candidate[0] = False
        candidate[seq == self.sep] = False  # structural [SEP]s and document ends alike
        candidate[seq == self.cls] = False
        labels, inputs = seq.copy(), seq.copy()
        loss_mask = np.zeros(len(seq), np.int64)
        n_pred = max(1, int(round(candidate.sum() * self.mask_prob))) if candidate.any() else 0
        chosen: list[int] = []
        words = self._words(seq, candidate)
        for w in rng.permutation(len(words)):
            if len(chosen) >= n_pred:
                break
            if len(chosen) + len(words[w]) > n_pred:
                continue
            chosen.extend(words[w].tolist())
        if chosen:
            pos = np.array(sorted(chosen), dtype=np.int64)
            loss_mask[pos] = 1
            u = rng.random(len(pos))
            inputs[pos[u < 0.8]] = self.mask
            rand = pos[u >= 0.9]
            inputs[rand] = self.random_ids[rng.integers(0, len(self.random_ids), len(rand))]
        pad = self.s - len(seq)
        padding_mask = np.concatenate([np.ones(len(seq), np.int64), np.zeros(pad, np.int64)])

        def padded(x, fill):
            return torch.from_numpy(np.concatenate([x, np.full(pad, fill, np.int64)]))
        return {"tokens": padded(inputs, self.pad), "labels": padded(labels, self.pad),
                "loss_mask": padded(loss_mask, 0), "types": padded(types, 0),
                "padding_mask": torch.from_numpy(padding_mask),
                "sop_labels": torch.tensor(int(swapped), dtype=torch.long)}


def mock_specials(vocab_size: int) -> dict[str, int]:
    """Special ids of ``--mock-data`` BERT samples: [PAD] 0, [CLS] 1, [SEP] 2, [MASK] 3."""
    if vocab_size < 8:
        raise ConfigError(f"--vocab-size {vocab_size}: BERT mock data needs at least 8 ids")
    return {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[MASK]": 3}


class _MockWindows:
    """Random tokens in ``[4, V)`` (never a special id) of ``length``, per ``(seed, k)``."""

    def __init__(self, vocab_size: int, length: int, seed: int):
        self.v, self.length, self.seed = vocab_size, length, seed

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, k: int) -> dict:
        rng = np.random.default_rng([self.seed, int(k)])
        return {"tokens": rng.integers(4, self.v, self.length, dtype=np.int64)}


def build_bert_datasets(cfg: Any) -> tuple[Any, Any, Any]:
    """(train, valid, test) BERT datasets of a LoomConfig: mock tokens (``--mock-data`` or no
    data path) or the ``--data-path`` family of flags (blends, ``--split``), whose tokenizer
    (``PREFIX.tokenizer.json``) gives the special ids and the word starts."""
    from loom.data.blended import blend_prefixes, build_datasets, map_sets
    from loom.data.preprocess import load_tokenizer_for
    d, m, t = cfg.data, cfg.model, cfg.training
    window = m.seq_length - 2
    kw = dict(mask_prob=d.mask_prob, short_seq_prob=d.short_seq_prob,
              binary_head=m.bert_binary_head)
    prefixes = blend_prefixes(d.data_path or d.train_data_path or d.valid_data_path
                              or d.test_data_path)
    if d.mock_data or not prefixes:
        specials = mock_specials(m.vocab_size)
        return tuple(BertDataset(_MockWindows(m.vocab_size, window, t.seed + i), m.seq_length,
                                 specials, m.vocab_size, t.seed + i, **kw) if i < 2 else None
                     for i in range(3))
    tok = load_tokenizer_for(prefixes[0])
    specials, starts = special_ids(tok), word_starts(tok)
    sets = build_datasets(d, window, t.seed, separate_valid=cfg.logging.multiple_validation_sets)
    return map_sets(lambda s: BertDataset(s, m.seq_length, specials, m.vocab_size, t.seed,
                                          starts=starts, **kw), sets)
