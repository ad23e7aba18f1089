"""``--task cloze``: LAMBADA accuracy (Megatron's ``tasks/zeroshot_gpt``, metric "accuracy").

Each jsonl line ``{"text": ...}`` is one example: the context, then the target (the last token;
with ``--strict-lambada`` the last whitespace-separated word, all its tokens). An example is
correct when the greedy (argmax) prediction at every target position is the target token
(Megatron: ``correct[~loss_mask] = 1; correct.prod(-1)``). Reported: ``accuracy`` = correct /
examples, and the mean loss of the target tokens (``target_loss``, and its exp).
"""

from __future__ import annotations

import math

import torch

from loom.evaluation import causal
from loom.evaluation.datasets import cloze_samples
from loom.evaluation.tasks import Task


def samples(request, tokenizer):
    """One sample per example of ``request.eval_data`` (``--seq-length``,
    ``--strict-lambada``)."""
    rows = cloze_samples(request.eval_data, tokenizer, request.seq_length,
                         request.strict_lambada)
    return rows, {"data": request.eval_data, "examples": len(rows),
                  "target": "last word (--strict-lambada)" if request.strict_lambada
                  else "last token", "seq_length": request.seq_length}


def score(logits: torch.Tensor, batch: dict) -> dict:
    """Per example: ``correct`` (1 when every target token is the argmax), ``examples`` (1),
    and the target tokens' ``loss_sum`` / ``targets``."""
    mask = batch["loss_mask"] > 0
    hit = (logits.argmax(-1) == batch["labels"]) | ~mask
    out = causal.masked_loss(logits, batch)
    out.update(correct=hit.all(-1).float(), examples=torch.ones_like(out["targets"]))
    return out


def report(sums: dict, info: dict) -> dict:
    """Accuracy and the target tokens' mean loss."""
    loss = sums["loss_sum"] / sums["targets"]
    return {"correct": int(round(sums["correct"])), "accuracy": sums["correct"] / sums["examples"],
            "target_loss": loss, "target_perplexity": math.exp(min(loss, 700.0))}


TASK = Task(name="cloze", stats=("correct", "examples", "loss_sum", "targets"), samples=samples,
            forward=causal.forward, score=score, report=report)
