"""The optimizer-parameter schedule: the learning rate and the weight decay of every parameter
group at every iteration (Megatron-Core's ``OptimizerParamScheduler``,
``megatron/core/optimizer_param_scheduler.py``: ``get_lr``, ``get_wd``, ``step``).

Megatron counts its schedule in samples (``num_steps`` grows by the global batch B each step;
warm-up, decay and weight-decay lengths are iterations x B, or the ``--*-samples`` flags); loom
counts iterations, which is the same ratio everywhere but where Megatron clamps a count to 1
(inverse-square-root without warm-up: ``batch`` = B), and where a ``--train-samples`` run's
weight-decay increment ends (``--train-samples``, not whole iterations). Loom takes the warm-up
one step ahead (iteration i warms up as Megatron's count i + 1, so no step is spent at
``--lr-warmup-init``); from the end of the warm-up on, iteration i is Megatron's count i.
Under a batch-size ramp (:mod:`loom.config.batch_ramp`) B varies, so a ``--train-samples`` run
counts samples as Megatron does (:func:`sample_lengths`, :func:`lr_on`); a ``--train-iters``
run keeps counting iterations (Megatron-LM's step schedule counts ``--lr-*-iters`` in units of
b x d samples there, its ``--global-batch-size`` default). Under
``--decrease-batch-size-if-needed`` an iteration consumes the running batch, fewer than B
samples, which may change at a restart on another data-parallel size: the schedule then counts
the samples consumed, as Megatron's does (``--train-samples`` lengths in samples; ``--*-iters``
lengths in units of B, Megatron's ``iterations x --global-batch-size``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from loom.config import TrainingConfig
from loom.config.schedule import weight_decay_range


def group_schedule(group: dict, cfg: TrainingConfig) -> tuple[float, float]:
    """``(max_lr, min_lr)`` of an optimizer parameter group: its own (``--decoupled-lr``) or
    ``--lr`` / ``--min-lr``."""
    return group.get("max_lr", cfg.lr), group.get("min_lr", cfg.min_lr)


def warmup_iters(cfg: TrainingConfig) -> int:
    """W: ``--lr-warmup-iters``, or ``--lr-warmup-fraction`` x the decay iterations (rounded
    down)."""
    if cfg.lr_warmup_fraction is None:
        return cfg.lr_warmup_iters
    return int(cfg.lr_warmup_fraction * (cfg.lr_decay_iters or cfg.train_iters))


def _wsd_coeff(x: float, decay: float, anneal: float, style: str) -> float:
    """Warmup-stable-decay's coefficient of (max - min): 1 until the last ``anneal`` A of the
    decay D (``--lr-wsd-decay-iters``, in the schedule's count), then at fraction
    r = (x - (D - A)) / A of them ``--lr-wsd-decay-style``: exponential 2 x 0.5^r - 1, linear
    1 - r, cosine (1 + cos(pi r)) / 2, minus_sqrt 1 - sqrt(r) (Hu et al. 2024, MiniCPM, sec. 4;
    Megatron's ``get_lr`` WSD branch)."""
    start = decay - anneal
    if x <= start:
        return 1.0
    r = (x - start) / anneal
    if style == "exponential":
        return 2.0 * 0.5 ** r - 1.0
    if style == "linear":
        return 1.0 - r
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * r) + 1.0)
    return 1.0 - math.sqrt(r)  # minus_sqrt


def lr_at(iteration: int, cfg: TrainingConfig, max_lr: Optional[float] = None,
          min_lr: Optional[float] = None, batch: int = 1) -> float:
    """Learning rate of optimizer step ``iteration`` (0-based; the scheduler's ``last_epoch``).

    Warm-up over W iterations (:func:`warmup_iters`): ``init + (max - init) x n / W`` with
    n = min(iteration + 1, W) (``--lr-warmup-init`` to ``max_lr``, default ``--lr``). Then
    ``--lr-decay-style`` down to ``min_lr`` (default ``--min-lr``), reached at D =
    ``--lr-decay-iters`` (default ``--train-iters``) and kept after it: ``min + c x (max - min)``
    with, at fraction f = (i - W) / (D - W) of the decay, c = 1 - f (linear),
    (1 + cos(pi f)) / 2 (cosine), WSD's (:func:`_wsd_coeff`); constant keeps ``max``;
    inverse-square-root is ``max x sqrt(max(W B, 1) / max(i B, 1))``, at least ``min``
    (``batch`` = B samples an iteration, Megatron's count; it matters only without warm-up).
    ``max_lr`` / ``min_lr``: a parameter group's own (``--decoupled-lr``,
    ``--decoupled-min-lr``). Source: Megatron-Core ``OptimizerParamScheduler.get_lr``."""
    return lr_on(iteration, iteration + 1, iteration_lengths(cfg), cfg, max_lr, min_lr, batch)


