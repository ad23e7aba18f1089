"""The run's evaluations: when the loop evaluates, on which sets, over which samples (Megatron-LM
d98e8a6, ``megatron/training/training.py``: ``train``'s evaluation condition, ``evaluate``,
``evaluate_and_print_results``, ``build_train_valid_test_data_iterators``).

- When: after every ``--eval-interval``-th iteration from ``--start-eval-at-iter`` on, and once
  after the last iteration (always, as Megatron evaluates after its loop); the test set then.
- What: each evaluation reads the first ``--eval-iters`` x B_eval samples of the set (the same
  samples every time, so values compare across evaluations) and reports their mean loss.
- ``--full-validation``: each validation set whole, every sample once: one epoch of the
  dataset (Megatron's size: ``eval_samples`` None builds a single epoch; a blend weighed by its
  datasets' sizes is one epoch of each). floor(N / B_eval) evaluation iterations, then the last
  N mod B_eval samples in micro-batches of one sample per DP rank (Megatron's
  ``MegatronFullValidationSampler``), a rank with none left reading a filler weighed 0;
  Megatron's cyclic iterator instead re-reads a short rank's first samples. The loss is each
  micro-batch's mean weighed by its real samples: the mean over the N samples.
- ``--multiple-validation-sets``: each dataset of ``--valid-data-path`` is evaluated on its own
  and logged as ``validation-NAME`` (``--validation-set-names``, default 0, 1, ...): the
  records carry ``valid_set`` NAME (TensorBoard / W&B group ``valid-NAME``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from loom.data.sampler import microbatch_indices
from loom.errors import ConfigError
from loom.parallel.pipeline.schedules import forward_only
from loom.parallel.pipeline.zero_bubble import is_v_shaped

ENDLESS = 1 << 40
"""``len()`` of a dataset without an end (mock data, a weighted blend)."""


def pass_samples(dataset: Any) -> Optional[int]:
    """Samples of one epoch of ``dataset`` (each sample once): a blend weighed by its datasets'
    sizes sums their epochs (``epoch_samples``), any other dataset is its ``len()``; None when
    endless (mock data, a weighted blend)."""
    n = getattr(dataset, "epoch_samples", None)
    n = len(dataset) if n is None else n
    return n if n < ENDLESS else None


def full_pass(n: int, micro_batch_size: int, num_microbatches: int, dp_rank: int,
              dp_size: int) -> list[list[tuple[list[int], int]]]:
    """The evaluation iterations of one pass over samples ``[0, n)`` on DP rank ``dp_rank`` of
    ``dp_size``: each a list of this rank's micro-batches ``(sample indices, real samples)``.
    floor(n / B) iterations of B = b m d samples (:func:`~loom.data.sampler.microbatch_indices`,
    b real samples each), then, for the r = n mod B left, one iteration of ceil(r / d)
    micro-batches of one sample (micro-batch j of rank i holds sample ``n - r + j d + i``, or,
    past n, the filler ``n - r`` weighed 0): every rank runs as many micro-batches and every
    sample is read once."""
    b, m, d = micro_batch_size, num_microbatches, dp_size
    full = n // (b * m * d)
    plan = [[(idx, b) for idx in microbatch_indices(i * b * m * d, b, m, dp_rank, d)]
            for i in range(full)]
    start = full * b * m * d
    if start < n:
        tail = [start + j * d + dp_rank for j in range(-(-(n - start) // d))]
        plan.append([([k], 1) if k < n else ([start], 0) for k in tail])
    return plan


def weighted_losses(forward_step: Callable, sums: list) -> Callable:
    """``forward_step`` whose loss function also appends each micro-batch's loss (detached,
    fp32) times its batch's ``eval_samples`` (its real samples) to ``sums``."""
    def step(chunk, batch, hidden_states=None):
        out, loss_fn = forward_step(chunk, batch, hidden_states)

        def weighed(output):
            loss, named = loss_fn(output)
            sums.append(loss.detach().float() * batch["eval_samples"])
            return loss, named
        return out, weighed
    return step


