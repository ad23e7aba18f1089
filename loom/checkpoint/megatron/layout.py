"""The tensors whose layout differs between Megatron-Core and loom (:data:`names.KINDS`).

Fused QKV (weight ``[(a + 2g) d, h]``, bias ``[(a + 2g) d]``): Megatron-Core's
``SelfAttention.get_query_key_value_tensors`` views the GEMM output as
``[g, (a/g + 2) d]``: per query group its ``a/g`` query heads, then its key head, then its value
head. loom's ``linear_qkv`` is ``[Q (a d); K (g d); V (g d)]`` (segments of its TP
``ShardSpec``). The interleaving is needed even without GQA (g = a: ``[q0 k0 v0 q1 k1 v1 ...]``).
Megatron's tensor-parallel split of it is contiguous (rank r holds groups ``r g/t ..``), so the
global interleaved tensor is the concatenation of its TP shards.

Mamba conv1d weight: ``nn.Conv1d``'s ``[C, 1, k]`` there, ``[C, k]`` in loom.
"""

from __future__ import annotations

import torch


def qkv_to_loom(t: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """Megatron's per-group interleaved QKV rows -> loom's ``[Q; K; V]`` (any trailing dims)."""
    q_per_g = heads // groups
    d = t.shape[0] // (heads + 2 * groups)
    x = t.reshape(groups, q_per_g + 2, d, *t.shape[1:])
    q = x[:, :q_per_g].reshape(heads * d, *t.shape[1:])
    k = x[:, q_per_g].reshape(groups * d, *t.shape[1:])
    v = x[:, q_per_g + 1].reshape(groups * d, *t.shape[1:])
    return torch.cat([q, k, v], dim=0)


def qkv_to_megatron(t: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """Inverse of :func:`qkv_to_loom`."""
    q_per_g = heads // groups
    d = t.shape[0] // (heads + 2 * groups)
    q, k, v = t.split([heads * d, groups * d, groups * d], dim=0)
    rest = t.shape[1:]
    x = torch.cat([q.reshape(groups, q_per_g, d, *rest), k.reshape(groups, 1, d, *rest),
                   v.reshape(groups, 1, d, *rest)], dim=1)
    return x.reshape(t.shape)


def to_loom(t: torch.Tensor, kind: str, heads: int, groups: int) -> torch.Tensor:
    """Megatron's layout of a ``kind`` tensor -> loom's."""
    if kind == "qkv":
        return qkv_to_loom(t, heads, groups)
    if kind == "conv" and t.ndim == 3:
        return t.reshape(t.shape[0], t.shape[2])
    return t


def to_megatron(t: torch.Tensor, kind: str, heads: int, groups: int) -> torch.Tensor:
    """loom's layout of a ``kind`` tensor -> Megatron's."""
    if kind == "qkv":
        return qkv_to_megatron(t, heads, groups)
    if kind == "conv":
        return t.reshape(t.shape[0], 1, t.shape[1])
    return t
