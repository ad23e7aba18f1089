"""Fill-in-the-middle samples (``--fim-data``): Megatron-LM's FIM GPT dataset semantics
(``megatron/training/datasets/fim_dataset.py`` at d98e8a6; Bavarian et al. 2022, "Efficient
Training of Language Models to Fill in the Middle", sec. 3) as a transform of loom's
next-token samples.

A sample of ``s + 1`` token ids is cut at every end-of-document id (``--fim-eod-token``); each
non-empty segment is transformed and followed by that id again (an empty segment, e.g. two
end-of-document ids in a row, is dropped together with its id, as in Megatron); the segment
after the last one is transformed too. With ``--fim-split-sample TOKEN`` a segment holding
TOKEN is, with probability ``--fim-rate``, cut again at TOKEN and each fragment transformed
with probability ``--fim-fragment-rate`` (the same rule for empty fragments); a segment
without TOKEN is transformed with ``--fim-rate``. The result is cut to ``s + 1`` ids or padded
with ``--fim-pad-token`` (not masked out of the loss, as in Megatron, whose GPT dataset masks
only the tokenizer's own pad id).

Transforming a sequence (with probability ``rate``): its text (special tokens dropped) is cut
at two character positions drawn uniformly from ``0..len(text)`` (sorted) into prefix, middle
and suffix, each tokenized again; with probability ``--fim-spm-rate`` the SPM order
``<prefix-id> <suffix-id> suffix <middle-id> prefix middle``, else PSM ``<prefix-id> prefix
<suffix-id> suffix <middle-id> middle``. A text that starts with ``--fim-no-prefix`` is kept.

Random draws, per transformed sequence and in Megatron's order: ``binomial(1, rate)``, then
``randint(0, len(text) + 1, size=2)``, then ``binomial(1, spm_rate)``, from a
``numpy.random.RandomState``. One difference: Megatron draws from one stream per dataset in the
order samples are read, so a sample depends on what was read before it; loom seeds a stream per
sample, ``RandomState([seed, k])`` for sample ``k``, so sample ``k`` is the same in every
process, run and restart (loom's data rule, :mod:`loom.data.gpt_dataset`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from loom.errors import ConfigError


@dataclass(frozen=True)
class FimSpec:
    """The ids and rates of a FIM transform: the five special ids (``prefix``, ``middle``,
    ``suffix``, ``pad``, ``eod``), ``split`` (the ``--fim-split-sample`` id or None), the rates
    and ``no_prefix`` (``--fim-no-prefix`` text or None)."""
    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    rate: float
    spm_rate: float
    split: Optional[int] = None
    fragment_rate: Optional[float] = None
    no_prefix: Optional[str] = None


class FimTransform:
    """Megatron's FIM transform of one sample (module docstring) with a tokenizer's
    ``text_of(ids) -> str`` (special tokens dropped) and ``ids_of(text) -> list[int]``."""

    def __init__(self, spec: FimSpec, text_of: Callable[[Sequence[int]], str],
                 ids_of: Callable[[str], Sequence[int]]):
        self.spec, self.text_of, self.ids_of = spec, text_of, ids_of

    def __call__(self, sample: np.ndarray, rng) -> np.ndarray:
        """int64[n] -> int64[n]: ``sample`` transformed with the draws of ``rng`` (a
        ``numpy.random.RandomState``)."""
        sp, n = self.spec, len(sample)
        breaks = np.flatnonzero(sample == sp.eod)
        parts, start = [], 0
        for loc in breaks:
            if loc > start:
                parts += [self._split_and_permute(sample[start:loc], rng), [sp.eod]]
            start = loc + 1
        parts.append(self._split_and_permute(sample[start:], rng))
        out = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
        if len(out) >= n:
            return out[:n]
        return np.concatenate([out, np.full(n - len(out), sp.pad, dtype=np.int64)])

    def _split_and_permute(self, seq: np.ndarray, rng) -> np.ndarray:
        sp = self.spec
        if sp.split is None:
            return self.permute(seq, sp.rate, rng)
        breaks = np.flatnonzero(seq == sp.split)
        if len(breaks) == 0:
            return self.permute(seq, sp.rate, rng)
        if not rng.binomial(1, sp.rate):
            return seq
        parts, start = [], 0
        for loc in breaks:
            if loc > start:
                parts += [self.permute(seq[start:loc], sp.fragment_rate, rng), [sp.split]]
            start = loc + 1
        parts.append(self.permute(seq[start:], sp.fragment_rate, rng))
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])

    def permute(self, seq: np.ndarray, rate: float, rng) -> np.ndarray:
        """``seq`` in SPM or PSM order with probability ``rate`` (lengths may change), else
        ``seq``."""
        sp = self.spec
        if not rng.binomial(1, rate):
            return seq
        text = self.text_of(seq)
        if sp.no_prefix is not None and text.startswith(sp.no_prefix):
            return seq
        lo, hi = sorted(int(b) for b in rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (np.asarray(list(self.ids_of(t)), dtype=np.int64)
                                  for t in (text[:lo], text[lo:hi], text[hi:]))
        if rng.binomial(1, sp.spm_rate):
            pieces = [[sp.prefix, sp.suffix], suffix, [sp.middle], prefix, middle]
        else:
            pieces = [[sp.prefix], prefix, [sp.suffix], suffix, [sp.middle], middle]
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])


class FimDataset:
    """``base`` (a next-token dataset: ``ds[k]`` = ``{"tokens": [s], "labels": [s], ...}``)
    with every sample's ``s + 1`` ids FIM-transformed by ``transform`` (seeded ``[seed, k]``);
    other keys pass through."""

    def __init__(self, base: Any, transform: FimTransform, seed: int):
        self.base, self.transform, self.seed = base, transform, int(seed)

    def __len__(self) -> int:
        return len(self.base)

    def __getattr__(self, name: str):  # describe(), weights, ... of the wrapped dataset
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def __getitem__(self, k: int) -> dict:
        item = dict(self.base[k])
        tokens, labels = item["tokens"], item["labels"]
        sample = torch.cat([tokens, labels[-1:]]).numpy()
        out = torch.from_numpy(self.transform(sample, np.random.RandomState([self.seed, int(k)])))
        item["tokens"], item["labels"] = out[:-1], out[1:]
        return item


FIM_TOKEN_FLAGS = (("prefix", "--fim-prefix-token"), ("middle", "--fim-middle-token"),
                   ("suffix", "--fim-suffix-token"), ("pad", "--fim-pad-token"),
                   ("eod", "--fim-eod-token"))


def fim_spec(data: Any, tokenizer, where: str) -> FimSpec:
    """The :class:`FimSpec` of a DataConfig ``data`` with ``tokenizer``
    (:class:`loom.data.tokenizer.Tokenizer`); ConfigError naming the flag when a FIM token is
    not one id of it (``where``: the dataset, for the message)."""
    def one_id(flag: str, token: str) -> int:
        i = tokenizer.hf.token_to_id(token)
        if i is None:
            raise ConfigError(f"{flag} {token!r}: the tokenizer of {where} has no such token; "
                              f"preprocess the data with a tokenizer that defines the FIM tokens, "
                              f"or give {flag} one of its tokens")
        return int(i)
    ids = {role: one_id(flag, getattr(data, f"fim_{role}_token")) for role, flag in FIM_TOKEN_FLAGS}
    split = None if data.fim_split_sample is None else \
        one_id("--fim-split-sample", data.fim_split_sample)
    return FimSpec(**ids, rate=data.fim_rate, spm_rate=data.fim_spm_rate, split=split,
                   fragment_rate=data.fim_fragment_rate, no_prefix=data.fim_no_prefix)


def fim_transform(data: Any, tokenizer, where: str) -> FimTransform:
    """The FIM transform of a DataConfig ``data`` over ``tokenizer``'s text (decoded without
    special tokens, as Megatron's ``ids_to_text(..., remove_special_tokens=True)``)."""
    spec = fim_spec(data, tokenizer, where)
    return FimTransform(spec, lambda ids: tokenizer.hf.decode([int(i) for i in ids],
                                                              skip_special_tokens=True),
                        tokenizer.encode)

