"""The evaluation tasks by name: :data:`TASKS` loads each task's implementation (its module's
``TASK``, a :class:`~loom.evaluation.tasks.Task`, imported only when used); a model family says
which tasks it supports (``ModelFamily.evaluation_tasks``, e.g. BERT's ``("mlm",)``). Asking for
a task its family lacks is a ConfigError naming both."""

from __future__ import annotations

import importlib
from types import MappingProxyType

from loom.errors import ConfigError
from loom.evaluation.tasks import Task

TASKS = MappingProxyType({
    "perplexity": lambda: importlib.import_module("loom.evaluation.perplexity").TASK,  # causal
    "cloze": lambda: importlib.import_module("loom.evaluation.cloze").TASK,
    "mlm": lambda: importlib.import_module("loom.evaluation.mlm").TASK,  # masked LMs (BERT)
})


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
    return TASKS[task]()
