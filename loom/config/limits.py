"""Values no training run means, refused before anything starts (torch-free): an absurd
iteration count, periodic evaluation without validation data. Called by
:func:`loom.config.validate.validate_config`. A warm-up longer than ``--train-iters`` is not
among them: it is a slice of a longer schedule (Megatron-LM's own speed tests run 25 iterations
of a 1.5M-iteration warm-up), and Megatron runs it."""

from __future__ import annotations

from typing import Any

from loom.config.split import parse_split
from loom.errors import ConfigError

MAX_TRAIN_ITERS = 10 ** 9  # a billion optimizer steps: beyond any run (GPT-3: ~1e5)


def check_limits(cfg: Any) -> None:
    """Values no run means: an absurd ``--train-iters``, a periodic ``--eval-interval`` with a
    ``--split`` that leaves no validation documents (and no ``--valid-data-path``). Raises
    ConfigError."""
    t, d = cfg.training, cfg.data
    if t.train_iters is not None and t.train_iters > MAX_TRAIN_ITERS:
        raise ConfigError(f"--train-iters {t.train_iters} exceeds {MAX_TRAIN_ITERS:.0e} "
                          f"iterations, beyond any training run: give the number of optimizer "
                          f"steps (or --train-samples)")
    lg = cfg.logging
    if lg.eval_interval and lg.eval_iters and d.data_path and not d.mock_data and \
            not d.valid_data_path and parse_split(d.split)[1] == 0:
        raise ConfigError(f"--eval-interval {lg.eval_interval} evaluates on validation data but "
                          f"--split {d.split} leaves none: give the second (validation) weight a "
                          f"positive share, --valid-data-path, or drop --eval-interval")
