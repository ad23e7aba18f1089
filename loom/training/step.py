"""After backward: finish the gradient reductions, then one optimizer step with the loss scale,
the global-norm clipping and the non-finite guard (the trainer's ``forward_backward`` tail and
``optimizer_step``)."""

from __future__ import annotations

import math

from loom.errors import NonFiniteError
from loom.parallel.pipeline.model import allreduce_embedding_grads
from loom.parallel.sequence import allreduce_sequence_parallel_grads
from loom.training.main_params import MainParamOptimizer, flat_reducers
from loom.training.optimizer import clip_and_norm


def grad_getter(reducers):
    """``p -> gradient tensor``: the reducer's reduced main-gradient range for parameters in
    main-gradient buffers (16-bit or the distributed optimizer), else ``p.grad``."""
    owner = {id(p): r for r in flat_reducers(reducers) if getattr(r, "main_grads", False)
             for p in r.params}

    def grad_of(p):
        r = owner.get(id(p))
        return p.grad if r is None else r.shard_grad(p)
    return grad_of


def finish_gradients(trainer) -> None:
    """Wait for the DP reductions, then sum the sequence-parallel gradients over TP and the
    tied embedding's over the embedding group (on the owned ranges with the distributed
    optimizer: their layouts agree across those groups)."""
    for r in trainer.reducers:
        r.finish_grad_sync()
    grad_of = grad_getter(trainer.reducers)
    if trainer.sp_params:
        allreduce_sequence_parallel_grads(trainer.sp_params, trainer.mesh.groups["tp"], grad_of)
    allreduce_embedding_grads(trainer.model_chunks, trainer.mesh, grad_of)


def optimizer_step(trainer) -> float:
    """Unscale (``--fp16``), clip by the global norm, AdamW step, LR schedule; returns the
    pre-clip grad norm (of the unscaled gradients). A non-finite norm skips the step (gradients
    dropped, LR schedule held; the fp16 loss scale backs off) and is recorded in
    ``trainer.nonfinite``; raises NonFiniteError after ``--exit-on-nonfinite`` in a row."""
    scaler = trainer.scaler
    norm = clip_and_norm(trainer.optimizer, trainer.params, trainer.cfg.training.clip_grad,
                         trainer.mesh, trainer.norm_params, trainer.expert_norm_params,
                         1.0 / scaler.scale if scaler is not None else 1.0)
    finite = math.isfinite(norm)
    if scaler is not None:
        scaler.update(not finite)
    if not finite:  # the same on every rank: never train on NaN/inf
        trainer.nonfinite.append(trainer.iteration + 1)
        for r in trainer.reducers:
            r.zero_grad()
        limit = trainer.cfg.training.exit_on_nonfinite
        if limit and len(trainer.nonfinite) >= limit:
            raise NonFiniteError(f"--exit-on-nonfinite {limit}: non-finite gradient norm in "
                                 f"iterations {trainer.nonfinite}; stopping")
        return norm
    trainer.nonfinite = []
    trainer.optimizer.step()
    trainer.scheduler.step()
    for r in trainer.reducers:
        r.zero_grad()
    return norm


def finish_param_gather(optimizer) -> None:
    """Wait for the distributed optimizer's pending parameter all-gathers (before reading or
    saving the parameters); a no-op otherwise."""
    if isinstance(optimizer, MainParamOptimizer):
        optimizer.finish_param_gather()
