"""BERT (Devlin et al. 2019) as plain math, in both layer-norm orders.

Embedding: word + learned position + token-type (segment A = 0, B = 1) embeddings. Encoder:
L bidirectional layers (no causal mask; padded keys are masked by ``padding_mask [b, s]``).

* pre-LN (default, Megatron-LM's BERT): ``x = x + drop(attn(LN1(x)))``,
  ``x = x + drop(mlp(LN2(x)))``, a final LN after the last layer, no LN on the embeddings.
* post-LN (``--post-layernorm``, the original BERT and ``transformers``' ``BertModel``):
  LN on the embeddings, ``x = LN1(x + drop(attn(x)))``, ``x = LN2(x + drop(mlp(x)))``, no final
  LN. (Megatron's ``--apply-residual-connection-post-layernorm`` is a third thing: the pre-LN
  layer with the residual taken from ``LN(x)`` instead of ``x``; loom builds it for GPT only.)

Masked-LM head: dense h -> h, GeLU, LN, then the output GEMM tied to the word embeddings plus a
vocabulary bias, and the cross-entropy. Binary head (``--bert-binary-head``, sentence-order
prediction): pooler ``tanh(W x[CLS] + b)`` then a 2-way classifier.

As in the other families, nothing here knows about parallelism (:mod:`.parallelize` holds the plan);
activations are ``[s, b, h]`` and parameter names carry the global layer index.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ModelConfig
from loom.models.attention import DotProductAttention
from loom.models.chunk import LanguageModelChunk, LMHead, build_norm
from loom.models.mlp import MLP

NUM_TOKENTYPES = 2


class BertSelfAttention(nn.Module):
    """``x [s, b, h] -> [s, b, h]``: fused QKV, bidirectional core with a key padding mask,
    output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a, g, d, h = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim, cfg.hidden_size
        self.head_dim = d
        self.q_share = a / (a + 2 * g)
        bias = not cfg.disable_bias_linear
        self.linear_qkv = nn.Linear(h, (a + 2 * g) * d, bias=bias or cfg.add_qkv_bias)
        self.core_attention = DotProductAttention(cfg.attention_dropout, causal=False)
        self.linear_proj = nn.Linear(a * d, h, bias=bias)

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        qkv = self.linear_qkv(x)
        s, b, width = qkv.shape
        q_width = round(width * self.q_share)
        kv_width = (width - q_width) // 2
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        q, k, v = (y.view(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for y in (q, k, v))
        out = self.core_attention(q, k, v, key_padding_mask=padding_mask)
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))


class BertLayer(nn.Module):
    """One encoder layer, pre-LN (``input_layernorm``, ``pre_mlp_layernorm``) or post-LN
    (``post_self_attn_layernorm``, ``post_mlp_layernorm``)."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        self.post_ln = cfg.post_layernorm
        if not self.post_ln:
            self.input_layernorm = build_norm(cfg)
        self.self_attention = BertSelfAttention(cfg)
        if self.post_ln:
            self.post_self_attn_layernorm = build_norm(cfg)
        else:
            self.pre_mlp_layernorm = build_norm(cfg)
        self.mlp = MLP(cfg)
        if self.post_ln:
            self.post_mlp_layernorm = build_norm(cfg)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        drop = self.hidden_dropout
        if self.post_ln:
            x = self.post_self_attn_layernorm(x + drop(self.self_attention(x, padding_mask)))
            return self.post_mlp_layernorm(x + drop(self.mlp(x)))
        x = x + drop(self.self_attention(self.input_layernorm(x), padding_mask))
        return x + drop(self.mlp(self.pre_mlp_layernorm(x)))


class BertEmbedding(nn.Module):
    """``ids, types [b, s] -> [s, b, h]``: word + position + token-type embeddings (+ LN when
    post-LN), dropout. ``full=False``: the word embeddings only (the last pipeline stage's copy
    of the tied output weight)."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int, full: bool = True):
        super().__init__()
        self.word_embeddings = nn.Embedding(padded_vocab, cfg.hidden_size)
        if full:
            self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden_size)
            self.tokentype_embeddings = nn.Embedding(NUM_TOKENTYPES, cfg.hidden_size)
            if cfg.post_layernorm:
                self.norm = build_norm(cfg)
            self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                types: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.word_embeddings(ids) + self.position_embeddings(positions)[None]
        if types is None:
            types = torch.zeros_like(ids)
        x = x + self.tokentype_embeddings(types)
        if hasattr(self, "norm"):
            x = self.norm(x)
        return self.dropout(x.transpose(0, 1).contiguous())


class VocabBias(nn.Module):
    """The masked-LM output bias ``[Vp]`` (vocabulary-parallel under TP: ``[Vp/t]``)."""

    def __init__(self, padded_vocab: int):
        super().__init__()
        self.bias = nn.Parameter(torch.empty(padded_vocab))


