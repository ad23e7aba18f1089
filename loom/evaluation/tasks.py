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

A family adds a task by one row in :data:`TASKS` (``"module:ATTRIBUTE"``, imported only when
used), e.g. BERT's masked-LM accuracy: ``("bert", "mlm"): "loom.evaluation.mlm:TASK"``.
Asking for a task its family lacks is a ConfigError naming both.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from loom.errors import ConfigError

TASKS = {
    ("gpt", "perplexity"): "loom.evaluation.perplexity:TASK",
    ("gpt", "cloze"): "loom.evaluation.cloze:TASK",
    ("mamba", "perplexity"): "loom.evaluation.perplexity:TASK",
    ("mamba", "cloze"): "loom.evaluation.cloze:TASK",
    ("bert", "mlm"): "loom.evaluation.mlm:TASK",
}


@dataclass(frozen=True)
class Task:
    """One evaluation task (see the module docstring for the four functions)."""

    name: str
    stats: tuple
    samples: Callable
    forward: Callable
    score: Callable
    report: Callable


def task_names() -> list[str]:
    """Every task some family supports, sorted (the choices of ``--task``)."""
    return sorted({task for _, task in TASKS})


def supported_tasks(family: str) -> list[str]:
    """The tasks registered for ``family``, sorted."""
    return sorted(task for fam, task in TASKS if fam == family)


def get_task(family: str, task: str, where: str = "") -> Task:
    """The :class:`Task` registered as ``(family, task)``. Raises ConfigError "task X is not
    supported for model type Y" (``where``: e.g. the checkpoint, named in the message)."""
    key = TASKS.get((family, task))
    if key is None:
        have = supported_tasks(family)
        raise ConfigError(
            f"--task {task} is not supported for model type {family}{where}; "
            + (f"tasks for {family}: {', '.join(have)}" if have else
               f"no evaluation task is registered for {family} yet (loom.evaluation.tasks.TASKS)"))
    module, attr = key.split(":")
    return getattr(importlib.import_module(module), attr)
