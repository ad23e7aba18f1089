"""``loom train``: Megatron-style flags (or ``--config FILE.yaml``), one rank or many via torchrun.

Every check of the layout runs before any process group starts (``LoomConfig.validate``), so a
wrong flag costs nothing. ``--dry-run`` prints the planner's memory and time prediction for
exactly these flags and exits.
"""

from __future__ import annotations

import argparse
import os

from loom.config import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def run(args: argparse.Namespace) -> int:
    from loom.training.trainer import resolve_vocab  # torch import only past argument parsing
    cfg = resolve_vocab(config_from_args(args))
    world = world_size_from_env()
    cfg.validate(world)
    if cfg.data.data_path and not cfg.data.mock_data:
        from loom.data.indexed import IndexedDataset
        IndexedDataset(cfg.data.data_path)  # a missing or truncated file fails here, clearly
    if cfg.training.dry_run:
        from loom.planner.predict import format_prediction, predict_layout
        print(format_prediction(predict_layout(cfg, world)))
        return 0
    from loom.training.trainer import Trainer
    Trainer(cfg).train()
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
