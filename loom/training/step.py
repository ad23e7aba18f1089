"""After backward: finish the gradient reductions, then one optimizer step with the loss scale,
the global-norm clipping and the non-finite guard (the trainer's ``forward_backward`` tail and
``optimizer_step``). Each function takes the parts it uses, never the trainer."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from loom.errors import NonFiniteError
from loom.parallel.grad_buffer import flat_buffers
from loom.parallel.mesh import ParallelMesh
from loom.parallel.pipeline.shared_embedding import allreduce_embedding_grads
from loom.parallel.sequence import allreduce_sequence_parallel_grads
from loom.training.distributed_optimizer import DistributedOptimizer
from loom.training.optimizer import clip_and_norm


def grad_getter(reducers):
    """``p -> gradient tensor``: the buffer's reduced main-gradient range for parameters in
    main-gradient buffers (16-bit or the distributed optimizer), else ``p.grad``."""
    owner = {id(p): r for r in flat_buffers(reducers) if getattr(r, "main_grads", False)
             for p in r.params}

    def grad_of(p):
        r = owner.get(id(p))
        return p.grad if r is None else r.shard_grad(p)
    return grad_of


def _untimed(name: str):
    return contextlib.nullcontext()


def finish_gradients(reducers: Sequence, model_chunks: Sequence, mesh: ParallelMesh,
                     sp_params: Sequence, timers=_untimed) -> None:
    """Wait for the DP reductions of the chunks' gradient buffers ``reducers``, then sum the
    gradients of ``sp_params`` (sequence-parallel, replicated over TP) over the TP group and the
    tied embedding's over the embedding group (on the owned ranges with the distributed
    optimizer: their layouts agree across those groups). ``timers``: the run's
    :class:`~loom.training.timers.Timers` (Megatron's names of the three phases)."""
    with timers("all-grads-sync"):
        for r in reducers:
            r.finish_grad_sync()
    grad_of = grad_getter(reducers)
    if sp_params:
        with timers("layernorm-grads-all-reduce"):
            allreduce_sequence_parallel_grads(sp_params, mesh.groups["tp"], grad_of)
    with timers("embedding-grads-all-reduce"):
        allreduce_embedding_grads(model_chunks, mesh, grad_of)


@dataclass
class ParamGroups:
    """The parameter lists the step reads: ``params`` (every trainable parameter of this rank),
    ``norm_params`` (dense parameters whose gradient enters the global norm, each element once),
    ``expert_norm_params`` (experts on their own grid, summed over it), ``sp_params``
    (gradients summed over TP: sequence-parallel norms and biases)."""
    params: list
    norm_params: list
    expert_norm_params: list = field(default_factory=list)
    sp_params: list = field(default_factory=list)


def unscale_sharded(params: Sequence, inv_scale: float, device) -> bool:
    """``--fp16`` without the distributed optimizer (ZeRO-3: FSDP2 keeps fp32 gradient shards):
    multiply this rank's gradient shards of ``params`` by ``inv_scale`` in place and say
    whether any rank's shard holds an inf or NaN (Megatron's ``found_inf``, all-reduced over
    every rank, so each DP x CP shard is seen and all ranks skip together)."""
    import torch
    import torch.distributed as dist

    from loom.parallel.fsdp import local_tensor
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    found = torch.zeros(1, device=device)
    if grads:
        torch._foreach_mul_(grads, inv_scale)
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
        found = (~finite).to(found.dtype).reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item())


def optimizer_step(optimizer, scheduler, reducers: Sequence, groups: ParamGroups,
                   mesh: ParallelMesh, clip_grad: float, scaler=None,
                   nonfinite: Optional[list] = None, iteration: int = 0,
                   exit_on_nonfinite: int = 0, timers=_untimed) -> float:
    """Unscale (``scaler``: ``--fp16``; ZeRO-3's shards by :func:`unscale_sharded`), clip by
    the global norm to ``clip_grad``, AdamW step,
    LR ``scheduler`` step, gradients zeroed in ``reducers``; returns the pre-clip grad norm (of
    the unscaled gradients). A non-finite norm skips the step (gradients dropped, LR schedule
    held; the fp16 loss scale backs off) and appends ``iteration + 1`` to ``nonfinite`` (cleared
    in place by a finite step); raises NonFiniteError after ``exit_on_nonfinite`` in a row.
    ``timers``: the run's :class:`~loom.training.timers.Timers` (clip, inner step)."""
    nonfinite = [] if nonfinite is None else nonfinite
    inv_scale, found_inf = 1.0 / scaler.scale if scaler is not None else 1.0, False
    if scaler is not None and not isinstance(optimizer, DistributedOptimizer):  # fp16 ZeRO-3
        found_inf = unscale_sharded(groups.params, inv_scale, mesh.device)
        inv_scale = 1.0
    norm = float("inf") if found_inf else \
        clip_and_norm(optimizer, groups.params, clip_grad, mesh, groups.norm_params,
                      groups.expert_norm_params, inv_scale, timers)
    finite = math.isfinite(norm)
    if scaler is not None:
        scaler.update(not finite)
    if not finite:  # the same on every rank: never train on NaN/inf
        nonfinite.append(iteration + 1)
        for r in reducers:
            r.zero_grad()
        if exit_on_nonfinite and len(nonfinite) >= exit_on_nonfinite:
            raise NonFiniteError(f"--exit-on-nonfinite {exit_on_nonfinite}: non-finite gradient "
                                 f"norm in iterations {nonfinite}; stopping")
        return norm
    nonfinite.clear()
    if isinstance(optimizer, DistributedOptimizer):  # it times its own phases
        optimizer.step()
    else:
        with timers("optimizer-inner-step"):
            optimizer.step()
    scheduler.step()
    for r in reducers:
        r.zero_grad()
    return norm


def finish_param_gather(optimizer) -> None:
    """Wait for the distributed optimizer's pending parameter all-gathers (before reading or
    saving the parameters); a no-op otherwise."""
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.finish_param_gather()
