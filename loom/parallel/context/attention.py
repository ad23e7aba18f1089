"""Context-parallel attention: the plan wraps each layer's attention core in
:class:`ContextParallelAttention`, which attends over the whole sequence from this rank's s/c
tokens by the layer's ``--cp-comm-type`` (the package docstring, :mod:`loom.parallel.context`)."""


from __future__ import annotations

import re

import torch.distributed as dist
from torch import nn

from loom.config.parallel_cp import COMM_TYPES
from loom.parallel.context.a2a import hierarchical_attention, ulysses_attention
from loom.parallel.context.ring import core_math, ring_attention
from loom.parallel.context.split import all_positions, gather_sequence


class ContextParallelAttention(nn.Module):
    """An attention core run over the CP group by ``comm_type`` (:data:`COMM_TYPES`):
    ``q [b, a, s/c, d]`` at global ``q_positions [s/c]`` (this CP rank's
    :func:`local_positions`), ``k [b, g, s/c, d]``, ``v [b, g, s/c, d_v]`` -> ``[b, a, s/c,
    d_v]``. ``allgather`` and ``a2a`` call the inner core on gathered keys / gathered sequence
    (it masks causally by position); ``p2p`` and ``a2a+p2p`` compute the core's math
    (:func:`~loom.parallel.context.ring.core_math`) blockwise. ``a2a_group`` / ``p2p_group``:
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
