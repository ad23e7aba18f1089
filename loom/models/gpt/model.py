"""Decoder-only language model, GPT-2 or LLaMA layout, as plain math.

Embedding (+ learned positions for GPT-2) -> L pre-LN layers -> final norm -> output layer
(tied to the embedding, or untied for LLaMA) -> cross-entropy. Activations are ``[s, b, h]``
(Megatron-LM's layout). Every layer is ``x + drop(attn(norm1(x)))`` then
``x + drop(mlp(norm2(x)))``; attention is MHA or GQA (``--num-query-groups``) with optional
RoPE; the MLP is GeLU or SwiGLU. With ``--experimental-attention-variant gdn`` the layers that
``--linear-attention-freq`` picks replace attention with Gated DeltaNet
(:mod:`loom.models.gpt.gdn`; Qwen3-Next's hybrid stack).

Nothing here knows about parallelism: :mod:`loom.models.gpt.parallelize` swaps the linear
layers for tensor-parallel ones, installs sequence-parallel regions and the context-parallel
attention core. Sizes that parallelism changes are read from the tensors (``-1`` in views,
split ratios of the fused QKV), so the same code runs sharded. A pipeline stage builds only its
own layers (``StageSpec``); parameter names carry the global layer index.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from loom.config import ModelConfig
from loom.errors import ConfigError
from loom.models.attention import KVCache, SelfAttention
from loom.models.chunk import Embedding, LanguageModelChunk, build_norm
from loom.models.language_model import forward_step  # noqa: F401 (the family's step)
from loom.models.gpt.gdn import GatedDeltaNet
from loom.models.gpt.gpt_oss_ops import gpt_oss_rope
from loom.models.gpt.mla import MLASelfAttention, mla_rope
from loom.models.mlp import MLP
from loom.models.moe import MoEContext, MoELayer
from loom.models.mtp import MultiTokenPrediction, mtp_loss


class TransformerLayer(nn.Module):
    """Pre-LN decoder layer: ``x + drop(attn(norm1(x)))``, then ``x + drop(mlp(norm2(x)))``.

    ``--apply-residual-connection-post-layernorm``: the residual is the norm's output,
    ``norm1(x) + drop(attn(norm1(x)))`` (Megatron's legacy ``ParallelTransformerLayer``,
    BLOOM's block). ``--fp32-residual-connection``: the residual and the block's 16-bit
    output are added in fp32 (the output upcast before the dropout: Megatron-LM d98e8a6's
    bias-dropout-add), so the layer returns fp32; the norms take fp32 inputs
    (:func:`~loom.models.chunk.build_norm`)."""

    def __init__(self, cfg: ModelConfig, layer_number: int, moe: Optional[bool] = None):
        super().__init__()
        self.input_layernorm = build_norm(cfg)
        attention = MLASelfAttention if cfg.multi_latent_attention else \
            GatedDeltaNet if cfg.is_gdn_layer(layer_number) else SelfAttention
        self.self_attention = attention(cfg, layer_number)
        self.pre_mlp_layernorm = build_norm(cfg)
        moe = cfg.is_moe_layer(layer_number) if moe is None else moe  # MTP: the last layer's
        self.mlp = MoELayer(cfg, layer_number) if moe else MLP(cfg)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)
        self.post_ln_residual = cfg.apply_residual_connection_post_layernorm
        self.fp32_residual = cfg.fp32_residual_connection

    def _residual_add(self, x: torch.Tensor, normed: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
        """``residual + drop(out)``, the residual ``x`` or ``normed`` (class docstring)."""
        residual = normed if self.post_ln_residual else x
        if self.fp32_residual:
            residual, out = residual.float(), out.float()
        return residual + self.hidden_dropout(out)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None,
                positions: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None,
                moe: Optional[MoEContext] = None) -> torch.Tensor:
        kw = {"moe": moe} if getattr(self.self_attention, "dsa", False) else {}
        h = self.input_layernorm(x)
        x = self._residual_add(x, h, self.self_attention(h, rope, positions, cache, **kw))
        h = self.pre_mlp_layernorm(x)
        return self._residual_add(x, h, self.mlp(h, moe))


class GPTModel(LanguageModelChunk):
    """The language model, or one pipeline chunk of it (:class:`~loom.models.chunk.
    LanguageModelChunk`: embedding, ``layers``, final norm, output layer when untied, head).
    Extra inputs of ``forward``: ``moe``, the MoE layers' auxiliary-loss scale and metrics
    (:class:`~loom.models.moe.MoEContext`); ``mtp``, the tokens the multi-token prediction
    modules (``--mtp-num-layers``, on the last chunk: :mod:`loom.models.mtp`) predict from
    (:class:`~loom.models.mtp.MTPContext`, which receives their losses in training);
    ``document_starts [b, s]`` (``--reset-attention-mask``) and ``document_position_ids [b, s]``
    (``--reset-position-ids``): :mod:`loom.data.document_masks`;
    ``cache``: :meth:`allocate_cache`."""

    extra_inputs = ("moe", "mtp", "document_starts", "document_position_ids")

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
        if self.cfg.gated_delta_net:
            raise ConfigError("generation with Gated DeltaNet layers: loom keeps no recurrent "
                              "state for them yet")
        for name, layer in self.layers.items():
            attn = layer.self_attention
            w = attn.linear_kv_down_proj.weight if isinstance(attn, MLASelfAttention) \
                else attn.linear_qkv.weight
            cache.allocate(int(name), attn.cache_shapes(batch, max_len), w, dtype)
        return cache


