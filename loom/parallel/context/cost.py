"""What each context-parallel comm type communicates and holds, per attention layer, per
micro-batch, per rank: pure functions (no torch) for the planner and the benchmark.

Symbols (Shoeybi et al. 2019 / Korthikanti et al. 2022): s tokens per sample, b micro-batch,
a query heads, g key/value groups, d_qk / d_v head dims (MLA: 192 / 128), t TP ranks
(``a/t`` heads and ``max(g/t, 1)`` groups per rank, as the plans shard them), c CP ranks, and
``A x B = c`` for a2a+p2p. Sizes are in elements; ``bytes_per_element`` multiplies.

- allgather (Llama 3, Dubey et al. 2024 sec. 3.3.2): K/V all-gathered forward, gradients
  reduce-scattered backward, ``(c-1)/c`` of the full K/V each way; every rank holds the full
  sequence's K/V. Not overlapped with attention (it runs before it).
- p2p (ring attention, Liu et al. 2023 sec. 3; Megatron-Core ``cp_comm_type="p2p"``): forward
  ``c-1`` K/V blocks of ``s/c`` tokens pass each rank; backward ``c-1`` K/V blocks and ``c``
  K/V-gradient blocks. Each block's transfer is overlapped with the attention of the current
  block. Held: the local block and the one in flight, ``2 s/c`` tokens of K/V.
- a2a (DeepSpeed-Ulysses, Jacobs et al. 2023 sec. 3.2: ``4 N h / P`` per layer): q, k, v and
  the output each cross one all-to-all forward (their conjugates backward); a rank sends
  ``(c-1)/c`` of its share. Held: the whole sequence's K/V for ``lcm(g_local, c)/c`` groups.
  Not overlapped.
- a2a+p2p (Megatron-Core hierarchical CP, ``hierarchical_context_parallel_sizes``): a2a over
  A ranks, then a ring over B on ``s/B`` tokens of ``lcm(g_local, A)/A`` groups.

``bytes_fwd`` / ``bytes_bwd``: bytes a rank sends per layer; ``kv_elements``: K/V elements it
holds for attention (the ``O(s/c)`` claim of p2p is ``kv_elements`` scaling with 1/c);
``overlapped``: the share of ``bytes_fwd`` that can hide behind attention compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loom.config.parallel_cp import COMM_TYPES


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's sizes (module docstring's symbols)."""

    s: int
    b: int
    a: int
    g: int
    d_qk: int
    d_v: int
    t: int = 1

    @property
    def heads(self) -> int:
        return self.a // self.t

    @property
    def groups(self) -> int:
        return max(self.g // self.t, 1)


@dataclass(frozen=True)
class CPCost:
    """Per rank, per layer, per micro-batch (module docstring)."""

    bytes_fwd: float
    bytes_bwd: float
    kv_elements: float
    overlapped: float  # fraction of bytes_fwd that overlaps attention compute, in [0, 1]
    messages_fwd: int  # collectives or sends per layer forward


def kv_elements(shape: AttentionShape, c: int, comm_type: str,
                hierarchical: tuple[int, int] | None = None) -> float:
    """K/V elements one rank holds for attention, ``[tokens x groups x (d_qk + d_v)] x b``."""
    x, per_token = shape, shape.d_qk + shape.d_v
    if c == 1 or comm_type == "allgather":
        return x.s * x.b * x.groups * per_token
    if comm_type == "p2p":
        return 2 * x.s / c * x.b * x.groups * per_token
    if comm_type == "a2a":
        return x.s * x.b * math.lcm(x.groups, c) / c * per_token
    a2a, ring = _hier(c, hierarchical)
    held = 2 if ring > 1 else 1
    return held * x.s / ring * x.b * math.lcm(x.groups, a2a) / a2a * per_token


def cp_cost(shape: AttentionShape, c: int, comm_type: str,
            hierarchical: tuple[int, int] | None = None,
            bytes_per_element: int = 2) -> CPCost:
    """Bytes sent per rank per layer (forward, backward), K/V held, overlap share and messages
    of ``comm_type`` at CP size c. Raises ValueError for an unknown type or bad sizes."""
    if comm_type not in COMM_TYPES:
        raise ValueError(f"unknown CP comm type {comm_type!r}: one of {COMM_TYPES}")
    x, e = shape, bytes_per_element
    kv = kv_elements(shape, c, comm_type, hierarchical)
    if c == 1:
        return CPCost(0.0, 0.0, kv, 0.0, 0)
    kv_local = x.s / c * x.b * x.groups * (x.d_qk + x.d_v)  # this rank's own K/V
    if comm_type == "allgather":
        sent = (c - 1) * kv_local  # an all-gather (ring algorithm) sends (c-1)/c of the whole
        return CPCost(sent * e, sent * e, kv, 0.0, 2)
    if comm_type == "p2p":
        return CPCost((c - 1) * kv_local * e, (2 * c - 1) * kv_local * e, kv, 1.0, c - 1)
    if comm_type == "a2a":
        return _a2a_cost(x, c, c, e, kv)
    a2a, ring = _hier(c, hierarchical)
    inner = _a2a_cost(x, c, a2a, e, kv) if a2a > 1 else CPCost(0.0, 0.0, kv, 0.0, 0)
    block = x.s / ring * x.b * math.lcm(x.groups, a2a) / a2a * (x.d_qk + x.d_v)
    ring_fwd, ring_bwd = (ring - 1) * block * e, (2 * ring - 1) * block * e if ring > 1 else 0.0
    total = inner.bytes_fwd + ring_fwd
    return CPCost(total, inner.bytes_bwd + ring_bwd, kv,
                  ring_fwd / total if total else 0.0, inner.messages_fwd + ring - 1)


def _a2a_cost(x: AttentionShape, c: int, n: int, e: int, kv: float) -> CPCost:
    """All-to-all over n ranks of q, k, v (groups repeated to lcm(g, n)) and the output."""
    tokens = x.s / c * x.b  # this rank's tokens before the a2a
    groups = math.lcm(x.groups, n)
    per_rank = tokens * (x.heads * x.d_qk + groups * (x.d_qk + x.d_v) + x.heads * x.d_v)
    sent = (n - 1) / n * per_rank * e
    return CPCost(sent, sent, kv, 0.0, 4)


def _hier(c: int, hierarchical: tuple[int, int] | None) -> tuple[int, int]:
    if hierarchical is None or hierarchical[0] * hierarchical[1] != c:
        raise ValueError(f"a2a+p2p needs sizes (A, B) with A x B = c = {c}, got {hierarchical}")
    return hierarchical
