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

:data:`TASKS` names each task's implementation (``"module:ATTRIBUTE"``, imported only when
used); a model family says which tasks it supports (``ModelFamily.evaluation_tasks``, e.g.
BERT's ``("mlm",)``). Asking for a task its family lacks is a ConfigError naming both.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from loom.errors import ConfigError

TASKS = {
    "perplexity": "loom.evaluation.perplexity:TASK",  # causal LMs (GPT-style forward)
    "cloze": "loom.evaluation.cloze:TASK",
    "mlm": "loom.evaluation.mlm:TASK",  # masked LMs (BERT-style forward)
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
    """Every task loom implements, sorted (the choices of ``--task``)."""
    return sorted(TASKS)


def supported_tasks(family) -> list[str]:
    """The tasks ``family`` (a :class:`~loom.models.family.ModelFamily`) supports, sorted."""
    return sorted(t for t in family.evaluation_tasks if t in TASKS)


def get_task(family, task: str, where: str = "") -> Task:
    """The :class:`Task` ``task`` of ``family`` (a ModelFamily). Raises ConfigError "task X is
    not supported for model type Y" (``where``: e.g. the checkpoint, named in the message)."""
    if task not in supported_tasks(family):
        have = supported_tasks(family)
        raise ConfigError(
            f"--task {task} is not supported for model type {family.name}{where}; "
            + (f"tasks for {family.name}: {', '.join(have)}" if have else
               f"no evaluation task is supported by {family.name} yet "
               f"(ModelFamily.evaluation_tasks)"))
    module, attr = TASKS[task].split(":")
    return getattr(importlib.import_module(module), attr)