class MaskedLMHead(nn.Module):
    """``x [s, b, h] -> LN(gelu(dense(x)))`` (BERT's prediction-head transform)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.gelu_approx = "tanh" if cfg.openai_gelu else "none"
        self.layer_norm = build_norm(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(F.gelu(self.dense(x), approximate=self.gelu_approx))


class Pooler(nn.Module):
    """``tanh(W x[0] + b)``: the [CLS] (first) position of ``x [s, b, h]`` -> ``[b, h]``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x[0]))


class BertModel(LanguageModelChunk):
    """BERT, or one pipeline chunk of it (the shared skeleton,
    :class:`~loom.models.chunk.LanguageModelChunk`; see :class:`~loom.models.family.StageSpec`).
    The masked-LM output is tied to the word embeddings (plus an output bias). Extra inputs of
    ``forward``: ``tokentype_ids [b, s]`` (first chunk) and ``padding_mask [b, s]`` (1 for real
    tokens, 0 for [PAD]; None: no padding).

    Returns, on the last chunk, ``(lm, sop_logits)``: ``lm`` is the per-token masked-LM loss
    ``[b, s]`` (fp32) when ``labels`` is given, else the logits ``[b, s, Vp]``; ``sop_logits
    [b, 2]`` or None without the binary head. Other chunks: ``[s, b, h]``."""

    tied = True
    extra_inputs = ("tokentype_ids", "padding_mask")

    def build_embedding(self, cfg: ModelConfig, padded_vocab: int) -> nn.Module:
        return BertEmbedding(cfg, padded_vocab, full=self.pre_process)

    def build_layer(self, cfg: ModelConfig, layer_number: int) -> nn.Module:
        return BertLayer(cfg, layer_number)

    def build_output(self, cfg: ModelConfig, padded_vocab: int) -> None:
        if not cfg.post_layernorm:
            self.final_layernorm = build_norm(cfg)
        self.lm_head = MaskedLMHead(cfg)
        self.output_layer = VocabBias(padded_vocab)
        self.head = LMHead(cfg.softmax_vocab_size)
        if cfg.bert_binary_head:
            self.pooler = Pooler(cfg)
            self.binary_head = nn.Linear(cfg.hidden_size, 2)

    def default_positions(self, input_ids: Optional[torch.Tensor], cache) -> torch.Tensor:
        """``0 .. s-1`` on the first chunk; later chunks need none (None)."""
        return None if input_ids is None else super().default_positions(input_ids, cache)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
              extra: dict) -> torch.Tensor:
        return self.embedding(input_ids, position_ids, extra.get("tokentype_ids"))

    def layer_inputs(self, position_ids: torch.Tensor, cache, extra: dict) -> tuple:
        return (extra.get("padding_mask"),)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.cfg.post_layernorm else self.final_layernorm(x)

    def output(self, x: torch.Tensor, labels: Optional[torch.Tensor], extra: dict):
        """``x [s, b, h]`` -> ``(lm, sop_logits)`` (class docstring)."""
        sop = self.binary_head(self.pooler(x)) if self.cfg.bert_binary_head else None
        y = self.lm_head(x)
        # the output bias rides along the tied GEMM: [y, 1] . [W, bias]^T = y W^T + bias
        y = torch.cat([y, y.new_ones(*y.shape[:-1], 1)], dim=-1)
        weight = torch.cat([self.embedding.word_embeddings.weight,
                            self.output_layer.bias.unsqueeze(1)], dim=1)
        return self.head(y, weight, labels), sop


def bert_loss(output, loss_mask: torch.Tensor, sop_labels: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked-LM cross-entropy averaged over the masked positions (``loss_mask [b, s]``), plus
    the sentence-order cross-entropy when the binary head is on; metrics ``mlm loss`` and
    ``sop loss``."""
    per_token, sop_logits = output
    mask = loss_mask.float()
    mlm = (per_token.float() * mask).sum() / mask.sum().clamp_min(1.0)
    metrics = {"mlm loss": mlm.detach()}
    loss = mlm
    if sop_logits is not None:
        sop = F.cross_entropy(sop_logits.float(), sop_labels.long())
        metrics["sop loss"] = sop.detach()
        loss = mlm + sop
    return loss, metrics


def forward_step(chunk: BertModel, batch: dict, hidden_states: Optional[torch.Tensor] = None):
    """``batch``: ``tokens``, ``labels``, ``loss_mask``, ``types``, ``padding_mask`` ``[b, s]``,
    ``sop_labels [b]`` (:class:`loom.data.bert_dataset.BertDataset`); returns
    ``(output, loss_fn)``."""
    out = chunk(input_ids=batch["tokens"] if chunk.pre_process else None,
                labels=batch["labels"] if chunk.post_process else None,
                hidden_states=hidden_states, position_ids=batch.get("position_ids"),
                tokentype_ids=batch.get("types"), padding_mask=batch.get("padding_mask"))
    return out, functools.partial(bert_loss, loss_mask=batch["loss_mask"],
                                  sop_labels=batch.get("sop_labels"))
