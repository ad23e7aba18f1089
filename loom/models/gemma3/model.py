"""Gemma 3 (text) decoder as plain math (Gemma Team 2025, "Gemma 3 Technical Report").

Embedding scaled by sqrt(h) (in the embedding's dtype) -> L layers -> final norm -> output tied
to the embedding (optionally soft-capped logits) -> cross-entropy. Activations are ``[s, b, h]``.
Each layer has four norms, before and after attention and before and after the MLP::

    x = x + post_self_attn_layernorm(attn(input_layernorm(x)))
    x = x + post_mlp_layernorm(mlp(pre_mlp_layernorm(x)))

Every norm is RMSNorm computed in fp32 with a ``(1 + weight)`` gain (zero-initialized weight).
Attention: GQA with separate Q and fused KV projections, RMSNorm on each head's queries and keys
(QK-norm) before RoPE, scores scaled by ``query_pre_attn_scalar ** -0.5`` and optionally
soft-capped. Layers are local (``L``: a sliding window of ``--sliding-window`` keys, RoPE base
``--rotary-base-local``) or global (``G``: every key before the query, RoPE base
``--rotary-base`` with optional linear scaling), 5 local : 1 global by default
(``ModelConfig.attention_layer_types``). The MLP is GeGLU: ``gelu_tanh(gate) * up``, gate and up
fused in one projection.

Shared with the other families (:mod:`loom.models.chunk`, :mod:`loom.models.language_model`):
the word-embedding module, the LM head and the loss. Nothing here
knows about parallelism (:mod:`loom.models.gemma3.parallelize`); sizes TP changes are read from
tensors (``-1`` in views).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ModelConfig
from loom.models.attention import KVCache, apply_rope, rope_cos_sin, window_causal_mask
from loom.models.chunk import Embedding, LanguageModelChunk, LMHead
from loom.models.language_model import lm_loss


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` in fp32, returned in ``x``'s dtype (HF ``Gemma3RMSNorm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GemmaAttentionCore(nn.Module):
    """``softmax(cap(q k^T * scale) + mask) v`` with a causal mask by global position, limited
    to the last ``window`` keys on local layers: ``q [b, a, s_q, d]``, ``k, v [b, g, s_k, d]``
    (keys at positions ``0 .. s_k - 1``; queries at ``q_positions``, default the last s_q)."""

    def __init__(self, scale: float, window: Optional[int], softcap: Optional[float],
                 dropout: float = 0.0):
        super().__init__()
        self.scale, self.window, self.softcap, self.dropout = scale, window, softcap, dropout
        self.rng = None  # per-TP-rank generator (the plan's PartitionedRNG)

    def mask(self, q_positions: torch.Tensor, s_k: int) -> torch.Tensor:
        """Boolean ``[s_q, s_k]``: key j is visible from the query at position p when
        ``0 <= p - j < window``."""
        return window_causal_mask(q_positions, s_k,
                                  None if self.window is None else self.window - 1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                q_positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        s_q, s_k = q.shape[2], k.shape[2]
        if q_positions is None:
            q_positions = torch.arange(s_k - s_q, s_k, device=q.device)
        mask = self.mask(q_positions, s_k)
        p = self.dropout if self.training else 0.0
        fork = self.rng.fork() if (p > 0 and self.rng is not None) else contextlib.nullcontext()
        with fork:
            if self.softcap is None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                      scale=self.scale,
                                                      enable_gqa=q.shape[1] != k.shape[1])
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
            scores = torch.tanh(scores / self.softcap) * self.softcap
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = F.dropout(torch.softmax(scores.float(), dim=-1).to(q.dtype), p)
            return torch.matmul(probs, v)


class GemmaAttention(nn.Module):
    """``x [s, b, h] -> [s, b, h]``: Q ``[a d, h]`` and fused KV ``[2 g d, h]`` projections,
    QK-norm (not with ``--no-gemma-qk-norm``: Gemma 2), RoPE of this layer's kind, the core,
    the output projection."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        a, g, d, h = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim, cfg.hidden_size
        self.head_dim, self.layer_number = d, layer_number
        self.kind = cfg.attention_layer_types[layer_number]  # "L" local or "G" global
        self.linear_q = nn.Linear(h, a * d, bias=False)
        self.linear_kv = nn.Linear(h, 2 * g * d, bias=False)
        self.q_layernorm = self.k_layernorm = None  # --no-gemma-qk-norm: Gemma 2's layers
        if cfg.gemma_qk_norm:
            self.q_layernorm = GemmaRMSNorm(d, cfg.norm_epsilon)
            self.k_layernorm = GemmaRMSNorm(d, cfg.norm_epsilon)
        self.core_attention = GemmaAttentionCore(
            (cfg.query_pre_attn_scalar or d) ** -0.5,
            cfg.sliding_window if self.kind == "L" else None, cfg.attn_logit_softcapping,
            cfg.attention_dropout)
        self.linear_proj = nn.Linear(a * d, h, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple, positions: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        d = self.head_dim
        q = self.linear_q(x)
        s, b, _ = q.shape
        k, v = self.linear_kv(x).chunk(2, dim=-1)
        q, k, v = q.view(s, b, -1, d), k.view(s, b, -1, d), v.view(s, b, -1, d)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (y.permute(1, 2, 0, 3) for y in (q, k, v))  # [b, heads, s, d]
        if cache is not None:
            k, v = cache.update(self.layer_number, k, v)
        out = self.core_attention(q, k, v, positions)
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))