class Evaluator:
    """The evaluations of one rank's run over the trainer's ``parts``
    (:class:`~loom.training.builder.TrainingParts`); ``global_loss`` (a rank's schedule loss ->
    the mean over DP x CP), ``reduce`` (host scalars summed over every rank) and ``owns_loss``
    (this rank reports its stage's loss) come from the trainer.

    Raises ConfigError (``--full-validation``) for a validation set without an end, and when
    ``--validation-set-names`` does not name every set."""

    def __init__(self, cfg: Any, parts: Any, global_loss: Callable, reduce: Callable,
                 owns_loss: bool):
        lg = cfg.logging
        self.parts, self.data = parts, parts.data
        self.global_loss, self.reduce, self.owns_loss = global_loss, reduce, owns_loss
        self.eval_iters, self.interval = lg.eval_iters, lg.eval_interval
        self.start, self.full = lg.start_eval_at_iter, lg.full_validation
        self.v_shape = is_v_shaped(cfg.parallel.pipeline_schedule, parts.mesh.pp_size)
        sets = self.data.valid_sets
        names = (lg.validation_set_names or "").split() or [str(i) for i in range(len(sets))]
        if lg.multiple_validation_sets and len(names) != len(sets):
            raise ConfigError(f"--validation-set-names gives {len(names)} name(s) for "
                              f"{len(sets)} validation set(s): give {len(sets)}")
        self.valid_sets = [(names[i] if lg.multiple_validation_sets else None, ds)
                           for i, ds in enumerate(sets)]
        for name, ds in self.valid_sets if self.full else ():
            if pass_samples(ds) is None:
                which = "the validation set" if name is None else f"validation set {name}"
                raise ConfigError(f"--full-validation: {which} has no end (mock data or a "
                                  f"weighted blend): give datasets without weights, or drop "
                                  f"--full-validation")

    def due(self, iteration: int, last: int) -> bool:
        """Whether the loop evaluates after ``iteration`` (of ``last``): every
        ``--eval-interval`` from ``--start-eval-at-iter`` on (megatron/training/training.py:
        4915), and after the last."""
        periodic = bool(self.interval) and iteration % self.interval == 0 and \
            (self.start is None or iteration >= self.start)
        return periodic or iteration == last

    @torch.no_grad()
    def evaluate(self, dataset, iters: int = 0, full: bool = False) -> Optional[dict]:
        """``valid_loss`` (mean over the samples read), ``valid_ppl`` (exp of it, capped at
        exp 50) of ``dataset``: its first ``iters`` x B_eval samples, or with ``full`` each
        of its samples once (then ``valid_samples`` N too); None without a dataset or
        samples to read."""
        if dataset is None or not (iters or full):
            return None
        chunks = self.parts.model.chunks
        for c in chunks:
            c.eval()
        try:
            loss, n = self._whole(dataset) if full else self._first(dataset, iters)
        finally:
            for c in chunks:
                c.train()
        rec = {"valid_loss": loss, "valid_ppl": math.exp(min(loss, 50.0))}
        if full:
            rec["valid_samples"] = n
        return rec

    def _run(self, batches: list, step: Callable):
        return forward_only(self.parts.model.chunks, batches, step, self.parts.mesh,
                            p2p_shape=self.data.p2p_shape(batches), v_shape=self.v_shape)

    def _first(self, dataset, iters: int) -> tuple[float, int]:
        """(mean loss, samples) of the first ``iters`` evaluation iterations."""
        total, per_iter = 0.0, self.data.eval_global_batch
        for i in range(iters):
            batches = self.data.batches(dataset, i * per_iter, evaluation=True)
            total += self.global_loss(self._run(batches, self.parts.model.forward_step).loss)
        return total / iters, iters * per_iter

    def _whole(self, dataset) -> tuple[float, int]:
        """(mean loss, N) over every sample of one pass (:func:`full_pass`)."""
        n, mesh, data = pass_samples(dataset), self.parts.mesh, self.data
        sums: list = []
        step = weighted_losses(self.parts.model.forward_step, sums)
        for iteration in full_pass(n, data.eval_micro_batch_size, data.eval_num_microbatches,
                                   mesh.dp_rank, mesh.dp_size):
            batches = data.batches_of(dataset, [idx for idx, _ in iteration])
            for batch, (_, real) in zip(batches, iteration):
                batch["eval_samples"] = real
            self._run(batches, step)
        # the loss stage's TP rank 0 of each DP x CP rank: its samples' losses (a CP rank's is
        # the mean over its share of each sample's tokens, so they average over CP)
        local = float(torch.stack(sums).sum()) if sums and self.owns_loss else 0.0
        (total,) = self.reduce([local / mesh.sizes["cp"]])
        return total / n, n

    def run(self, log: Any, test: bool, iteration: int, consumed: dict) -> list[dict]:
        """Evaluate each validation set (and, with ``test``, the test set on ``--eval-iters``
        batches), log each record (``log``: the run's MetricsLogger) and return them as
        ``{"kind": "valid" | "test", "iteration", ["valid_set"], "valid_loss", ...}``."""
        todo = [("valid", name, ds, self.full) for name, ds in self.valid_sets] or \
            [("valid", None, None, False)]  # (timed all the same)
        if test:
            todo.append(("test", None, self.data.test_ds, False))
        debug, out = self.parts.debug, []
        for kind, name, ds, full in todo:
            with debug.timers("evaluate"):
                rec = self.evaluate(ds, self.eval_iters, full)
            if rec is None:
                continue
            debug.timed_report("evaluate")  # Megatron's level-0 timer, each evaluation
            rec = {"iteration": iteration, **({} if name is None else {"valid_set": name}),
                   **rec, **consumed}
            log.log(rec, kind=kind)
            out.append({"kind": kind, **rec})
        return out
