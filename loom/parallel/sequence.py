"""Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2, fig. 5).

Between the tensor-parallel regions, activations are split along the sequence: ``[s/t, b, h]``.
The TP all-reduce of a row-parallel layer becomes a reduce-scatter to ``[s/t, b, h]`` and the
identity (``f``) before a column-parallel layer becomes an all-gather to ``[s, b, h]``: the same
communication volume, and layer norms, dropout and residuals now store ``1/t`` of the
activations. Parameters applied to sequence-split activations (norm weights, row-parallel biases)
see only this rank's tokens, so their gradients are all-reduced over TP
(:func:`allreduce_sequence_parallel_grads`), as Megatron-LM does; the parallel plan registers
which parameters those are.

gloo has no reduce-scatter; there it is an all-reduce followed by a slice (same result, 2x the
bytes); NCCL uses ``reduce_scatter_single``.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from loom.parallel.fsdp import local_tensor
from loom.parallel.mappings import ConjugateCollective

Group = Optional[dist.ProcessGroup]


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """``dist.all_gather_single`` (the old ``all_gather_into_tensor`` now warns once per rank;
    it is used on a torch that predates the new name)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """``dist.reduce_scatter_single`` (``reduce_scatter_tensor`` on an older torch)."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x,
                                                                                  group=group)


def _gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, x.contiguous(), group)
    return out


def start_gather_dim0(x: torch.Tensor, group) -> Callable[[], torch.Tensor]:
    """Start the all-gather of ``x [n/t, ...]`` along dim 0 over ``group`` without waiting;
    returns ``finish() -> [n, ...]``. Under ``torch.compile`` the collective runs at once (an
    async handle is not traced)."""
    n = dist.get_world_size(group)
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    if torch.compiler.is_compiling():
        all_gather_into(out, x.contiguous(), group)
        return lambda: out
    work = (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
        out, x.contiguous(), group=group, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return out
    return finish


def start_reduce_scatter_dim0(x: torch.Tensor, group) -> Callable[[], torch.Tensor]:
    """:func:`reduce_scatter_dim0` started without waiting; returns ``finish() -> [n/t, ...]``
    (gloo: an async all-reduce, then this rank's slice). Under ``torch.compile``: at once."""
    if torch.compiler.is_compiling():
        out = reduce_scatter_dim0(x, group)
        return lambda: out
    x = x.contiguous()
    if dist.get_backend(group) == "nccl":
        out = torch.empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]),
                          dtype=x.dtype, device=x.device)
        work = (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
            out, x, group=group, async_op=True)
    else:
        out = x.clone()
        work = dist.all_reduce(out, group=group, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return out if dist.get_backend(group) == "nccl" else _own_slice_dim0(out, group)
    return finish


def _split_dim0(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=0)[dist.get_rank(group)].contiguous()


def _own_slice_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's ``1/n`` of dim 0 of a summed buffer, in storage of its own: what
    ``reduce_scatter_tensor`` returns on NCCL. A view would keep the whole ``[n, ...]`` buffer
    alive for as long as the slice is (autograd saves it for the backward: n times the bytes)."""
    return _split_dim0(x, group).clone()


def reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's ``1/n`` of dim 0."""
    x = x.contiguous()
    if dist.get_backend(group) == "nccl":
        out = torch.empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]),
                          dtype=x.dtype, device=x.device)
        reduce_scatter_into(out, x, group)
        return out
    x = x.clone()
    dist.all_reduce(x, group=group)
    return _own_slice_dim0(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[s, b, h]`` (replicated) -> this rank's ``[s/t, b, h]``; backward all-gathers."""
    return x if group is None else ConjugateCollective.apply(x, group, _split_dim0, _gather_dim0)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[s/t, b, h]`` -> ``[s, b, h]`` before a column-parallel GEMM; backward reduce-scatters."""
    # the consumer is tensor-parallel: each rank holds a partial gradient of the full sequence
    return x if group is None else ConjugateCollective.apply(x, group, _gather_dim0,
                                                             reduce_scatter_dim0)


def gather_sequence_replicated_grad(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[s/t, b, h]`` -> ``[s, b, h]`` for a consumer that computes the same full gradient on
    every TP rank (an MoE layer routes every token on every TP rank): backward keeps this
    rank's slice instead of reduce-scattering."""
    return x if group is None else ConjugateCollective.apply(x, group, _gather_dim0, _split_dim0)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Partial sums ``[s, b, h]`` of a row-parallel GEMM -> summed ``[s/t, b, h]``;
    backward all-gathers."""
    return x if group is None else ConjugateCollective.apply(x, group, reduce_scatter_dim0,
                                                             _gather_dim0)


def allreduce_sequence_parallel_grads(params: Iterable[torch.Tensor], group: Group,
                                      grad_of=None) -> None:
    """Sum the gradients of ``params`` (those the registry marks sequence-parallel) over the TP
    group in one flat all-reduce. ``grad_of(p)``: where the gradient lives (default
    ``p.grad``)."""
    if group is None:
        return
    grads = [local_tensor(g) for g in (p.grad if grad_of is None else grad_of(p) for p in params)
             if g is not None and g.numel()]  # ZeRO-3: this rank's shards
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
