"""The data part of training: the train / validation / test sets and this rank's micro-batches
of a global batch (Megatron's ``get_batch`` over its pretraining sampler)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from loom.data.sampler import get_batch, microbatch_indices
from loom.parallel.context.split import local_positions, slice_for_cp
from loom.parallel.mesh import ParallelMesh


class BatchSource:
    """This rank's batches of ``datasets`` (train, valid, test; None for a set without data)
    under ``mesh``: ``micro_batch_size`` b samples per micro-batch, ``global_batch`` B samples
    per step in ``num_microbatches`` m = B / (b d) micro-batches per DP rank (both from the
    resolved config's ``derived``); ``seq_length`` s tokens per sample, ``hidden_size`` h (the
    pipeline's activation shape). ``sequence_parallel``: the activations between stages are
    split by t. ``ramp``: a batch-size ramp (:class:`~loom.config.batch_ramp.BatchRamp`),
    whose B at the consumed samples sets each training iteration's m (B above is its final
    size). ``valid_sets``: the validation sets (several with
    ``--multiple-validation-sets``: a :class:`~loom.data.blended.DatasetList` in the valid
    slot), ``valid_ds`` the first."""

    def __init__(self, datasets: tuple[Any, Any, Any], mesh: ParallelMesh, micro_batch_size: int,
                 global_batch: int, num_microbatches: int, seq_length: int, hidden_size: int,
                 sequence_parallel: bool = False, eval_sizes: Optional[tuple[int, int, int]] = None,
                 ramp=None):
        self.train_ds, valid, self.test_ds = datasets
        self.valid_sets = list(valid) if isinstance(valid, list) else \
            [] if valid is None else [valid]
        self.valid_ds = self.valid_sets[0] if self.valid_sets else None
        self.mesh, self.micro_batch_size = mesh, micro_batch_size
        self.global_batch, self.num_microbatches = global_batch, num_microbatches
        self.seq_length, self.hidden_size = seq_length, hidden_size
        self.sequence_parallel = sequence_parallel and mesh.tp_size > 1
        self.eval_micro_batch_size, self.eval_global_batch, self.eval_num_microbatches = \
            eval_sizes or (micro_batch_size, global_batch, num_microbatches)
        self.ramp = ramp

    def batch_at(self, consumed: int) -> int:
        """B of the training iteration that starts after ``consumed`` samples: the ramp's
        (``--rampup-batch-size``, ``--step-batch-size-schedule``) or the global batch."""
        return self.global_batch if self.ramp is None else self.ramp.batch_at(consumed)

    @classmethod
    def from_config(cls, cfg, mesh: ParallelMesh, datasets: tuple[Any, Any, Any],
                    ramp=None) -> "BatchSource":
        """Sizes from a resolved LoomConfig: ``--micro-batch-size``, B (the running batch,
        ``--decrease-batch-size-if-needed``'s) and m of its ``derived``,
        ``--seq-length``, ``--hidden-size`` and ``--sequence-parallel``; evaluation's
        ``--eval-micro-batch-size``, B_eval and m_eval; ``ramp``: the batch-size ramp
        (:class:`~loom.config.batch_ramp.BatchRamp`) or None."""
        t, m, d = cfg.training, cfg.model, cfg.require_derived()
        evals = (cfg.logging.eval_micro_batch_size, d.eval_global_batch_size,
                 d.eval_num_microbatches) if d.eval_num_microbatches else None
        return cls(datasets, mesh, t.micro_batch_size, d.running_global_batch_size,
                   d.num_microbatches,
                   m.seq_length, m.hidden_size, cfg.parallel.sequence_parallel, evals, ramp)

    def sets(self) -> tuple[tuple[str, Any], ...]:
        """``(("train", ds), ("valid", ds), ("test", ds))``."""
        return (("train", self.train_ds), ("valid", self.valid_ds), ("test", self.test_ds))

    def batches(self, dataset, consumed: int, evaluation: bool = False) -> list[dict]:
        """This DP rank's m micro-batches of the global batch starting at sample ``consumed``:
        ``tokens``/``labels`` ``[b, s/c]`` and ``position_ids [s/c]`` (this CP rank's
        load-balanced chunks, :mod:`loom.parallel.context`), on the mesh's device.
        ``evaluation``: m_eval micro-batches of b_eval samples (an evaluation iteration)."""
        b, m = (self.eval_micro_batch_size, self.eval_num_microbatches) if evaluation else \
            (self.micro_batch_size, self.num_microbatches)
        if self.ramp is not None and not evaluation:  # this iteration's m = B / (b d)
            m = self.ramp.batch_at(consumed) // (b * self.mesh.dp_size)
        return self.batches_of(dataset, microbatch_indices(consumed, b, m, self.mesh.dp_rank,
                                                           self.mesh.dp_size))

    def batches_of(self, dataset, idx: list[list[int]]) -> list[dict]:
        """This rank's micro-batches of the sample indices ``idx`` (one list per micro-batch),
        as :meth:`batches` builds them; ``num_microbatches`` is ``len(idx)``."""
        m = len(idx)
        dev, cp, cp_rank = self.mesh.device, self.mesh.sizes["cp"], self.mesh.coords["cp"]
        s = self.seq_length
        positions = (local_positions(s, cp_rank, cp) if cp > 1 else torch.arange(s)).to(dev)
        out = []
        for i in idx:
            batch = {k: slice_for_cp(v, cp_rank, cp).to(dev, non_blocking=True)
                     for k, v in get_batch(dataset, i).items()}
            batch["position_ids"] = positions
            batch["num_microbatches"] = m
            out.append(batch)
        return out

    def p2p_shape(self, batches: list[dict]) -> tuple[int, int, int]:
        """``[s, b, h]`` exchanged between pipeline stages: this rank's ``s/c`` tokens, split by
        t under sequence parallelism."""
        b, s = batches[0]["tokens"].shape
        return (s // (self.mesh.tp_size if self.sequence_parallel else 1), b, self.hidden_size)
