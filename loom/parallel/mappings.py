"""Autograd-aware collectives of tensor parallelism (Shoeybi et al. 2019, sec. 3, fig. 3).

``f`` = :func:`copy_to_tensor_parallel_region`: identity forward, all-reduce backward.
``g`` = :func:`reduce_from_tensor_parallel_region`: all-reduce forward, identity backward.
Plus the split/gather pair along the last dimension for ``gather_output`` / ``input_is_parallel``.
Every function takes the process group explicitly; ``group=None`` means a one-rank group and
the collective is skipped (so the same layer code runs unsharded at t = 1).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group is None:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group is None:
        return x
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(n, dim=-1)[r].contiguous()


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group is None:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _identity(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x


class ConjugateCollective(torch.autograd.Function):
    """One collective forward, its conjugate backward: ``apply(x, group, forward_fn, backward_fn)``
    with ``fn(tensor, group) -> tensor``. Every mapping of TP, SP and CP is one such pair."""

    @staticmethod
    def forward(ctx, x, group, forward_fn, backward_fn):
        ctx.group, ctx.backward_fn = group, backward_fn
        return forward_fn(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_fn(grad.contiguous(), ctx.group), None, None, None


def _all_reduce_copy(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _all_reduce(x.clone(), group)


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``f``: identity forward; all-reduce of the gradient over ``group`` backward."""
    return x if group is None else ConjugateCollective.apply(x, group, _identity, _all_reduce_copy)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``g``: all-reduce (sum) over ``group`` forward; identity backward."""
    return x if group is None else ConjugateCollective.apply(x, group, _all_reduce_copy, _identity)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's chunk of the last dim ``[..., n] -> [..., n/t]``; gather backward."""
    return x if group is None else ConjugateCollective.apply(x, group, _split_last, _gather_last)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the last dim ``[..., n/t] -> [..., n]``; split backward."""
    return x if group is None else ConjugateCollective.apply(x, group, _gather_last, _split_last)
