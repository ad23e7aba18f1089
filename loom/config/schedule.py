"""The optimizer-parameter schedule's own flags beyond ``--lr-decay-style``: warmup-stable-decay's
annealing (``--lr-wsd-decay-style``, ``--lr-wsd-decay-iters`` / ``-samples``) and the
weight-decay schedule (``--start-weight-decay``, ``--end-weight-decay``,
``--weight-decay-incr-style``), with Megatron-LM d98e8a6's names, meanings and defaults
(``megatron/training/config/training_config.py``, ``SchedulerConfig``; the rules of
``megatron/training/arguments.py`` ``validate_args`` and Megatron-Core's
``OptimizerParamScheduler``), a mixin of :class:`~loom.config.sections.TrainingConfig`, and
their resolution (:func:`resolve_schedule`, part of the one validation pass). The schedule
itself: :mod:`loom.training.param_schedule`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Optional

from loom.config.fields import opt
from loom.errors import ConfigError

WsdDecayStyle = Literal["exponential", "linear", "cosine", "minus_sqrt"]
WdIncrStyle = Literal["constant", "linear", "cosine"]


@dataclass
class ScheduleFields:
    """Warmup-stable-decay annealing and the weight-decay schedule (read by
    :func:`loom.training.param_schedule.lr_at` / :func:`~loom.training.param_schedule.wd_at`)."""

    lr_wsd_decay_style: WsdDecayStyle = opt(
        "exponential", "--lr-decay-style WSD: shape of the final annealing, at fraction r of it "
                       "the coefficient of (--lr - --min-lr) is exponential 2 x 0.5^r - 1, "
                       "linear 1 - r, cosine (1 + cos(pi r)) / 2 or minus_sqrt 1 - sqrt(r)")
    lr_wsd_decay_iters: Optional[int] = opt(
        None, "--lr-decay-style WSD: iterations of the final annealing, ending at "
              "--lr-decay-iters (the learning rate stays at --lr before it; required with WSD)",
        ge=0)
    lr_wsd_decay_samples: Optional[int] = opt(
        None, "--lr-decay-style WSD with --train-samples: the annealing in samples (converted "
              "to iterations of B samples, rounded up)", ge=0)
    start_weight_decay: Optional[float] = opt(
        None, "weight decay at iteration 0 with --weight-decay-incr-style linear or cosine "
              "(required then; with constant: --weight-decay)", ge=0)
    end_weight_decay: Optional[float] = opt(
        None, "weight decay at --train-iters with --weight-decay-incr-style linear or cosine "
              "(required then, >= --start-weight-decay)", ge=0)
    weight_decay_incr_style: WdIncrStyle = opt(
        "constant", "weight decay from --start-weight-decay to --end-weight-decay over "
                    "--train-iters: constant (--weight-decay throughout), linear or cosine")


def resolve_schedule(cfg: Any, world_size: int) -> None:
    """Megatron's rules for these flags, in place on the training section of ``cfg`` (inside
    validation for ``world_size`` ranks, after the other samples flags):
    ``--lr-wsd-decay-samples`` -> ``--lr-wsd-decay-iters`` (rounded up, as loom's other sample
    counts); WSD needs its annealing length (Megatron's ``OptimizerParamScheduler`` asserts
    it); ``--start/--end-weight-decay`` are given exactly when the increment style is not
    constant, the end no smaller than the start (``validate_args`` and the scheduler assert
    both). Raises ConfigError naming the flag and the fix."""
    _wsd(cfg, world_size)
    _weight_decay(cfg.training)


def _wsd(cfg: Any, world_size: int) -> None:
    t = cfg.training
    if t.lr_wsd_decay_samples is not None:
        if t.train_samples is None:
            raise ConfigError("--lr-wsd-decay-samples describes a run by samples: give "
                              "--train-samples N (or use --lr-wsd-decay-iters with "
                              "--train-iters), as Megatron-LM requires")
        if t.lr_wsd_decay_iters is not None:
            raise ConfigError("--lr-wsd-decay-iters and --lr-wsd-decay-samples both set the WSD "
                              "annealing: give the samples one with --train-samples")
        batch = cfg.global_batch_size(world_size)
        t.lr_wsd_decay_iters = math.ceil(t.lr_wsd_decay_samples / batch)
    if t.lr_decay_style == "WSD" and t.lr_wsd_decay_iters is None:
        raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters N (or "
                          "--lr-wsd-decay-samples with --train-samples): the length of the final "
                          "annealing, which Megatron-LM requires")


def _weight_decay(t: Any) -> None:
    given = [name for name in ("start_weight_decay", "end_weight_decay")
             if getattr(t, name) is not None]
    if t.weight_decay_incr_style == "constant":
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --weight-decay-incr-style "
                              f"linear or cosine (with constant, the weight decay is "
                              f"--weight-decay throughout; Megatron-LM's rule)")
        return
    if len(given) < 2:
        raise ConfigError(f"--weight-decay-incr-style {t.weight_decay_incr_style} needs both "
                          f"--start-weight-decay and --end-weight-decay (Megatron-LM's rule)")
    if t.end_weight_decay < t.start_weight_decay:
        raise ConfigError(f"--end-weight-decay {t.end_weight_decay} is below "
                          f"--start-weight-decay {t.start_weight_decay}: the schedule only "
                          f"increases the weight decay (Megatron-LM's rule); swap them")


def weight_decay_range(t: Any) -> tuple[float, float]:
    """``(start, end)`` weight decay of the training section ``t``: ``--weight-decay`` twice
    with the constant increment style (Megatron's ``validate_args`` sets both to it), else
    ``--start-weight-decay`` and ``--end-weight-decay``."""
    if t.weight_decay_incr_style == "constant" or t.start_weight_decay is None:
        return t.weight_decay, t.weight_decay
    return t.start_weight_decay, t.end_weight_decay
