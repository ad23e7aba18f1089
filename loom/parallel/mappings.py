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
    with ``fn(tensor, group) -> tensor``. Every mapping of TP, SP and CP is one such pair.

    Under ``torch.compile`` the forward returns a copy of the collective's result. Why: torch
    2.11's Dynamo traces an autograd.Function's forward with side effects allowed and makes every
    traced intermediate an extra output of the forward subgraph (``collect_intermediate_outputs``
    in ``torch/_dynamo/variables/higher_order_ops.py``). The ``fn``s end in a buffer the
    collective wrote in place (``copy_`` returns that same tensor) or a ``.contiguous()`` /
    ``chunk`` that returns it unchanged, so the real output was the very tensor of one of those
    extra outputs; AOTAutograd then routed the incoming gradient to the extra output's slot and
    ran ``backward_fn`` on zeros: the gradient through such a collective was lost (O(1) wrong)
    while the forward was exact. torch 2.13 returns only the real outputs; the copy costs one
    activation-sized memcpy in compiled code only (eager returns the result as is).
    Tested: ``tests/parallel/test_compile.py::test_compiled_collectives_match_eager``."""

    @staticmethod
    def forward(ctx, x, group, forward_fn, backward_fn):
        ctx.group, ctx.backward_fn = group, backward_fn
        out = forward_fn(x, group)
        return out.clone() if torch.compiler.is_compiling() else out

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
