"""Statistics logged with every iteration, each element counted once over the whole
model-parallel job (the counting of the gradient norm): ``--log-params-norm``, the L2 norm of
the parameters (Megatron-LM's ``calc_params_l2_norm``), and ``--log-num-zeros-in-grad``, the
number of zero gradient entries (Megatron's ``count_zeros_fp32``)."""

from __future__ import annotations

from types import SimpleNamespace

from loom.parallel.mesh import ParallelMesh
from loom.training.distributed_optimizer import DistributedOptimizer, count_zero_entries
from loom.training.optimizer import global_grad_norm, global_grad_sum


def params_norm(groups, mesh: ParallelMesh) -> float:
    """L2 norm of the parameters (unitless) of ``groups`` (:class:`loom.training.step.ParamGroups`):
    the dense ones that count once (TP-sharded on every TP rank, replicated ones on TP rank 0,
    pipeline duplicates never) summed over TP x PP, expert ones over their grid, ZeRO-3 shards
    over DP x CP: the counting of the gradient norm (:func:`~loom.training.optimizer.global_grad_norm`),
    applied to the weights. A collective: every rank calls it."""
    def as_grads(params):
        return [SimpleNamespace(grad=p.detach(), device=p.device) for p in params]
    return float(global_grad_norm(as_grads(groups.norm_params), mesh,
                                  as_grads(groups.expert_norm_params)))


def grad_zeros(optimizer, groups, mesh: ParallelMesh) -> int:
    """The number of zero entries of the reduced gradients (``--log-num-zeros-in-grad``), each
    element once: the distributed optimizer's main-gradient ranges summed over the DP x CP
    shards, else the gradients of ``groups.norm_params`` / ``groups.expert_norm_params`` as
    the gradient norm counts them (TP-replicated ones on TP rank 0 only). Call after the
    gradient reductions, before the step; a collective: every rank calls it."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.count_zeros()
    return int(global_grad_sum(groups.norm_params, mesh, groups.expert_norm_params,
                               count_zero_entries))
