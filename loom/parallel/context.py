"""Context parallelism: the sequence split over the c ranks of the CP group.

Causal load balance (Megatron-LM / Llama 3): the sequence is cut into 2c chunks and CP rank r
holds chunks r and 2c-1-r, so every rank has the same amount of causal-attention work (early
chunks attend to little, late chunks to much). Each rank computes Q, K, V for its own s/c
tokens; the trainer gives each micro-batch its ``position_ids`` (:func:`local_positions`) and
the plan wraps the attention core in :class:`ContextParallelAttention`, which attends by one of
Megatron-LM's ``--cp-comm-type`` (per layer):

- ``allgather``: keys and values all-gathered over the CP group (the form used to train
  Llama 3, Dubey et al. 2024 sec. 3.3.2); the local queries attend to the full sequence under a
  mask from global positions; backward reduce-scatters the K/V gradients. Per layer
  ``2 (c-1)/c s b g d`` elements each way; every rank holds the whole K/V.
- ``p2p``: ring attention (:mod:`loom.parallel.context_ring`), K/V ``O(s/c)`` per rank.
- ``a2a``: all-to-all from sequence to head sharding (:mod:`loom.parallel.context_a2a`).
- ``a2a+p2p``: a2a inside groups of A consecutive CP ranks, ring across the B groups
  (``--hierarchical-context-parallel-sizes A B``; the mesh's ``cp_a2a`` / ``cp_p2p`` groups).

Bytes and memory of each type: :mod:`loom.parallel.context_cost`.
"""

from __future__ import annotations

import functools
import re
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from loom.config.parallel_cp import COMM_TYPES
from loom.parallel.context_a2a import hierarchical_attention, ulysses_attention
from loom.parallel.context_ring import core_math, ring_attention
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


class ContextParallelAttention(nn.Module):
    """An attention core run over the CP group by ``comm_type`` (:data:`COMM_TYPES`):
    ``q [b, a, s/c, d]`` at global ``q_positions [s/c]`` (this CP rank's
    :func:`local_positions`), ``k [b, g, s/c, d]``, ``v [b, g, s/c, d_v]`` -> ``[b, a, s/c,
    d_v]``. ``allgather`` and ``a2a`` call the inner core on gathered keys / gathered sequence
    (it masks causally by position); ``p2p`` and ``a2a+p2p`` compute the core's math
    (:func:`~loom.parallel.context_ring.core_math`) blockwise. ``a2a_group`` / ``p2p_group``:
    the hierarchical groups (a2a+p2p only). Raises ValueError for a2a+p2p without them."""

    def __init__(self, inner: nn.Module, group, comm_type: str = "allgather",
                 a2a_group=None, p2p_group=None):
        super().__init__()
        if comm_type not in COMM_TYPES:
            raise ValueError(f"unknown CP comm type {comm_type!r}: one of {COMM_TYPES}")
        if comm_type == "a2a+p2p" and a2a_group is None and p2p_group is None:
            raise ValueError("a2a+p2p needs the mesh's hierarchical CP groups "
                             "(--hierarchical-context-parallel-sizes)")
        self.inner, self.group, self.comm_type = inner, group, comm_type
        self.a2a_group, self.p2p_group = a2a_group, p2p_group

    def extra_repr(self) -> str:
        return f"comm_type={self.comm_type}"

    def forward(self, q, k, v, q_positions=None):
        if q_positions is None:
            raise ValueError("context parallelism needs the global positions of the queries")
        if self.comm_type == "allgather":
            k, v = gather_sequence(k, self.group, 2), gather_sequence(v, self.group, 2)
            return self.inner(q, k, v, q_positions)
        c = dist.get_world_size(self.group)
        pos = all_positions(q_positions.numel() * c, c, q.device)
        if self.comm_type == "p2p":
            return ring_attention(q, k, v, pos, self.group, core_math(self.inner))
        if self.comm_type == "a2a":
            return ulysses_attention(self.inner, q, k, v, pos, self.group)
        a = 1 if self.a2a_group is None else dist.get_world_size(self.a2a_group)
        return hierarchical_attention(q, k, v, pos.reshape(c // a, a, -1), self.a2a_group,
                                      self.p2p_group, core_math(self.inner))


def wrap_context_parallel(core: nn.Module, mesh, comm_types: tuple, name: str = "") -> nn.Module:
    """``core`` wrapped in :class:`ContextParallelAttention` by its layer's comm type
    (``comm_types``: one for all layers or one per global layer index, read from ``name``
    ``...layers.<i>...``); ``core`` itself when the CP group is this rank alone."""
    group = mesh.groups.get("cp")
    if group is None:
        return core
    kind = comm_types[0]
    if len(comm_types) > 1:
        found = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", name)
        if found is None:
            raise ValueError(f"per-layer --cp-comm-type but no layer index in {name!r}")
        kind = comm_types[int(found.group(1))]
    return ContextParallelAttention(core, group, kind, mesh.groups.get("cp_a2a"),
                                    mesh.groups.get("cp_p2p"))
