"""Knowledge-distillation loss on vocabulary-parallel logits: the per-token KL divergence of the
student's softmax from the teacher's at a temperature (ModelOpt's logits KL loss, which
Megatron-LM's ``--export-kd-teacher-load`` trains with; Hinton et al. 2015, "Distilling the
Knowledge in a Neural Network", sec. 2), never gathering the vocabulary.

With ``z_s``, ``z_t`` the student's and teacher's logits over the V columns the softmax spans,
``T`` the temperature, ``p = softmax(z_t / T)`` and ``q = softmax(z_s / T)``::

    KL(p || q) = sum_v p_v (log p_v - log q_v)
               = sum_v p_v log p_v - sum_v p_v z_s,v / T + logsumexp_v(z_s,v / T)

(as ``sum_v p_v = 1``). Each TP rank holds ``Vp/t`` columns: the two sums are summed over the
TP group, the log-sum-exp is built from the group's max and sum of exponentials (the way the
vocab-parallel cross-entropy builds it, :mod:`loom.parallel.tensor`). The reductions are
``g`` (sum forward, identity backward: every rank computes the same loss from the summed
values), so each rank's gradient is the one of its own columns.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from loom.parallel.mappings import reduce_from_tensor_parallel_region


def _group_max(x: torch.Tensor, group) -> torch.Tensor:
    """Max over the last dim and the TP ``group`` (no gradient: a shift only)."""
    m = x.detach().max(dim=-1).values
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    return m


def kd_logits_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0,
                 group=None, vocab_start: int = 0,
                 vocab_size: Optional[int] = None) -> torch.Tensor:
    """Per-token ``KL(softmax(teacher / T) || softmax(student / T))`` ``[...]`` (fp32).

    ``student``, ``teacher``: this rank's logits ``[..., Vp/t]`` (columns ``vocab_start`` on
    of the padded vocabulary; any float dtype, computed in fp32); the teacher's get no gradient.
    ``group``: the TP group (None: the whole vocabulary is here); ``vocab_size``: the columns
    the softmax spans (padded ones beyond it are left out), None for all.
    """
    zs = student.float() / temperature
    with torch.no_grad():
        zt = teacher.float() / temperature
    n_local = zs.shape[-1]
    if vocab_size is not None and vocab_start + n_local > vocab_size:
        cols = torch.arange(vocab_start, vocab_start + n_local, device=zs.device)
        pad = cols >= vocab_size
        zs = zs.masked_fill(pad, float("-inf"))
        zt = zt.masked_fill(pad, float("-inf"))
    else:
        pad = None
    with torch.no_grad():  # the teacher's softmax p and sum_v p log p
        shifted_t = zt - _group_max(zt, group).unsqueeze(-1)
        sum_t = shifted_t.exp().sum(dim=-1)
        if group is not None:
            dist.all_reduce(sum_t, group=group)
        log_p = shifted_t - sum_t.log().unsqueeze(-1)
        p = log_p.exp()
        if pad is not None:
            log_p = log_p.masked_fill(pad, 0.0)
        neg_entropy = (p * log_p).sum(dim=-1)
    m_s = _group_max(zs, group)
    shifted_s = zs - m_s.unsqueeze(-1)
    if pad is not None:
        shifted_s = shifted_s.masked_fill(pad, 0.0)  # p is 0 there: no -inf x 0
    row = (shifted_s.exp() if pad is None else shifted_s.exp().masked_fill(pad, 0.0)).sum(dim=-1)
    sum_s = reduce_from_tensor_parallel_region(row, group)
    cross = reduce_from_tensor_parallel_region((p * shifted_s).sum(dim=-1), group)
    if group is not None:
        neg_entropy = neg_entropy.clone()
        dist.all_reduce(neg_entropy, group=group)
    # sum p (log p - shifted_s + log sum_s): the shift m_s cancels (sum p = 1)
    return neg_entropy - cross + sum_s.log()
