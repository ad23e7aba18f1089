"""``--task mlm``: masked-LM accuracy and loss of a BERT checkpoint on held-out text.

The text (a text file, a ``.jsonl`` file or an indexed dataset, read as ``--task perplexity``
reads it: :func:`~loom.evaluation.datasets.read_stream`, documents ended by [SEP]) is cut into
consecutive windows of ``--seq-length - 2`` tokens, each a sample ``[CLS] window [SEP]`` (the
last one padded with [PAD]). The samples are masked by the training code itself
(:class:`~loom.data.bert_dataset.BertDataset`, no short samples, no sentence-order pairs):
``round(n x --mask-prob)`` whole words of each sample predicted, 80% [MASK] / 10% random /
10% kept, every draw from a generator seeded with ``(--seed, k)`` for sample ``k``, so the same
flags mask the same positions at every layout and in every run.

Per masked position: the cross-entropy of the original token under the full-vocabulary logits,
and whether the argmax is the original token. Reported: ``targets`` (masked positions),
``correct``, ``accuracy`` = correct / targets, ``loss`` = mean cross-entropy and
``perplexity`` = exp(loss).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from loom.errors import ConfigError
from loom.evaluation import causal
from loom.evaluation.datasets import Sample, read_stream
from loom.evaluation.tasks import Task


def windows(tokens: list, seq_length: int) -> list[dict]:
    """Consecutive windows of ``seq_length - 2`` tokens (the last may be shorter), as
    :class:`~loom.data.bert_dataset.BertDataset` sources them (``[k]["tokens"]``)."""
    n = seq_length - 2
    arr = np.asarray(tokens, dtype=np.int64)
    return [{"tokens": arr[i:i + n]} for i in range(0, len(arr), n)]


def masked_samples(tokens: list, tokenizer, seq_length: int, seed: int,
                   mask_prob: float) -> list[Sample]:
    """The masked samples of a token stream (see the module docstring); samples in which
    nothing could be masked (e.g. a window holding only [SEP]) are dropped."""
    from loom.data.bert_dataset import BertDataset, special_ids, word_starts
    ds = BertDataset(windows(tokens, seq_length), seq_length, special_ids(tokenizer),
                     tokenizer.vocab_size, seed, mask_prob=mask_prob, short_seq_prob=0.0,
                     binary_head=False, starts=word_starts(tokenizer))
    out = []
    for k in range(len(ds)):
        d = ds[k]
        if int(d["loss_mask"].sum()):
            out.append(Sample(d["tokens"].numpy().astype(np.int32),
                              d["labels"].numpy().astype(np.int32),
                              d["loss_mask"].numpy().astype(np.int8),
                              d["padding_mask"].numpy().astype(np.int8)))
    return out


def samples(request, tokenizer):
    """Masked samples of ``request.eval_data`` (``--json-key``, ``--seq-length``, ``--seed``,
    ``--mask-prob``) and the facts the report needs."""
    s, p = request.seq_length, request.mask_prob
    if s < 3:
        raise ConfigError(f"--seq-length {s}: a masked-LM sample is [CLS] tokens [SEP]; "
                          f"give at least 3")
    if not 0.0 < p <= 1.0:
        raise ConfigError(f"--mask-prob must be in (0, 1], got {p}")
    stream = read_stream(request.eval_data, tokenizer, request.json_key)
    rows = masked_samples(stream.tokens, tokenizer, s, request.seed, p)
    if not rows:
        raise ConfigError(f"--eval-data {request.eval_data}: no token to mask (the text is "
                          f"empty or only special tokens)")
    info = {"data": stream.source, "documents": stream.documents, "tokens": len(stream.tokens),
            "samples": len(rows), "seq_length": s, "mask_prob": p, "seed": request.seed}
    return rows, info


def forward(chunk, batch: dict, hidden_states=None) -> torch.Tensor:
    """The bidirectional chunk with the batch's padding mask: ``[b, s, Vp/t]`` masked-LM
    logits on the last stage (no labels: the head returns logits; the sentence-order logits
    are dropped), ``[s, b, h]`` hidden states on the others."""
    out = chunk(input_ids=batch["tokens"] if chunk.pre_process else None,
                hidden_states=hidden_states, position_ids=batch["position_ids"],
                padding_mask=batch.get("padding_mask"))
    return out[0] if chunk.post_process else out


def score(logits: torch.Tensor, batch: dict) -> dict:
    """Per sample, over its masked positions: ``targets``, ``correct`` (argmax = the original
    token) and ``loss_sum`` (summed cross-entropy)."""
    mask = batch["loss_mask"] > 0
    out = causal.masked_loss(logits, batch)
    out["correct"] = ((logits.argmax(-1) == batch["labels"]) & mask).float().sum(-1)
    return out


def report(sums: dict, info: dict) -> dict:
    """Accuracy, mean loss and perplexity over every masked position."""
    n = sums["targets"]
    loss = sums["loss_sum"] / n
    return {"targets": int(round(n)), "correct": int(round(sums["correct"])),
            "accuracy": sums["correct"] / n, "loss": loss,
            "perplexity": math.exp(min(loss, 700.0))}


TASK = Task(name="mlm", stats=("correct", "loss_sum", "targets"), samples=samples,
            forward=forward, score=score, report=report)
