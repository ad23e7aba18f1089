"""Multi-latent attention (MLA; DeepSeek-AI 2024, "DeepSeek-V2", arXiv 2405.04434, sec. 2.1,
eq. 9-19; Megatron-Core's ``MLASelfAttention``) as plain math.

For ``x [s, b, h]``, a heads, ``dn = --qk-head-dim``, ``dr = --qk-pos-emb-head-dim``,
``dv = --v-head-dim``, ``r = --kv-lora-rank``:

* queries: ``q = W_uq norm(W_dq x)`` with ``--q-lora-rank`` (eq. 12-13), else ``q = W_q x``
  (the latents' norms exist with ``--qk-layernorm``, as in Megatron-Core);
  ``[s, b, a, dn + dr]`` split into the content part ``q_c`` and the RoPE part ``q_r``;
* keys / values: the down projection ``W_dkv x`` ``[s, b, r + dr]`` gives the latent
  ``c = norm(.[:r])`` (eq. 9) and the decoupled key ``k_r = RoPE(.[r:])`` shared by every head
  (eq. 14); ``W_ukv c`` ``[s, b, a, dn + dv]`` splits into ``k_c`` and ``v`` (eq. 10-11);
* attention over ``q = [q_c, RoPE(q_r)]``, ``k = [k_c, k_r]`` with the softmax scale
  ``mscale^2 / sqrt(dn + dr)`` (YaRN's ``mscale_all_dim``; 1 without YaRN), output ``W_o``.

Parallelism is the plan's (:mod:`loom.models.gpt.parallelize`): the down projections and their
norms stay replicated, the up projections are column-parallel (a/t heads per rank), ``W_o``
row-parallel; ``k_pos_emb_region`` (an identity here) becomes the tensor-parallel input region
of the shared key (``f``, or the sequence all-gather under SP). Generation caches the latent
``c`` and the rotated ``k_r`` (``[b, 1, s, r]`` and ``[b, 1, s, dr]``), not the keys and values.
Under ``--experimental-attention-variant dsa`` the core attention is DeepSeek Sparse Attention
(:mod:`loom.models.gpt.dsa`), fed the layer input and the query latent.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from loom.config import ModelConfig
from loom.errors import ConfigError
from loom.models.attention import DotProductAttention, KVCache, apply_rope, rope_cos_sin
from loom.models.gpt.dsa import DSAttention
from loom.models.moe import MoEContext
from loom.models.yarn import yarn_cos_sin, yarn_mscale


def _norm(cfg: ModelConfig, size: int) -> nn.Module:
    """The latent's norm under ``--qk-layernorm`` (Megatron builds MLA's ``q_layernorm`` /
    ``kv_layernorm`` only then; DeepSeek's models have them), else an identity."""
    if not cfg.qk_layernorm:
        return nn.Identity()
    if cfg.normalization == "RMSNorm":
        return nn.RMSNorm(size, eps=cfg.norm_epsilon)
    return nn.LayerNorm(size, eps=cfg.norm_epsilon)


def yarn_factor(cfg: ModelConfig) -> float:
    """YaRN's scaling factor s (``--rotary-scaling-factor``, 1 when unset)."""
    return cfg.rotary_scaling_factor or 1.0


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """``mscale(s, mscale_all_dim)^2 / sqrt(dn + dr)`` under YaRN, else ``1 / sqrt(dn + dr)``
    (Megatron-Core's ``MultiLatentAttention.softmax_scale``)."""
    m = yarn_mscale(yarn_factor(cfg), cfg.mscale_all_dim) if cfg.effective_rope_type == "yarn" \
        else 1.0
    return m * m / math.sqrt(cfg.q_head_dim)


