"""Weights & Biases logging beside TensorBoard (``--wandb-project``, ``--wandb-exp-name``,
``--wandb-save-dir``, ``--wandb-entity``; Megatron-LM's flags and meaning: one run per job,
written by rank 0, its files under ``--wandb-save-dir``, default ``--save``/wandb). Offline runs
(``WANDB_MODE=offline``) need no network; ``wandb sync DIR`` uploads them later.
"""

from __future__ import annotations

import os
from typing import Optional

from loom.errors import ConfigError


class WandbWriter:
    """One W&B run: the flat config as its config, each logged record as ``{kind}/{key}``
    scalars at step = iteration.

    Raises ConfigError when the ``wandb`` package is missing (``pip install loom[wandb]``)."""

    def __init__(self, config: dict):
        try:
            import wandb
        except ImportError:
            raise ConfigError("--wandb-project needs the wandb package: pip install wandb (or "
                              "loom's extra: pip install -e '.[wandb]')") from None
        save_dir = wandb_dir(config)
        os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=config["wandb_project"], name=config.get("wandb_exp_name"),
                              entity=config.get("wandb_entity"), dir=save_dir, config=config,
                              reinit="create_new")
        self.dir = self.run.dir

    def log(self, record: dict, kind: str) -> None:
        """``record``'s numbers as ``{kind}/{key}`` at step ``record["iteration"]``."""
        values = {f"{kind}/{k}": v for k, v in record.items()
                  if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.run.log(values, step=int(record["iteration"]))

    def close(self) -> None:
        """Finish the run (offline: its files complete in the save directory)."""
        self.run.finish()


def wandb_dir(config: dict) -> str:
    """Where the run's files go: ``--wandb-save-dir``, else ``--save``/wandb (Megatron's
    default), else ./wandb."""
    return config.get("wandb_save_dir") or (
        os.path.join(config["save"], "wandb") if config.get("save") else "wandb")


def open_wandb(config: Optional[dict]) -> Optional[WandbWriter]:
    """A :class:`WandbWriter` when ``config`` (the flat run config) names
    ``--wandb-project``, else None."""
    if not config or not config.get("wandb_project"):
        return None
    return WandbWriter(config)
