"""Decoder-only language model, GPT-2 or LLaMA layout, as plain math.

Embedding (+ learned positions for GPT-2) -> L pre-LN layers -> final norm -> output layer
(tied to the embedding, or untied for LLaMA) -> cross-entropy. Activations are ``[s, b, h]``
(Megatron-LM's layout). Every layer is ``x + drop(attn(norm1(x)))`` then
``x + drop(mlp(norm2(x)))``; attention is MHA or GQA (``--num-query-groups``) with optional
RoPE; the MLP is GeLU or SwiGLU.

Nothing here knows about parallelism: :mod:`loom.models.gpt.parallelize` swaps the linear
layers for tensor-parallel ones, installs sequence-parallel regions and the context-parallel
attention core. Sizes that parallelism changes are read from the tensors (``-1`` in views,
split ratios of the fused QKV), so the same code runs sharded. A pipeline stage builds only its
own layers (``StageSpec``); parameter names carry the global layer index.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ModelConfig
from loom.models.attention import DotProductAttention, KVCache, apply_rope
from loom.models.chunk import LMHead, LanguageModelChunk, build_norm  # noqa: F401 (re-exported)
from loom.models.moe import MoEContext, MoELayer


class SelfAttention(nn.Module):
    """``x [s, b, h] -> [s, b, h]``: fused QKV projection (a query heads, g key/value groups of
    dimension d), RoPE, the attention core, output projection."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        a, g, d, h = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim, cfg.hidden_size
        self.layer_number, self.head_dim = layer_number, d
        self.q_share = a / (a + 2 * g)  # share of the fused QKV width that is queries
        bias = not cfg.disable_bias_linear
        self.linear_qkv = nn.Linear(h, (a + 2 * g) * d, bias=bias or cfg.add_qkv_bias)
        self.core_attention = DotProductAttention(cfg.attention_dropout)
        self.linear_proj = nn.Linear(a * d, h, bias=bias)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None,
                positions: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        d = self.head_dim
        qkv = self.linear_qkv(x)  # [s, b, (a + 2g) d]
        s, b, width = qkv.shape
        q_width = round(width * self.q_share)
        kv_width = (width - q_width) // 2
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        q, k, v = q.view(s, b, -1, d), k.view(s, b, -1, d), v.view(s, b, -1, d)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (y.permute(1, 2, 0, 3) for y in (q, k, v))  # [b, heads, s, d]
        if cache is not None:
            k, v = cache.update(self.layer_number, k, v)
        out = self.core_attention(q, k, v, positions)
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)
        return self.linear_proj(out)


class MLP(nn.Module):
    """``x [s, b, h] -> [s, b, h]`` through ``f`` = ``--ffn-hidden-size`` features: GeLU, or
    SwiGLU (``silu(gate) * up``, gate and up fused in one projection)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_size
        bias = not cfg.disable_bias_linear
        self.swiglu = cfg.swiglu
        self.gelu_approx = "tanh" if cfg.openai_gelu else "none"
        self.linear_fc1 = nn.Linear(h, 2 * f if cfg.swiglu else f, bias=bias)
        self.linear_fc2 = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor, moe: Optional[MoEContext] = None) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate=self.gelu_approx)
        return self.linear_fc2(y)


class TransformerLayer(nn.Module):
    """Pre-LN decoder layer: ``x + drop(attn(norm1(x)))``, then ``x + drop(mlp(norm2(x)))``."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        self.input_layernorm = build_norm(cfg)
        self.self_attention = SelfAttention(cfg, layer_number)
        self.pre_mlp_layernorm = build_norm(cfg)
        self.mlp = MoELayer(cfg, layer_number) if cfg.is_moe_layer(layer_number) else MLP(cfg)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None,
                positions: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None,
                moe: Optional[MoEContext] = None) -> torch.Tensor:
        x = x + self.hidden_dropout(self.self_attention(self.input_layernorm(x), rope, positions,
                                                        cache))
        return x + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(x), moe))


class Embedding(nn.Module):
    """Word embeddings plus learned absolute positions: ``ids [b, s] -> [s, b, h]``."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int, with_positions: bool = True):
        super().__init__()
        self.word_embeddings = nn.Embedding(padded_vocab, cfg.hidden_size)
        self.position_embeddings = None
        if with_positions and cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(ids)  # [b, s, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(positions)[None]
        return self.dropout(x.transpose(0, 1).contiguous())  # [s, b, h]


class GPTModel(LanguageModelChunk):
    """The language model, or one pipeline chunk of it (:class:`~loom.models.chunk.
    LanguageModelChunk`: embedding, ``layers``, final norm, output layer when untied, head).
    Extra input of ``forward``: ``moe``, the MoE layers' auxiliary-loss scale and metrics
    (:class:`~loom.models.moe.MoEContext`); ``cache``: :meth:`allocate_cache`."""

    extra_inputs = ("moe",)

    def build_embedding(self, cfg: ModelConfig, padded_vocab: int) -> nn.Module:
        return Embedding(cfg, padded_vocab, with_positions=self.pre_process)

    def build_layer(self, cfg: ModelConfig, layer_number: int) -> nn.Module:
        return TransformerLayer(cfg, layer_number)

    def allocate_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``max_len`` positions."""
        cache = KVCache()
        for name, layer in self.layers.items():
            w = layer.self_attention.linear_qkv.weight
            d = layer.self_attention.head_dim
            groups = round(w.shape[0] * (1 - layer.self_attention.q_share) / 2) // d
            shape = (batch, groups, max_len, d)
            cache.keys[int(name)] = torch.zeros(shape, dtype=dtype or w.dtype, device=w.device)
            cache.values[int(name)] = torch.zeros(shape, dtype=dtype or w.dtype, device=w.device)
        return cache


def lm_loss(per_token: torch.Tensor, moe: Optional[MoEContext] = None
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean of the per-token loss ``[b, s]``, and the metrics: ``lm loss``, and for MoE models
    the auxiliary losses summed over this chunk's MoE layers (already in the gradient through
    :class:`~loom.models.moe.AuxLossScaler`) and the per-expert token load (min, max, max/mean)."""
    loss = per_token.float().mean()
    metrics = {"lm loss": loss.detach()}
    if moe is not None and moe.metrics:
        for kind in ("aux loss", "z loss", "dropped"):
            metrics[f"moe {kind}"] = sum(v.float() for k, v in moe.metrics.items()
                                         if k.startswith(f"moe {kind}/"))
        load = sum(v for k, v in moe.metrics.items() if k.startswith("moe load/")).float()
        metrics.update({"moe load min": load.min(), "moe load max": load.max(),
                        "moe load imbalance": load.max() / load.mean().clamp_min(1e-9)})
    return loss, metrics


def forward_step(chunk: GPTModel, batch: dict, hidden_states: Optional[torch.Tensor] = None):
    """Megatron's forward step: ``batch`` has ``tokens``, ``labels`` ``[b, s]``,
    ``position_ids [s]`` and ``num_microbatches`` (m: MoE auxiliary losses are scaled by 1/m
    like the LM loss); returns ``(output, loss_fn)``."""
    moe = None
    if chunk.cfg.num_experts:
        moe = MoEContext(scale=1.0 / batch.get("num_microbatches", 1))
    out = chunk(input_ids=batch["tokens"] if chunk.pre_process else None,
                labels=batch["labels"] if chunk.post_process else None,
                hidden_states=hidden_states, position_ids=batch.get("position_ids"), moe=moe)
    return out, functools.partial(lm_loss, moe=moe)
