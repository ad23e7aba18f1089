"""DeepSeek Sparse Attention (DSA; DeepSeek-AI 2025, "DeepSeek-V3.2", sec. 2.1; Megatron-Core's
``DSAttention`` / ``DSAIndexer``) as plain math: the core attention of a multi-latent attention
layer (:mod:`loom.models.gpt.mla`) under ``--experimental-attention-variant dsa``.

For ``x [s, b, h]`` (the layer input), ``qr [s, b, r_q]`` (MLA's normalized query latent; x
without ``--q-lora-rank``), H = ``--dsa-indexer-n-heads``, d = ``--dsa-indexer-head-dim``:

* the lightning indexer: index queries ``q_I = W_qb qr`` ``[s, b, H, d]``, one shared key
  ``k_I = LayerNorm(W_k x)`` ``[s, b, d]``; the first ``dr = --qk-pos-emb-head-dim`` channels of
  both rotate by RoPE (MLA's cos / sin, in halves), then both are multiplied by the normalized
  Hadamard matrix ``H_d / sqrt(d)`` (unless ``--no-dsa-indexer-rotate-activation``); head
  weights ``w = W_w x / sqrt(H) / sqrt(d)`` ``[s, b, H]``; the index score of query t and key j
  ``I[t, j] = sum_h w[t, h] ReLU(q_I[t, h] . k_I[j])`` (no ReLU with
  ``--no-dsa-indexer-scoring-relu``), ``-inf`` for j > t;
* each query keeps its ``--dsa-indexer-topk`` highest-scoring causal keys (fewer when fewer
  exist); MLA's attention runs over those keys only (a masked dense softmax, no dropout, as
  Megatron's unfused path): with top-k >= s it is causal attention;
* in training with ``--dsa-indexer-loss-coeff c > 0``: the target ``p[t, :]``, the attention
  probabilities of the (detached) MLA queries and keys summed over all heads (over TP: an
  all-reduce) and normalized; the loss ``c * mean_t KL(p[t] || softmax(I[t]))`` over the causal
  keys (only the top-k ones with ``--dsa-indexer-use-sparse-loss``), averaged over the b x s
  queries. It reaches the gradient through :class:`~loom.models.moe.AuxLossScaler` with the
  micro-batch scale (1/m, Megatron's ``DSAIndexerLossAutoScaler``).

Gradient flow is Megatron's: the indexer reads ``x`` and ``qr`` detached (only its loss trains
it), the top-k is chosen without gradient (the main model is not trained through the indexer).

Parallelism (:mod:`loom.models.gpt.parallelize`): the indexer is replicated on every TP rank
(Megatron's ``parallel_mode="duplicated"``) and sees the whole sequence (``input_region``: the
sequence all-gather under SP), so its gradients agree across TP without a reduction;
``head_sum_region`` all-reduces the per-rank head sums of the target.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.models.attention import apply_rope
from loom.models.moe import AuxLossScaler, MoEContext

INDEXER_LOSS_EPS = 1e-10
"""Floor of the target's normalizer and of its logarithm (Megatron's ``INDEXER_LOSS_EPS``)."""


def hadamard(d: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """The Sylvester Hadamard matrix ``[d, d]`` (d a power of 2) times ``1 / sqrt(d)``: the
    orthogonal map of ``fast_hadamard_transform.hadamard_transform(x, scale=d ** -0.5)``."""
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


class DSAIndexer(nn.Module):
    """The lightning indexer: :meth:`forward` gives the index scores ``[b, s, s]`` (fp32, ``-inf``
    above the diagonal). Parameter names are Megatron-Core's ``DSAIndexer``'s."""

    def __init__(self, cfg):
        super().__init__()
        h, self.n, self.d = cfg.hidden_size, cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim
        self.linear_wq_b = nn.Linear(cfg.q_lora_rank or h, self.n * self.d, bias=False)
        self.linear_wk = nn.Linear(h, self.d, bias=False)
        eps = cfg.dsa_indexer_k_norm_epsilon
        self.k_norm = nn.LayerNorm(self.d, eps=cfg.norm_epsilon if eps is None else eps)
        self.linear_weights_proj = nn.Linear(h, self.n, bias=False)
        self.rotate = not cfg.no_dsa_indexer_rotate_activation
        self.relu = not cfg.no_dsa_indexer_scoring_relu
        self.k_norm_fp32 = cfg.dsa_indexer_k_norm_fp32

    def forward(self, x: torch.Tensor, qr: torch.Tensor, rope: tuple) -> torch.Tensor:
        """``x [s, b, h]``, ``qr [s, b, r_q]`` (whole sequence), ``rope``: cos, sin ``[s, dr]``
        -> index scores ``[b, s, s]``."""
        s, b, _ = x.shape
        q = apply_rope(self.linear_wq_b(qr).view(s, b, self.n, self.d), *rope)
        k = self.linear_wk(x)
        k = self.k_norm(k.float()).to(k.dtype) if self.k_norm_fp32 else self.k_norm(k)
        k = apply_rope(k.view(s, b, 1, self.d), *rope)[:, :, 0]
        if self.rotate:
            rot = hadamard(self.d, q.dtype, q.device)
            q, k = q @ rot, k @ rot
        w = self.linear_weights_proj(x) * (self.n ** -0.5 * self.d ** -0.5)  # [s, b, H]
        scores = torch.einsum("sbhd,tbd->sbht", q.float(), k.float())
        if self.relu:
            scores = scores.relu()
        scores = (scores * w.float().unsqueeze(-1)).sum(2).transpose(0, 1)  # [b, s, s]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        return scores.masked_fill(~causal, float("-inf"))


def topk_mask(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """``[b, s_q, s_k]`` bool: for each query, its ``topk`` highest finite scores (every finite
    one when fewer exist)."""
    vals, idx = scores.topk(min(topk, scores.shape[-1]), dim=-1)
    mask = torch.zeros_like(scores, dtype=torch.bool)
    return mask.scatter_(-1, idx, torch.isfinite(vals))


def indexer_loss(scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor, scale: float,
                 valid: torch.Tensor, head_sum=lambda t: t) -> torch.Tensor:
    """``mean_t KL(p[t] || softmax(scores[t]))`` over the keys where ``valid [b, s, s]``:
    ``scores [b, s, s]`` the index scores; ``p`` from ``q [b, a, s, d]``, ``k [b, a, s, d]``
    (detached here) with the softmax ``scale``: the attention probabilities summed over heads
    (``head_sum``: over TP ranks too) and normalized. Without the coefficient."""
    with torch.no_grad():
        att = (q.detach().float() @ k.detach().float().transpose(-1, -2)) * scale
        att = att.masked_fill(~valid[:, None], float("-inf")).softmax(-1).sum(1)
        att = head_sum(att)
        target = att / att.sum(-1, keepdim=True).clamp_min(INDEXER_LOSS_EPS)
        log_target = target.clamp_min(INDEXER_LOSS_EPS).log()
    logp = scores.masked_fill(~valid, float("-inf")).log_softmax(-1).masked_fill(~valid, 0.0)
    kl = (target * (log_target - logp)).masked_fill(~valid, 0.0).sum(-1)  # [b, s]
    return kl.sum() / max(kl.numel(), 1)


class DSAttention(nn.Module):
    """The core attention of an MLA layer under DSA: ``q, k [b, a, s, d]``, ``v [b, a, s, dv]``
    -> ``[b, a, s, dv]`` over each query's top-k keys (see the module docstring)."""

    def __init__(self, cfg):
        super().__init__()
        self.indexer = DSAIndexer(cfg)
        self.topk = cfg.dsa_indexer_topk
        self.coeff = cfg.dsa_indexer_loss_coeff or 0.0
        self.sparse_loss = cfg.dsa_indexer_use_sparse_loss
        self.input_region = nn.Identity()  # the plan's: the whole sequence under SP
        self.head_sum_region = nn.Identity()  # the plan's: all-reduce over TP
        self.rng = None  # the plan's dropout generator slot (DSA has no attention dropout)
        self.last_mask: Optional[torch.Tensor] = None  # the last top-k mask (tests, metrics)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
                qr: torch.Tensor, rope: tuple, moe: Optional[MoEContext] = None) -> torch.Tensor:
        x, qr = self.input_region(x.detach()), self.input_region(qr.detach())
        scores = self.indexer(x, qr, rope)
        causal = torch.isfinite(scores)
        with torch.no_grad():
            mask = topk_mask(scores.detach(), self.topk)
        self.last_mask = mask
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
        if self.coeff > 0 and self.training and torch.is_grad_enabled():
            valid = mask if self.sparse_loss else causal
            loss = self.coeff * indexer_loss(scores, q, k, scale, valid, self.head_sum_region)
            if moe is not None:
                out = AuxLossScaler.apply(out, loss, moe.scale)
        return out
