"""Context parallelism by all-to-all over heads (DeepSpeed-Ulysses, Jacobs et al. 2023,
"DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
Transformer Models"; Megatron-LM's ``--cp-comm-type a2a``), and its hierarchical form with a
ring across a2a groups (``a2a+p2p``, ``--hierarchical-context-parallel-sizes A B``).

a2a: each of the A ranks holds ``[b, heads, s/A, d]``; one all-to-all turns that into
``[b, heads/A, s, d]`` (this rank's head group over the group's whole sequence), the unchanged
attention core runs on it (tokens put in global order first), and one all-to-all turns the
output back. Forward: 4 all-to-alls (q, k, v, output), backward 4 (their conjugates).
Queries heads must be divisible by A; key/value groups g are too, or are repeated to
``lcm(g, A)`` groups first (GQA: still one group per ``a / g`` heads on every rank).
Per rank it holds K/V of the whole sequence for ``g/A`` groups: ``O(s / A)`` elements.

a2a+p2p: the a2a inside each group of A consecutive CP ranks, then ring attention
(:mod:`loom.parallel.context.ring`) across the B groups on the head-sharded tokens.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from loom.parallel.context.ring import CoreMath, ring_attention
from loom.parallel.mappings import ConjugateCollective


def _a2a(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, H, s, d]`` (this rank's tokens) -> ``[b, H/A, A s, d]`` (rank i's tokens i-th)."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    y = _a2a(x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4), group)  # [A, b, H/A, s, d]
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, H/A, A s, d] -> [b, H, s, d]``: the inverse of :func:`_seq_to_heads`."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    y = _a2a(x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4), group)  # [A, b, H/A, s/A, d]
    return y.permute(1, 0, 2, 3, 4).reshape(b, n * h, s // n, d)


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """Autograd-aware ``[b, H, s/A, d] -> [b, H/A, s, d]`` (backward: the inverse); group
    None (A = 1): ``x`` itself."""
    return x if group is None else ConjugateCollective.apply(x, group, _seq_to_heads, _heads_to_seq)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Autograd-aware ``[b, H/A, s, d] -> [b, H, s/A, d]`` (backward: the inverse)."""
    return x if group is None else ConjugateCollective.apply(x, group, _heads_to_seq, _seq_to_heads)


def expand_groups(k: torch.Tensor, n: int) -> torch.Tensor:
    """Repeat each of the g key/value groups of ``[b, g, s, d]`` so there are ``lcm(g, n)``
    (divisible by the a2a size n); unchanged when n divides g."""
    g = k.shape[1]
    rep = math.lcm(g, n) // g
    return k if rep == 1 else k.repeat_interleave(rep, dim=1)


def ulysses_attention(inner, q, k, v, positions: torch.Tensor, group) -> torch.Tensor:
    """a2a context parallelism: ``q [b, a, s/A, d]``, ``k [b, g, s/A, d]``, ``v [b, g, s/A,
    d_v]``; ``positions [A, s/A]`` the global positions of every group member's tokens, together
    a permutation of ``0 .. s-1``; ``inner`` an attention core ``(q, k, v, q_positions)`` over
    keys in global order -> ``[b, a, s/A, d_v]``."""
    n = dist.get_world_size(group)
    k, v = expand_groups(k, n), expand_groups(v, n)
    q, k, v = (seq_to_heads(t, group) for t in (q, k, v))
    order = positions.reshape(-1).argsort().to(q.device)
    inverse = order.argsort()
    q, k, v = (t.index_select(2, order) for t in (q, k, v))
    s = q.shape[2]
    out = inner(q, k, v, torch.arange(s, device=q.device))
    return heads_to_seq(out.index_select(2, inverse), group)


def hierarchical_attention(q, k, v, positions: torch.Tensor, a2a_group, p2p_group,
                           m: CoreMath) -> torch.Tensor:
    """a2a+p2p: ``positions [B, A, s/c]`` the global positions of the tokens of CP rank
    ``i A + j`` at ``[i, j]`` (ring member i is a2a group i); shapes as
    :func:`ulysses_attention`."""
    n = 1 if a2a_group is None else dist.get_world_size(a2a_group)
    k, v = expand_groups(k, n), expand_groups(v, n)
    q, k, v = (seq_to_heads(t, a2a_group) for t in (q, k, v))
    out = ring_attention(q, k, v, positions.reshape(positions.shape[0], -1), p2p_group, m)
    return heads_to_seq(out, a2a_group)