def iteration_lengths(cfg: TrainingConfig) -> tuple[float, float, float]:
    """(W, D, A) in iterations: warm-up (:func:`warmup_iters`), decay end (``--lr-decay-iters``,
    default ``--train-iters``) and WSD's annealing (``--lr-wsd-decay-iters``)."""
    return warmup_iters(cfg), cfg.lr_decay_iters or cfg.train_iters, cfg.lr_wsd_decay_iters or 0


def sample_lengths(cfg: TrainingConfig, batch: int) -> tuple[float, float, float]:
    """(W, D, A) in samples, Megatron's sample-based lengths (``get_optimizer_param_scheduler``):
    D = ``--lr-decay-samples`` (default ``--train-samples``), W = ``--lr-warmup-fraction`` x D
    or ``--lr-warmup-samples``, A = ``--lr-wsd-decay-samples`` (or ``--lr-wsd-decay-iters`` x
    the final B ``batch``)."""
    decay = cfg.lr_decay_samples if cfg.lr_decay_samples is not None else cfg.train_samples
    warmup = cfg.lr_warmup_fraction * decay if cfg.lr_warmup_fraction is not None else \
        cfg.lr_warmup_samples
    anneal = cfg.lr_wsd_decay_samples if cfg.lr_wsd_decay_samples is not None else \
        (cfg.lr_wsd_decay_iters or 0) * batch
    return warmup, decay, anneal


def lr_on(x: float, ahead: float, lengths: tuple[float, float, float], cfg: TrainingConfig,
          max_lr: Optional[float] = None, min_lr: Optional[float] = None,
          unit: int = 1) -> float:
    """:func:`lr_at` in any count: ``x`` the step's position (iterations, or samples consumed
    before it), ``ahead`` the position after it (loom's warm-up is one step ahead), ``lengths``
    (W, D, A) in the same count (:func:`iteration_lengths`, :func:`sample_lengths`); ``unit``:
    samples per count (inverse-square-root's clamp)."""
    peak = cfg.lr if max_lr is None else max_lr
    low = cfg.min_lr if min_lr is None else min_lr
    warmup, decay_iters, anneal = lengths
    if warmup > 0 and x <= warmup:
        init = cfg.lr_warmup_init
        return init + (peak - init) * min(ahead, warmup) / warmup
    style = cfg.lr_decay_style
    if style == "constant":
        return peak
    if x > decay_iters:
        return low
    if style == "inverse-square-root":
        return max(low, peak * math.sqrt(max(warmup * unit, 1)) / math.sqrt(
            max(x * unit, 1)))
    if style == "WSD":
        coeff = _wsd_coeff(x, decay_iters, anneal, cfg.lr_wsd_decay_style)
    else:
        frac = max(x - warmup, 0) / max(decay_iters - warmup, 1)
        coeff = 1.0 - frac if style == "linear" else 0.5 * (math.cos(math.pi * frac) + 1.0)
    return low + coeff * (peak - low)


def wd_at(iteration: int, cfg: TrainingConfig, batch: int = 1,
          done: Optional[int] = None) -> float:
    """Weight decay of optimizer step ``iteration`` before a group's multiplier: from
    ``--start-weight-decay`` to ``--end-weight-decay`` over the run (``--train-iters`` x B
    samples, or ``--train-samples``; ``batch`` = B), at fraction r of it r (linear) or
    (1 + cos(pi (1 - r))) / 2 (cosine), the end value after it; ``--weight-decay`` throughout
    with the constant style. ``done``: the samples consumed before the step when B varies
    (a batch-size ramp; default ``iteration`` x B). Source: Megatron-Core
    ``OptimizerParamScheduler.get_wd``."""
    start, end = weight_decay_range(cfg)
    if cfg.weight_decay_incr_style == "constant":
        return end
    total = cfg.train_samples if cfg.train_samples is not None else cfg.train_iters * batch
    done = iteration * batch if done is None else done
    if done > total:
        return end
    r = done / total
    coeff = r if cfg.weight_decay_incr_style == "linear" else \
        0.5 * (math.cos(math.pi * (1.0 - r)) + 1.0)
    return start + coeff * (end - start)