class GeGLU(nn.Module):
    """``x [s, b, h] -> [s, b, h]``: ``fc2(gelu(gate) * up)``, gate and up fused in ``fc1``
    (tanh-approximated GeLU, HF's ``gelu_pytorch_tanh``, unless ``--no-openai-gelu``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_size
        self.approximate = "tanh" if cfg.openai_gelu else "none"
        self.linear_fc1 = nn.Linear(h, 2 * f, bias=False)
        self.linear_fc2 = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.gelu(gate, approximate=self.approximate) * up)


class GemmaLayer(nn.Module):
    """One decoder layer with the sandwich norms (module docstring); without the post-norms
    under ``--no-gemma-post-norms`` (Gemma 1: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``;
    Gemma Team 2024, "Gemma: Open Models Based on Gemini Research and Technology", sec. 2)."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.norm_epsilon
        post = cfg.gemma_post_norms
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attention = GemmaAttention(cfg, layer_number)
        self.post_self_attn_layernorm = GemmaRMSNorm(h, eps) if post else nn.Identity()
        self.pre_mlp_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GeGLU(cfg)
        self.post_mlp_layernorm = GemmaRMSNorm(h, eps) if post else nn.Identity()
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, ropes: dict, positions: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(x), ropes[self.self_attention.kind],
                                   positions, cache)
        x = x + self.hidden_dropout(self.post_self_attn_layernorm(attn))
        return x + self.hidden_dropout(self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(x))))


class Gemma3Model(LanguageModelChunk):
    """The Gemma 3 language model, or one pipeline chunk of it (the shared skeleton,
    :class:`~loom.models.chunk.LanguageModelChunk`). The output layer is the word embedding
    (the last chunk keeps its own copy under pipeline parallelism, kept equal by the plan, as
    in the GPT family); the embedding output is scaled by ``sqrt(h)``; the head soft-caps the
    logits (``--final-logit-softcapping``). ``cache``: generation's KV cache
    (:meth:`allocate_cache`)."""

    tied = True

    def build_embedding(self, cfg: ModelConfig, padded_vocab: int) -> nn.Module:
        return Embedding(cfg, padded_vocab, with_positions=False)

    def build_layer(self, cfg: ModelConfig, layer_number: int) -> nn.Module:
        return GemmaLayer(cfg, layer_number)

    def build_output(self, cfg: ModelConfig, padded_vocab: int) -> None:
        self.final_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.head = LMHead(cfg.softmax_vocab_size, cfg.final_logit_softcapping)  # shared

    def ropes(self, positions: torch.Tensor) -> dict:
        """cos, sin ``[s, d]`` per layer kind: local and global RoPE bases."""
        m, d = self.cfg, self.cfg.head_dim
        return {"L": rope_cos_sin(positions, d, m.rotary_base_local),
                "G": rope_cos_sin(positions, d, m.rotary_base, m.rotary_scaling_factor or 1.0)}

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
              extra: dict) -> torch.Tensor:
        """``input_ids [b, s] -> [s, b, h]``, scaled by ``sqrt(h)`` (HF: in its dtype)."""
        x = self.embedding(input_ids, position_ids)
        return x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)

    def layer_inputs(self, position_ids: torch.Tensor, cache, extra: dict) -> tuple:
        return self.ropes(position_ids), position_ids, cache

    def allocate_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``max_len`` positions (this rank's
        KV groups: ``local_groups`` of a replicated KV projection, else from its width)."""
        cache = KVCache()
        for name, layer in self.layers.items():
            kv, d = layer.self_attention.linear_kv, layer.self_attention.head_dim
            groups = getattr(kv, "local_groups", None) or kv.weight.shape[0] // (2 * d)
            for store in (cache.keys, cache.values):
                store[int(name)] = torch.zeros(batch, groups, max_len, d, device=kv.weight.device,
                                               dtype=dtype or kv.weight.dtype)
        return cache


def forward_step(chunk: Gemma3Model, batch: dict, hidden_states: Optional[torch.Tensor] = None):
    """Megatron's forward step (``tokens``, ``labels``, ``position_ids``) -> ``(output, loss_fn)``."""
    out = chunk(input_ids=batch["tokens"] if chunk.pre_process else None,
                labels=batch["labels"] if chunk.post_process else None,
                hidden_states=hidden_states, position_ids=batch.get("position_ids"))
    return out, functools.partial(lm_loss, moe=None)