def mla_rope(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[s, dr]`` of the decoupled RoPE part at ``positions [s]``: plain RoPE, or
    YaRN (:func:`loom.models.yarn.yarn_cos_sin`) under ``--rope-type yarn``."""
    dr = cfg.qk_pos_emb_head_dim
    if cfg.effective_rope_type == "rope":
        return rope_cos_sin(positions, dr, cfg.rotary_base)
    return yarn_cos_sin(positions, dr, cfg.rotary_base, **cfg.yarn_args())


class MLASelfAttention(nn.Module):
    """``x [s, b, h] -> [s, b, h]``; ``rope``: cos, sin ``[s, dr]`` (:func:`mla_rope`),
    ``positions [s]`` global positions of the queries, ``cache``: the latent cache."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        h, a = cfg.hidden_size, cfg.num_attention_heads
        dn, dr, dv, r = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.layer_number, self.dn, self.dr, self.dv, self.r = layer_number, dn, dr, dv, r
        if cfg.q_lora_rank:
            self.linear_q_down_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_layernorm = _norm(cfg, cfg.q_lora_rank)
            self.linear_q_up_proj = nn.Linear(cfg.q_lora_rank, a * (dn + dr), bias=False)
        else:
            self.linear_q_proj = nn.Linear(h, a * (dn + dr), bias=False)
        self.linear_kv_down_proj = nn.Linear(h, r + dr, bias=False)
        self.kv_layernorm = _norm(cfg, r)
        self.linear_kv_up_proj = nn.Linear(r, a * (dn + dv), bias=False)
        self.k_pos_emb_region = nn.Identity()  # the plan's TP input region of the shared key
        self.dsa = cfg.dsa
        self.core_attention = DSAttention(cfg) if self.dsa else \
            DotProductAttention(cfg.attention_dropout)
        self.linear_proj = nn.Linear(a * dv, h, bias=not cfg.disable_bias_linear)
        # the core scales by 1/sqrt(dn + dr); YaRN's extra mscale^2 goes into the queries
        m = yarn_mscale(yarn_factor(cfg), cfg.mscale_all_dim) \
            if cfg.effective_rope_type == "yarn" else 1.0
        self.q_scale = m * m

    def cache_shapes(self, batch: int, max_len: int) -> tuple[tuple, tuple]:
        """Shapes of the latent and rotated-key caches of ``batch`` sequences."""
        return (batch, 1, max_len, self.r), (batch, 1, max_len, self.dr)

    def queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[s, b, h] -> [s', b, a/t, dn + dr]`` (s' the full sequence under SP), and the
        normalized query latent ``[s(/t), b, r_q]`` (``x`` without ``--q-lora-rank``)."""
        if hasattr(self, "linear_q_proj"):
            q, latent = self.linear_q_proj(x), x
        else:
            latent = self.q_layernorm(self.linear_q_down_proj(x))
            q = self.linear_q_up_proj(latent)
        return q.view(q.shape[0], q.shape[1], -1, self.dn + self.dr), latent

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None,
                positions: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, moe: Optional[MoEContext] = None) -> torch.Tensor:
        q, q_latent = self.queries(x)
        latent, k_pe = self.linear_kv_down_proj(x).split([self.r, self.dr], dim=-1)
        latent = self.kv_layernorm(latent)  # [s(/t), b, r]
        k_pe = self.k_pos_emb_region(k_pe)  # [s, b, dr]
        q_c, q_r = q.split([self.dn, self.dr], dim=-1)
        q_r = apply_rope(q_r, *rope)
        k_pe = apply_rope(k_pe.unsqueeze(2), *rope)  # [s, b, 1, dr]
        if cache is not None:  # cache the latent, expand every cached position
            lat, kr = cache.update(self.layer_number, latent.permute(1, 0, 2).unsqueeze(1),
                                   k_pe.permute(1, 2, 0, 3))
            latent, k_pe = lat[:, 0].permute(1, 0, 2), kr.permute(2, 0, 1, 3)
        kv = self.linear_kv_up_proj(latent)
        kv = kv.view(kv.shape[0], kv.shape[1], -1, self.dn + self.dv)
        k_c, v = kv.split([self.dn, self.dv], dim=-1)
        # V's own storage: as a view it kept the whole [s, b, a/t, dn + dv] up projection alive
        # for backward (K's part is copied by the cat below): e s b a dn / t bytes per layer
        v = v.contiguous()
        k = torch.cat([k_c, k_pe.expand(-1, -1, k_c.shape[2], -1)], dim=-1)
        q = torch.cat([q_c, q_r], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        s = q.shape[0]
        q, k, v = (y.permute(1, 2, 0, 3) for y in (q, k, v))  # [b, heads, s, d]
        if self.dsa:
            if cache is not None:
                raise ConfigError("generation with --experimental-attention-variant dsa: loom "
                                  "has no sparse attention over a KV cache yet")
            out = self.core_attention(q, k, v, x, q_latent, rope, moe)
        else:
            out = self.core_attention(q, k, v, positions)
        out = out.permute(2, 0, 1, 3).reshape(s, out.shape[0], -1)
        return self.linear_proj(out)