class ParamScheduler(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` following :func:`lr_at`, each parameter group with its own peak and minimum
    (:func:`group_schedule`), that also sets each group's ``weight_decay`` to :func:`wd_at` x
    its ``wd_mult`` (1 for the weights, 0 for biases and norms: Megatron's per-group
    multiplier; a group without one: 1 if it was built with a weight decay, else 0) at every
    step. ``last_epoch`` is the iteration. ``batch``: B samples an iteration (the final B of a
    ramp). ``ramp``: a :class:`~loom.config.batch_ramp.BatchRamp`; with ``--train-samples`` the
    schedule then counts samples as Megatron's does (iteration i at the samples consumed before
    it, :func:`sample_lengths`), with ``--train-iters`` iterations. Its state dict is
    ``LambdaLR``'s (the config is not saved)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: TrainingConfig, batch: int = 1,
                 ramp=None, running: Optional[int] = None):
        self._cfg, self._batch = cfg, batch
        self._ramp = ramp if ramp is not None and cfg.train_samples is not None else None
        self._running = running if cfg.decrease_batch_size_if_needed else None
        self._anchor = (0, 0)  # (iteration, samples consumed before it) of the running count
        lambdas = []
        for group in optimizer.param_groups:
            peak, low = group_schedule(group, cfg)
            group.update(lr=peak, max_lr=peak, min_lr=low)  # LambdaLR's base: lr = base x f
            group.setdefault("wd_mult", 1.0 if group.get("weight_decay") else 0.0)
            lambdas.append(lambda it, peak=peak, low=low: self.lr_of(it, peak, low) / peak)
        super().__init__(optimizer, lambdas)

    def anchor(self, iteration: int, consumed: int) -> None:
        """A resumed run: ``consumed`` samples were trained on before ``iteration`` (under
        ``--decrease-batch-size-if-needed`` at the saving run's batch, which may not be this
        run's; the running count goes on from there)."""
        self._anchor = (iteration, consumed)

    def consumed_before(self, iteration: int) -> Optional[int]:
        """Samples consumed before step ``iteration`` when the schedule counts samples (a
        sample-based ramp, ``--decrease-batch-size-if-needed``), else None."""
        if self._ramp is not None:
            return self._ramp.consumed_before(iteration)
        if self._running is None:
            return None
        it, consumed = self._anchor
        return consumed + (iteration - it) * self._running

    def lr_of(self, iteration: int, peak: float, low: float) -> float:
        """The learning rate of step ``iteration`` for a group of peak ``peak``, minimum
        ``low``: :func:`lr_at`, or at the samples consumed (:meth:`consumed_before`)."""
        cfg, x = self._cfg, self.consumed_before(iteration)
        if x is None:
            return lr_at(iteration, cfg, peak, low, self._batch)
        ahead = self.consumed_before(iteration + 1)
        if cfg.train_samples is not None:
            return lr_on(x, ahead, sample_lengths(cfg, self._batch), cfg, peak, low)
        b = self._batch  # --train-iters: Megatron's lengths are iterations x B samples
        return lr_on(x / b, ahead / b, iteration_lengths(cfg), cfg, peak, low, b)

    def step(self) -> None:  # noqa: D102 - LambdaLR's, then the weight decay
        super().step()
        self._set_weight_decay()

    def _set_weight_decay(self) -> None:
        it = self.last_epoch
        wd = wd_at(it, self._cfg, self._batch, self.consumed_before(it))
        for group in self.optimizer.param_groups:
            group["weight_decay"] = wd * group["wd_mult"]

    def resync(self) -> None:
        """After a checkpoint's state was loaded: the peaks are this run's (each group's
        ``max_lr``, which a loaded ``base_lrs`` may not be), and every group's learning rate and
        weight decay are this schedule's at the loaded ``last_epoch``."""
        peaks = [group_schedule(g, self._cfg) for g in self.optimizer.param_groups]
        self.base_lrs = [peak for peak, _ in peaks]
        lrs = [self.lr_of(self.last_epoch, peak, low) for peak, low in peaks]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs
        self._set_weight_decay()

    def state_dict(self) -> dict:  # noqa: D102 - LambdaLR's, without the config
        state = super().state_dict()
        for key in ("_cfg", "_batch", "_ramp", "_running", "_anchor"):
            state.pop(key, None)
        return state


def build_scheduler(optimizer, cfg: TrainingConfig, batch: int = 1,
                    ramp=None, running: Optional[int] = None) -> ParamScheduler:
    """The :class:`ParamScheduler` of ``optimizer`` (its inner ``torch.optim`` optimizer for a
    :class:`~loom.training.distributed_optimizer.DistributedOptimizer`); ``batch``: B, the
    global batch in samples (the run's ``cfg.derived.global_batch_size``); ``ramp``: the run's
    batch-size ramp (:class:`~loom.config.batch_ramp.BatchRamp`) or None; ``running``: the
    samples an iteration consumes (``derived.running_global_batch_size``), which the schedule
    counts under ``--decrease-batch-size-if-needed``."""
    return ParamScheduler(getattr(optimizer, "optim", optimizer), cfg, batch, ramp, running)
