"""The sequence split of context parallelism: the sequence cut into 2c chunks, CP rank r holding
chunks r and 2c-1-r (the causal load balance of Megatron-LM / Llama 3: every rank gets the same
amount of causal-attention work), its positions, and the sequence gathered back in order."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from loom.parallel.mappings import ConjugateCollective
from loom.parallel.sequence import reduce_scatter_dim0


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2c) that CP rank r holds: r and 2c-1-r."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_length: int, cp_rank: int, cp_size: int,
                    device: Optional[torch.device] = None) -> torch.Tensor:
    """Global positions ``[s/c]`` of this CP rank's tokens, in local order."""
    n = seq_length // (2 * cp_size)
    a, b = chunk_ids(cp_rank, cp_size)
    return torch.cat([torch.arange(a * n, (a + 1) * n, device=device),
                      torch.arange(b * n, (b + 1) * n, device=device)])


def slice_for_cp(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of ``x`` (sequence along ``dim``), e.g. ``[b, s] -> [b, s/c]``."""
    if cp_size == 1:
        return x
    chunks = x.chunk(2 * cp_size, dim=dim)
    a, b = chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def _global_order(gathered: list[torch.Tensor], cp_size: int, dim: int) -> torch.Tensor:
    """Reassemble the full sequence from every rank's (chunk r, chunk 2c-1-r) pair."""
    pieces: list[Optional[torch.Tensor]] = [None] * (2 * cp_size)
    for r, t in enumerate(gathered):
        first, second = t.chunk(2, dim=dim)
        a, b = chunk_ids(r, cp_size)
        pieces[a], pieces[b] = first, second
    return torch.cat(pieces, dim=dim)


def _gather_in_order(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return _global_order(parts, n, dim)


def _reduce_scatter_in_order(grad: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum every rank's gradient of the full sequence, keep this rank's chunks."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if dist.get_backend(group) == "nccl":
        stacked = torch.cat([slice_for_cp(grad, j, n, dim) for j in range(n)], dim=0)
        return reduce_scatter_dim0(stacked, group)
    grad = grad.clone()  # gloo has no reduce-scatter: all-reduce and slice
    dist.all_reduce(grad, group=group)
    return slice_for_cp(grad, r, n, dim)


def gather_sequence(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """``[..., s/c (dim), ...] -> [..., s, ...]`` in global order (autograd-aware)."""
    if group is None:
        return x
    return ConjugateCollective.apply(x, group, functools.partial(_gather_in_order, dim=dim),
                                     functools.partial(_reduce_scatter_in_order, dim=dim))


def all_positions(seq_length: int, cp_size: int, device=None) -> torch.Tensor:
    """``[c, s/c]``: the global positions of every CP rank's tokens (row r: rank r's)."""
    return torch.stack([local_positions(seq_length, r, cp_size, device)
                        for r in range(cp_size)])
