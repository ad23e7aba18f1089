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
from loom.models.activation import gated_activation, squared_relu
from loom.models.gpt.gpt_oss_ops import SinkWindowAttention, gpt_oss_rope
from loom.models.gpt.mla import MLASelfAttention, mla_rope
from loom.models.gpt.mtp import MTPContext, MultiTokenPrediction, mtp_loss, mtp_metrics
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
        self.q_layernorm = self.k_layernorm = None
        if cfg.qk_layernorm:  # per-head norm of queries and keys before RoPE (Megatron, Qwen3)
            norm = nn.RMSNorm if cfg.normalization == "RMSNorm" else nn.LayerNorm
            self.q_layernorm, self.k_layernorm = (norm(d, eps=cfg.norm_epsilon) for _ in "qk")
        if cfg.softmax_type != "vanilla" or cfg.is_window_layer(layer_number):  # gpt-oss
            self.core_attention = SinkWindowAttention(
                cfg.attention_dropout, a, cfg.softmax_type,
                cfg.window[0] if cfg.is_window_layer(layer_number) else None,
                scale=cfg.attention_softmax_scale)
        else:
            self.core_attention = DotProductAttention(cfg.attention_dropout,
                                                      scale=cfg.attention_softmax_scale)
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
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (y.permute(1, 2, 0, 3) for y in (q, k, v))  # [b, heads, s, d]
        if cache is not None:
            k, v = cache.update(self.layer_number, k, v)
        out = self.core_attention(q, k, v, positions)
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)
        return self.linear_proj(out)


class MLP(nn.Module):
    """``x [s, b, h] -> [s, b, h]`` through ``f`` = ``--ffn-hidden-size`` features: GeLU,
    SwiGLU (``silu(gate) * up``, gate and up fused in one projection), or ``--squared-relu``
    (``relu(y)^2``, So et al. 2021 "Primer"; Megatron's ``squared_relu``), or the gated
    activation of :func:`~loom.models.activation.gated_activation` (``--quick-geglu``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_size
        bias = not cfg.disable_bias_linear
        self.swiglu, self.act = cfg.swiglu, gated_activation(cfg)
        self.gelu_approx = "tanh" if cfg.openai_gelu else "none"
        self.squared_relu = cfg.squared_relu
        self.linear_fc1 = nn.Linear(h, 2 * f if cfg.gated_linear_unit else f, bias=bias)
        self.linear_fc2 = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor, moe: Optional[MoEContext] = None) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.act is not None:
            y = self.act(y)
        elif self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        elif self.squared_relu:
            y = squared_relu(y)
        else:
            y = F.gelu(y, approximate=self.gelu_approx)
        return self.linear_fc2(y)


class TransformerLayer(nn.Module):
    """Pre-LN decoder layer: ``x + drop(attn(norm1(x)))``, then ``x + drop(mlp(norm2(x)))``."""

    def __init__(self, cfg: ModelConfig, layer_number: int, moe: Optional[bool] = None):
        super().__init__()
        self.input_layernorm = build_norm(cfg)
        attention = MLASelfAttention if cfg.multi_latent_attention else SelfAttention
        self.self_attention = attention(cfg, layer_number)
        self.pre_mlp_layernorm = build_norm(cfg)
        moe = cfg.is_moe_layer(layer_number) if moe is None else moe  # MTP: the last layer's
        self.mlp = MoELayer(cfg, layer_number) if moe else MLP(cfg)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None,
                positions: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None,
                moe: Optional[MoEContext] = None) -> torch.Tensor:
        x = x + self.hidden_dropout(self.self_attention(self.input_layernorm(x), rope, positions,
                                                        cache))
        return x + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(x), moe))


class Embedding(nn.Module):
    """Word embeddings plus learned absolute positions: ``ids [b, s] -> [s, b, h]``, times
    muP's ``--mup-embedding-mult`` (1 without ``--use-mup``)."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int, with_positions: bool = True):
        super().__init__()
        self.multiplier = cfg.embedding_multiplier
        self.word_embeddings = nn.Embedding(padded_vocab, cfg.hidden_size)
        self.position_embeddings = None
        if with_positions and cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(ids)  # [b, s, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(positions)[None]
        if self.multiplier != 1.0:
            x = x * self.multiplier
        return self.dropout(x.transpose(0, 1).contiguous())  # [s, b, h]


