"""The tensors whose layout differs between Megatron-Core and loom (:data:`names.KINDS`).

Fused QKV (weight ``[(a + 2g) d, h]``, bias ``[(a + 2g) d]``): Megatron-Core's
``SelfAttention.get_query_key_value_tensors`` views the GEMM output as
``[g, (a/g + 2) d]``: per query group its ``a/g`` query heads, then its key head, then its value
head. loom's ``linear_qkv`` is ``[Q (a d); K (g d); V (g d)]`` (segments of its TP
``ShardSpec``). The interleaving is needed even without GQA (g = a: ``[q0 k0 v0 q1 k1 v1 ...]``).
Megatron's tensor-parallel split of it is contiguous (rank r holds groups ``r g/t ..``), so the
global interleaved tensor is the concatenation of its TP shards.

With ``--attention-output-gate`` each group holds ``[a/g q, a/g gate, k, v]`` heads (Megatron's
``get_query_key_value_tensors(output_gate=True)``), loom ``[Q; G; K; V]``.

Mamba conv1d weight: ``nn.Conv1d``'s ``[C, 1, k]`` there, ``[C, k]`` in loom.
"""

from __future__ import annotations

import torch


def _blocks(heads: int, groups: int, gated: bool) -> tuple[int, ...]:
    """Heads per group of each fused block: ``(q, [gate,] k, v)``."""
    q = heads // groups
    return (q, q, 1, 1) if gated else (q, 1, 1)


def qkv_to_loom(t: torch.Tensor, heads: int, groups: int, gated: bool = False) -> torch.Tensor:
    """Megatron's per-group interleaved QKV rows -> loom's ``[Q; K; V]`` (``[Q; G; K; V]``
    when ``gated``; any trailing dims)."""
    blocks = _blocks(heads, groups, gated)
    d = t.shape[0] // (groups * sum(blocks))
    x = t.reshape(groups, sum(blocks), d, *t.shape[1:])
    return torch.cat([part.reshape(-1, *t.shape[1:]) for part in x.split(blocks, dim=1)])


def qkv_to_megatron(t: torch.Tensor, heads: int, groups: int,
                    gated: bool = False) -> torch.Tensor:
    """Inverse of :func:`qkv_to_loom`."""
    blocks = _blocks(heads, groups, gated)
    d = t.shape[0] // (groups * sum(blocks))
    rest = t.shape[1:]
    parts = t.split([groups * n * d for n in blocks], dim=0)
    x = torch.cat([p.reshape(groups, n, d, *rest) for p, n in zip(parts, blocks)], dim=1)
    return x.reshape(t.shape)


def to_loom(t: torch.Tensor, kind: str, heads: int, groups: int,
            gated: bool = False) -> torch.Tensor:
    """Megatron's layout of a ``kind`` tensor -> loom's (``gated``: the QKV holds the output
    gate)."""
    if kind == "qkv":
        return qkv_to_loom(t, heads, groups, gated)
    if kind == "conv" and t.ndim == 3:
        return t.reshape(t.shape[0], t.shape[2])
    return t


def to_megatron(t: torch.Tensor, kind: str, heads: int, groups: int,
                gated: bool = False) -> torch.Tensor:
    """loom's layout of a ``kind`` tensor -> Megatron's."""
    if kind == "qkv":
        return qkv_to_megatron(t, heads, groups, gated)
    if kind == "conv":
        return t.reshape(t.shape[0], 1, t.shape[1])
    return t
