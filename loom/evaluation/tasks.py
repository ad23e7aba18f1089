"""The evaluation tasks, registered per model family: ``(family, task) -> Task``.

A :class:`Task` states what one evaluation is, independently of the layout it runs at:

* ``samples(request, tokenizer) -> (samples, info)``: the evaluation data as fixed-length
  :class:`~loom.evaluation.datasets.Sample` rows (inputs, labels, a mask of the positions that
  count) and facts for the report (e.g. the word count of the original text);
* ``forward(chunk, batch, hidden_states) -> output``: the family's forward pass in evaluation
  form; on the last pipeline stage it returns this TP rank's logits ``[b, s, Vp/t]``;
* ``score(logits, batch) -> {statistic: [b]}``: per-sample sums from the full-vocabulary logits
  ``[b, s, V]`` (fp32), one per name in ``stats``; loom adds them over samples, micro-batches
  and DP ranks;
* ``report(sums, info) -> dict``: the metrics, from the summed statistics.

Each task's module (perplexity, cloze, mlm) defines its ``TASK``; the registry of task names
is :mod:`loom.evaluation.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Task:
    """One evaluation task (see the module docstring for the four functions)."""

    name: str
    stats: tuple
    samples: Callable
    forward: Callable
    score: Callable
    report: Callable
