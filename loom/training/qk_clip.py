"""QK-clip (Kimi K2's MuonClip; Kimi Team 2025, "Kimi K2: Open Agentic Intelligence", sec. 2.1)
and the max-attention-logit log, after each optimizer step (Megatron-Core's
``optimizer/qk_clip.py`` ``clip_qk`` and ``transformer/attention.py``
``SelfAttention.clip_qk``).

During the step's forwards each standard attention layer's core records, per query head, its
largest scaled logit ``max q k^T * softmax_scale`` over the micro-batches
(:class:`~loom.models.attention.MaxLogitRecord`). After the optimizer step :func:`clip_qk`
takes the maximum over the data- x context-parallel replicas (one all-reduce), and with
``--qk-clip`` scales each layer whose query group ``j`` (maximum ``m_j`` over its heads) exceeds
the threshold tau: ``eta_j = min(tau / m_j, 1)``, the group's query rows of ``linear_qkv``
times ``eta_j^alpha``, its key rows times ``eta_j^(1 - alpha)``; values, the output gate's rows,
biases and everything else untouched, so the group's logits shrink by ``eta_j``.

loom's fused rows are ``[Q; (G;) K; V]`` blocks (each split over TP alike), not Megatron's
per-group interleaving; the factors follow the rows. With fp32 masters (16-bit training, the
distributed optimizer) the masters are scaled and the parameters written from them, then
all-gathered again, so every replica holds the same weights (Megatron scales its 16-bit
parameters and ``main_param`` separately). A group whose maximum is not above tau keeps
``eta = 1`` (Megatron's ``clamp(tau / m, max=1)`` would turn a negative maximum into a
negative eta).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from loom.models.attention import SelfAttention
from loom.parallel.mesh import ParallelMesh


def attention_layers(chunks: Sequence[nn.Module]) -> list[SelfAttention]:
    """This rank's standard attention layers of ``chunks``, their cores set to record their
    maximum logits (:class:`~loom.models.attention.MaxLogitRecord`)."""
    layers = [m for c in chunks for m in c.modules() if isinstance(m, SelfAttention)]
    for layer in layers:
        layer.core_attention.record_max_logit = True
    return layers


def row_factors(layer: SelfAttention, group_max: torch.Tensor, threshold: float,
                alpha: float) -> Optional[torch.Tensor]:
    """The factor of each row of ``layer.linear_qkv.weight`` (fp32 ``[rows]``) from this rank's
    per-group maxima ``group_max [g/t]``; None when no group exceeds ``threshold``."""
    over = group_max > threshold
    if not bool(over.any()):
        return None
    eta = torch.where(over, threshold / group_max.clamp_min(threshold), torch.ones_like(group_max))
    d = layer.head_dim
    widths = layer._widths(layer.linear_qkv.weight.shape[0])
    heads_q, groups = widths[0] // d, widths[-1] // d
    q_rows = (eta ** alpha).repeat_interleave(heads_q // groups * d)
    k_rows = (eta ** (1 - alpha)).repeat_interleave(d)
    ones = [torch.ones(w, dtype=eta.dtype, device=eta.device) for w in widths]
    blocks = [q_rows, *ones[1:-2], k_rows, ones[-1]]  # Q, (G,) K, V
    return torch.cat(blocks)


def _reduced_maxima(layers: Sequence[SelfAttention], mesh: ParallelMesh) -> list[torch.Tensor]:
    """Each layer's per-head maxima ``[a/t]`` of the step, maximum over the DP x CP replicas
    (one all-reduce); the records reset."""
    local = []
    for layer in layers:
        core = layer.core_attention
        heads = layer._widths(layer.linear_qkv.weight.shape[0])[0] // layer.head_dim
        m = core.max_logit
        local.append(m if m is not None else
                     torch.full((heads,), float("-inf"), device=mesh.device))
        core.max_logit = None
    if not local:
        return []
    flat = torch.cat(local).to(mesh.device, torch.float32)
    group = mesh.groups.get("dp_cp") if dist.is_initialized() else None
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    return list(flat.split([t.numel() for t in local]))


@torch.no_grad()
def _scale(optimizer, factors: dict) -> None:
    """Multiply the rows of each weight in ``factors`` (``{id(weight): (weight, [rows])}``)
    by their factors, in the fp32 masters too."""
    from loom.training.distributed_optimizer import DistributedOptimizer
    if not isinstance(optimizer, DistributedOptimizer):  # the parameter is its own master
        for w, f in factors.values():
            w.mul_(f.to(w)[:, None])
        return
    optimizer.finish_param_gather()
    with optimizer.stored.unpacked():  # --use-precision-aware-optimizer: fp32 while scaled
        for rg in optimizer.ranges:
            if id(rg.param) in factors and rg.hi > rg.lo:
                w, f = factors[id(rg.param)]
                full = f[:, None].expand(w.shape).reshape(-1)[rg.lo:rg.hi]
                rg.master.mul_(full.to(rg.master.device))
        optimizer.copy_masters_to_params()
    for g in optimizer.gathers:  # every replica's shards of the clipped weights: the dense DP
        if any(id(p) in factors for p in g.grads.params):  # group, whose ranks decide alike
            g.start(async_op=False)


def clip_qk(layers: Sequence[SelfAttention], optimizer, mesh: ParallelMesh, clip: bool,
            threshold: float, alpha: float) -> float:
    """The step's maximum attention logit over this rank's ``layers`` (all DP x CP
    replicas; -inf without layers) after, with ``clip``, QK-clip of their weights (see the
    module). A collective over ``dp_cp`` on every rank with attention layers."""
    maxima = _reduced_maxima(layers, mesh)
    factors = {}
    if clip:
        for layer, heads in zip(layers, maxima):
            groups = layer._widths(layer.linear_qkv.weight.shape[0])[-1] // layer.head_dim
            f = row_factors(layer, heads.view(groups, -1).amax(dim=1), threshold, alpha)
            if f is not None:
                w = layer.linear_qkv.weight
                factors[id(w)] = (w, f)
    if factors:  # the DP x CP replicas of a layer decide alike (the maxima are reduced)
        _scale(optimizer, factors)
    return max((float(m.max()) for m in maxima), default=float("-inf"))


def step_clip(cfg, chunks: Sequence[nn.Module], optimizer, mesh: ParallelMesh):
    """``--qk-clip`` / ``--log-max-attention-logit``: the callable the trainer runs after each
    optimizer step (:func:`clip_qk` on this rank's recording attention layers, returning this
    rank's maximum logit), or None with neither flag."""
    m = cfg.model
    if not (m.qk_clip or cfg.logging.log_max_attention_logit):
        return None
    layers = attention_layers(chunks)
    return lambda: clip_qk(layers, optimizer, mesh, m.qk_clip, m.qk_clip_threshold,
                           m.qk_clip_alpha)