class GPTModel(LanguageModelChunk):
    """The language model, or one pipeline chunk of it (:class:`~loom.models.chunk.
    LanguageModelChunk`: embedding, ``layers``, final norm, output layer when untied, head).
    Extra inputs of ``forward``: ``moe``, the MoE layers' auxiliary-loss scale and metrics
    (:class:`~loom.models.moe.MoEContext`); ``mtp``, the tokens the multi-token prediction
    modules (``--mtp-num-layers``, on the last chunk: :mod:`loom.models.gpt.mtp`) predict from
    (:class:`~loom.models.gpt.mtp.MTPContext`, which receives their losses in training);
    ``cache``: :meth:`allocate_cache`."""

    extra_inputs = ("moe", "mtp")

    def build_embedding(self, cfg: ModelConfig, padded_vocab: int) -> nn.Module:
        return Embedding(cfg, padded_vocab, with_positions=self.pre_process)

    def build_layer(self, cfg: ModelConfig, layer_number: int) -> nn.Module:
        return TransformerLayer(cfg, layer_number)

    def build_output(self, cfg: ModelConfig, padded_vocab: int) -> None:
        super().build_output(cfg, padded_vocab)
        if cfg.mtp_num_layers:  # MTP embeds tokens on the last stage: its own (shared) copy
            if not hasattr(self, "embedding"):
                self.embedding = self.build_embedding(cfg, padded_vocab)
            last_moe = cfg.is_moe_layer(cfg.num_layers - 1)  # MTP layers: the last layer's MLP
            self.mtp = MultiTokenPrediction(cfg, lambda n: TransformerLayer(cfg, n, last_moe))

    def layer_inputs(self, position_ids: torch.Tensor, cache, extra: dict) -> tuple:
        if self.cfg.enable_gpt_oss:  # YaRN RoPE with gpt-oss's values
            rope = gpt_oss_rope(position_ids, self.cfg.rotary_dim, self.cfg.rotary_base)
            return rope, position_ids, cache, extra.get("moe")
        if not self.cfg.multi_latent_attention:
            return super().layer_inputs(position_ids, cache, extra)
        return mla_rope(self.cfg, position_ids), position_ids, cache, extra.get("moe")

    def output(self, x: torch.Tensor, labels: Optional[torch.Tensor], extra: dict):
        out = super().output(x, labels, extra)
        ctx = extra.get("mtp")
        if ctx is not None and labels is not None and self.training and hasattr(self, "mtp"):
            mtp_loss(self, x, ctx, self.layer_inputs(ctx.position_ids, None, extra))
        return out

    def allocate_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``max_len`` positions (MLA: the
        latent and the rotated shared key, :class:`~loom.models.gpt.mla.MLASelfAttention`)."""
        cache = KVCache()
        for name, layer in self.layers.items():
            if isinstance(layer.self_attention, MLASelfAttention):
                w = layer.self_attention.linear_kv_down_proj.weight
                kshape, vshape = layer.self_attention.cache_shapes(batch, max_len)
                cache.keys[int(name)] = torch.zeros(kshape, dtype=dtype or w.dtype,
                                                    device=w.device)
                cache.values[int(name)] = torch.zeros(vshape, dtype=dtype or w.dtype,
                                                      device=w.device)
                continue
            w = layer.self_attention.linear_qkv.weight
            d = layer.self_attention.head_dim
            groups = round(w.shape[0] * (1 - layer.self_attention.q_share) / 2) // d
            shape = (batch, groups, max_len, d)
            cache.keys[int(name)] = torch.zeros(shape, dtype=dtype or w.dtype, device=w.device)
            cache.values[int(name)] = torch.zeros(shape, dtype=dtype or w.dtype, device=w.device)
        return cache


def lm_loss(per_token: torch.Tensor, moe: Optional[MoEContext] = None,
            mtp: Optional[MTPContext] = None, loss_mask: Optional[torch.Tensor] = None
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean of the per-token loss ``[b, s]`` (with ``loss_mask [b, s]``, ``--eod-mask-loss``:
    Megatron's ``sum(loss x mask) / sum(mask)`` over this micro-batch's tokens, at least 1 in
    the denominator) (plus, in training with ``--mtp-num-layers``, the
    weighted multi-token prediction loss), and the metrics: ``lm loss``, ``mtp loss`` (mean over
    the depths), for MoE models
    the auxiliary losses summed over this chunk's MoE layers (already in the gradient through
    :class:`~loom.models.moe.AuxLossScaler`) and the per-expert token load (min, max, max/mean)."""
    if loss_mask is None:
        loss = per_token.float().mean()
    else:
        mask = loss_mask.float()
        loss = (per_token.float() * mask).sum() / mask.sum().clamp_min(1.0)
    metrics = {"lm loss": loss.detach(), **mtp_metrics(mtp)}
    if mtp is not None and mtp.losses:
        loss = loss + mtp.weighted
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
    moe = mtp = None
    if chunk.cfg.num_experts:
        moe = MoEContext(scale=1.0 / batch.get("num_microbatches", 1))
    if chunk.cfg.mtp_num_layers and chunk.post_process:
        s = batch["tokens"].shape[1]
        positions = batch.get("position_ids")
        mtp = MTPContext(batch["tokens"], batch["labels"], torch.arange(
            s, device=batch["tokens"].device) if positions is None else positions)
    extra = {k: v for k, v in (("moe", moe), ("mtp", mtp))  # Mamba shares this step, no MTP
             if k in chunk.extra_inputs}
    out = chunk(input_ids=batch["tokens"] if chunk.pre_process else None,
                labels=batch["labels"] if chunk.post_process else None,
                hidden_states=hidden_states, position_ids=batch.get("position_ids"), **extra)
    return out, functools.partial(lm_loss, moe=moe, mtp=mtp, loss_mask=batch.get("loss_mask"))
