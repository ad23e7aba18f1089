"""``--task perplexity``: Megatron's WikiText-103 evaluation of a causal language model.

The text becomes one token stream of N tokens, cut into sliding windows
(:func:`~loom.evaluation.datasets.lm_windows`; ``--overlapping-eval`` stride), so each of the
N - 1 targets is scored once. Reported, as Megatron's ``evaluate_and_print_results``:

* ``loss`` = total loss / (N - 1), ``perplexity`` = exp(loss);
* ``token_ratio`` = (N - 1) / (W - 1) with W Megatron's word count of the original text
  (``num_original_tokens``), and ``word_perplexity`` = exp(loss x token_ratio)
  = exp(total loss / (W - 1)): perplexity per word, comparable across tokenizers (Megatron's
  "adjusted ppl"). Megatron clips both exponents at 20 for printing; loom does not.
"""

from __future__ import annotations

import math

from loom.errors import ConfigError
from loom.evaluation import causal
from loom.evaluation.datasets import lm_windows, read_stream
from loom.evaluation.tasks import Task


def samples(request, tokenizer):
    """Windows of ``request.eval_data`` (flags ``--eval-data``, ``--json-key``,
    ``--seq-length``, ``--overlapping-eval``) and the facts the report needs."""
    stream = read_stream(request.eval_data, tokenizer, request.json_key)
    n = len(stream.tokens)
    if n < 2:
        raise ConfigError(f"--eval-data {request.eval_data}: {n} token(s); perplexity needs at "
                          f"least 2 (a token and one to predict)")
    s = request.seq_length
    stride = request.overlapping_eval or s
    windows = lm_windows(stream.tokens, s, stride, tokenizer.eod)
    info = {"data": stream.source, "documents": stream.documents, "tokens": n,
            "words": stream.words, "windows": len(windows), "seq_length": s,
            "overlapping_eval": stride}
    return windows, info


def report(sums: dict, info: dict) -> dict:
    """The metrics from the summed ``loss_sum`` / ``targets`` (see the module docstring)."""
    n, w = info["tokens"], info["words"]
    loss = sums["loss_sum"] / (n - 1)
    ratio = (n - 1) / (w - 1) if w and w > 1 else None
    return {"targets": int(round(sums["targets"])), "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)),
            "token_ratio": ratio,
            "word_perplexity": math.exp(min(loss * ratio, 700.0)) if ratio else None}


TASK = Task(name="perplexity", stats=("loss_sum", "targets"), samples=samples,
            forward=causal.forward, score=causal.masked_loss, report=report)
