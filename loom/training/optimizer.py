"""AdamW with Megatron's weight-decay grouping, global-norm clipping across TP/PP, LR schedule."""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from loom.config import TrainingConfig
from loom.parallel.mesh import ParallelMesh
from loom.parallel.registry import ParamMeta


def build_optimizer(model: nn.Module, cfg: TrainingConfig,
                    dp_group: Optional[dist.ProcessGroup] = None) -> torch.optim.Optimizer:
    """AdamW; no weight decay for biases and 1-D parameters (norms), as Megatron-LM.

    With ``--use-distributed-optimizer`` and a data-parallel group, the Adam states are sharded
    over DP (ZeRO stage 1, Rajbhandari et al. 2020 sec. 5.1: ``4 + 12/d`` instead of 16 bytes
    per parameter in mixed precision) with ``torch.distributed.optim.ZeroRedundancyOptimizer``:
    each rank updates the parameters it owns and broadcasts them.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or name.endswith(".bias") else decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    kw = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if cfg.use_distributed_optimizer and dp_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        zero = ZeroRedundancyOptimizer(groups[0]["params"], torch.optim.AdamW,
                                       process_group=dp_group,
                                       weight_decay=groups[0]["weight_decay"], **kw)
        for g in groups[1:]:
            zero.add_param_group(g)
        return zero
    return torch.optim.AdamW(groups, **kw)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's Adam states (ZeRO's local shard, or itself)."""
    return getattr(optimizer, "optim", optimizer)


def lr_at(iteration: int, cfg: TrainingConfig) -> float:
    """Learning rate after ``iteration`` steps: linear warm-up over ``--lr-warmup-iters`` to
    ``--lr``, then ``--lr-decay-style`` (cosine / linear / constant) to ``--min-lr`` at
    ``--lr-decay-iters`` (Megatron's ``OptimizerParamScheduler``); ``--lr-warmup-fraction`` f
    warms up over ``f x`` the decay iterations instead."""
    decay_iters = cfg.lr_decay_iters or cfg.train_iters
    warmup = cfg.lr_warmup_iters if cfg.lr_warmup_fraction is None else \
        int(cfg.lr_warmup_fraction * decay_iters)
    if warmup > 0 and iteration < warmup:
        return cfg.lr * (iteration + 1) / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    frac = min(max(iteration - warmup, 0) / max(decay_iters - warmup, 1), 1.0)
    if cfg.lr_decay_style == "linear":
        coeff = 1.0 - frac
    else:
        coeff = 0.5 * (math.cos(math.pi * frac) + 1.0)
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig):
    """``LambdaLR`` following :func:`lr_at`; ``scheduler.last_epoch`` is the iteration."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: lr_at(it, cfg) / cfg.lr)


def counts_for_norm(meta: ParamMeta, mesh: ParallelMesh) -> bool:
    """A gradient enters the global norm once: TP-sharded parameters on every TP rank,
    replicated ones on TP rank 0 only, pipeline duplicates (tied embedding on the last stage)
    never (the registry's :meth:`~loom.parallel.registry.ParamMeta.counts_for_norm`)."""
    return meta.counts_for_norm(mesh.tp_rank)


def _sum_of_squares(params: Sequence[torch.Tensor], device) -> torch.Tensor:
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is not None:
            sq += p.grad.detach().float().pow(2).sum()
    return sq


def global_grad_norm(params: Iterable[torch.Tensor], mesh: ParallelMesh,
                     expert_params: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """L2 norm of the gradients of ``params`` (those that count, see :func:`counts_for_norm`),
    summed over the model-parallel (TP x PP) group; ``expert_params`` (expert-parallel weights,
    each held by one rank of the EP group) are summed over the EP group first. Data-parallel
    replicas hold identical gradients after reduction, so DP is not summed."""
    params, expert_params = list(params), list(expert_params)
    device = (params or expert_params)[0].device if (params or expert_params) else mesh.device
    sq = _sum_of_squares(params, device)
    if expert_params:
        esq = _sum_of_squares(expert_params, device)
        if mesh.groups.get("ep") is not None:
            dist.all_reduce(esq, group=mesh.groups["ep"])
        sq = sq + esq
    if mesh.groups["mp"] is not None:
        dist.all_reduce(sq, group=mesh.groups["mp"])
    return sq.sqrt()


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, mesh: ParallelMesh,
                   norm_params: Optional[Iterable[torch.Tensor]] = None,
                   expert_norm_params: Iterable[torch.Tensor] = ()) -> float:
    """Scale the gradients of ``params`` so their global norm (over ``norm_params``, default
    ``params``, plus ``expert_norm_params``) is at most ``max_norm`` (skip if <= 0); returns
    the norm before clipping."""
    params = list(params)
    norm = global_grad_norm(params if norm_params is None else norm_params, mesh,
                            expert_norm_params)
    if max_norm > 0:
        coeff = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coeff)
    return float(norm)
