"""The pieces every family's language model shares, written once.

:class:`LanguageModelChunk` is the chunk skeleton: the embedding when the chunk holds the first
layers (``pre_process``), its layers in an ``nn.ModuleDict`` keyed by the global layer index,
then the final norm and the output head when it holds the last ones (``post_process``).
Families fill in hooks (what to build: ``build_embedding``, ``build_layer``, ``build_output``;
how to run: ``embed``, ``layer_inputs``, ``final_norm``, ``output``) and keep their module
names, so parameter names, and with them checkpoints and seeded initialization, are the
family's own. :class:`Embedding` is the word (+ learned position) embedding of the GPT, Gemma 3
and Mamba families (Megatron-Core's ``LanguageModelEmbedding``); :class:`LMHead` the output
GEMM + loss every family uses; :func:`build_norm` the ``--normalization`` choice. Activations are ``[s, b, h]``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ModelConfig
from loom.models.attention import Documents, rope_cos_sin
from loom.models.yarn import yarn_cos_sin
from loom.models.family import StageSpec


class Fp32InputLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that takes an fp32 input with 16-bit parameters
    (``--fp32-residual-connection``): computed in fp32 (the parameters upcast), returned in the
    parameters' dtype (apex's ``MixedFusedLayerNorm`` under Megatron's legacy fp32 residual).
    An input of the parameters' dtype takes the plain norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if w is None or x.dtype == w.dtype:
            return super().forward(x)
        return F.layer_norm(x, self.normalized_shape, w.float(),
                            None if b is None else b.float(), self.eps).to(w.dtype)


class Fp32InputRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` that takes an fp32 input with 16-bit parameters, as
    :class:`Fp32InputLayerNorm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w is None or x.dtype == w.dtype:
            return super().forward(x)
        return F.rms_norm(x, self.normalized_shape, w.float(), self.eps).to(w.dtype)


def build_norm(cfg: ModelConfig) -> nn.Module:
    """LayerNorm or RMSNorm over the hidden dimension (``--normalization``); with
    ``--fp32-residual-connection`` the variant that takes the fp32 residual stream
    (:class:`Fp32InputLayerNorm`, :class:`Fp32InputRMSNorm`)."""
    fp32 = cfg.fp32_residual_connection
    if cfg.normalization == "RMSNorm":
        return (Fp32InputRMSNorm if fp32 else nn.RMSNorm)(cfg.hidden_size, eps=cfg.norm_epsilon)
    return (Fp32InputLayerNorm if fp32 else nn.LayerNorm)(cfg.hidden_size, eps=cfg.norm_epsilon)


class LMHead(nn.Module):
    """The LM head every family shares: output GEMM, optional soft-capping
    ``cap * tanh(logits / cap)`` (Gemma 3's ``--final-logit-softcapping``), loss: ``x [s, b, h]``,
    ``weight [Vp, h]``; returns the per-token cross-entropy ``[b, s]`` (fp32) against
    ``labels [b, s]``, or the logits ``[b, s, Vp]``. The softmax spans the first
    ``vocab_size`` columns (``ModelConfig.softmax_vocab_size``: V with
    ``--exclude-padded-vocab``), or all Vp when it is None (the padded columns included, as
    Megatron-Core computes it). ``logit_scale``: the logits' multiplier (muP's
    ``--mup-output-mult``; applied to ``x``, the same product). No parameters (the weight is
    the caller's)."""

    def __init__(self, vocab_size: Optional[int], softcap: Optional[float] = None,
                 logit_scale: float = 1.0):
        super().__init__()
        self.vocab_size, self.softcap, self.logit_scale = vocab_size, softcap, logit_scale

    def forward(self, x: torch.Tensor, weight: torch.Tensor,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.logit_scale != 1.0:
            x = x * self.logit_scale
        logits = F.linear(x, weight)  # [s, b, Vp]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if labels is None:
            return logits.transpose(0, 1)
        s, b, Vp = logits.shape
        V = self.vocab_size or Vp
        loss = F.cross_entropy(logits[..., :V].float().reshape(-1, V), labels.t().reshape(-1),
                               reduction="none")
        return loss.view(s, b).t()


class Embedding(nn.Module):
    """Word embeddings plus learned absolute positions: ``ids [b, s] -> [s, b, h]``, times
    muP's ``--mup-embedding-mult`` (1 without ``--use-mup``); fp32 under
    ``--fp32-residual-connection`` (cast before the dropout, as Megatron-Core's
    ``LanguageModelEmbedding``)."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int, with_positions: bool = True):
        super().__init__()
        self.multiplier = cfg.embedding_multiplier
        self.fp32 = cfg.fp32_residual_connection
        self.word_embeddings = nn.Embedding(padded_vocab, cfg.hidden_size)
        self.position_embeddings = None
        if with_positions and cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``positions [s]``, or ``[b, s]`` per sample (``--reset-position-ids``)."""
        x = self.word_embeddings(ids)  # [b, s, h]
        if self.position_embeddings is not None:
            pos = self.position_embeddings(positions)
            x = x + (pos if positions.dim() == 2 else pos[None])
        if self.multiplier != 1.0:
            x = x * self.multiplier
        if self.fp32:
            x = x.float()
        return self.dropout(x.transpose(0, 1).contiguous())  # [s, b, h]


class LanguageModelChunk(nn.Module):
    """A language model, or one pipeline chunk of it (``stage``: its global layer indices,
    whether it holds the embedding and/or the final norm, output layer and loss).

    Built in this order (module names are part of the checkpoint format): ``embedding`` (on the
    first chunk, and on the last one of a tied model: its own copy, same name hence same initial
    weights, kept equal by the plan), ``layers.<i>``, then on the last chunk what
    :meth:`build_output` adds (default: ``final_layernorm``, ``output_layer`` when untied,
    ``head``). ``extra_inputs``: the keyword inputs the family's ``forward`` accepts beyond the
    common ones, handed to the hooks as a dict.
    """

    extra_inputs: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig, stage: StageSpec):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size must be set before building the model")
        self.cfg = cfg
        self.pre_process, self.post_process = stage.pre_process, stage.post_process
        padded = stage.padded_vocab or cfg.padded_vocab(1)
        if self.pre_process or (self.post_process and self.tied):
            self.embedding = self.build_embedding(cfg, padded)
        self.layers = nn.ModuleDict({str(i): self.build_layer(cfg, i)
                                     for i in stage.layer_numbers})
        if self.post_process:
            self.build_output(cfg, padded)

    @property
    def tied(self) -> bool:
        """Whether the output layer is the word embedding (``--untie-embeddings-and-output-
        weights`` unset)."""
        return not self.cfg.untie_embeddings_and_output_weights

    # ---- what to build -------------------------------------------------------------------

    def build_embedding(self, cfg: ModelConfig, padded_vocab: int) -> nn.Module:
        """The ``embedding`` module: ``(ids [b, s], positions [s]) -> [s, b, h]``."""
        raise NotImplementedError

    def build_layer(self, cfg: ModelConfig, layer_number: int) -> nn.Module:
        """Layer ``layer_number`` (global index): ``(x [s, b, h], *layer_inputs) -> [s, b, h]``."""
        raise NotImplementedError

    def build_output(self, cfg: ModelConfig, padded_vocab: int) -> None:
        """The last chunk's modules: ``final_layernorm`` (``[s, b, h]``), ``output_layer``
        ``[Vp, h]`` when untied, ``head`` (:class:`LMHead`)."""
        self.final_layernorm = build_norm(cfg)
        if not self.tied:
            self.output_layer = nn.Linear(cfg.hidden_size, padded_vocab, bias=False)
        self.head = LMHead(cfg.softmax_vocab_size, logit_scale=cfg.logit_multiplier)

    # ---- how to run ----------------------------------------------------------------------

    def output_weight(self) -> torch.Tensor:
        """``[Vp, h]`` (``[Vp/t, h]`` under TP): the word embeddings when tied, else the output
        layer's weight."""
        return self.embedding.word_embeddings.weight if self.tied else self.output_layer.weight

    def default_positions(self, input_ids: Optional[torch.Tensor], cache) -> torch.Tensor:
        """``[s]``: ``0 .. s-1`` after the cached length; a chunk without ``input_ids`` (no
        embedding) must be given them."""
        if input_ids is None:
            raise ValueError("position_ids are needed by a chunk without the embedding")
        offset = cache.length if cache is not None else 0
        return torch.arange(offset, offset + input_ids.shape[1], device=input_ids.device)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
              extra: dict) -> torch.Tensor:
        """``input_ids [b, s] -> [s, b, h]``; the learned absolute positions read
        ``extra["document_position_ids"] [b, s]`` when given (``--reset-position-ids``)."""
        return self.embedding(input_ids, extra.get("document_position_ids", position_ids))

    def layer_inputs(self, position_ids: torch.Tensor, cache, extra: dict) -> tuple:
        """What every layer takes after ``x``; default ``(rope, positions, cache, moe)`` with
        ``rope`` the cos, sin ``[s, r]`` under ``--position-embedding-type rope`` (r = d, or
        ``--rotary-percent`` of it; with ``--rotary-interleaved`` the triple (cos, sin, True):
        pairs (2i, 2i + 1), :func:`~loom.models.attention.apply_rope`'s third argument; scaled
        by ``--use-rope-scaling`` / ``--rotary-seq-len-interpolation-factor``) or
        ``yarn`` (r = d: :func:`~loom.models.yarn.yarn_cos_sin` with ``ModelConfig.yarn_args``,
        Megatron-Core's ``YarnRotaryEmbedding`` of GPTModel), else None. ``positions``: the
        sequence positions ``[s]``, or with ``extra["document_starts"] [b, s]``
        (``--reset-attention-mask``) the :class:`~loom.models.attention.Documents` of both."""
        rope, c = None, self.cfg
        if c.position_embedding_type == "rope":
            rope = rope_cos_sin(position_ids, c.rotary_dim, c.rotary_base,
                                interleaved=c.rotary_interleaved, **c.rope_scaling_args())
            if c.rotary_interleaved:
                rope = (*rope, True)
        elif c.position_embedding_type == "yarn":
            rope = yarn_cos_sin(position_ids, c.head_dim, c.rotary_base, **c.yarn_args(),
                                round_to_int=c.yarn_correction_range_round_to_int)
        starts = extra.get("document_starts")
        positions = position_ids if starts is None else Documents(position_ids, starts)
        return rope, positions, cache, extra.get("moe")

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]``."""
        return self.final_layernorm(x)

    def output(self, x: torch.Tensor, labels: Optional[torch.Tensor], extra: dict):
        """Normalized ``x [s, b, h]`` -> the per-token loss ``[b, s]`` with ``labels``, else the
        logits ``[b, s, Vp]``."""
        return self.head(x, self.output_weight(), labels)

    def forward(self, input_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                hidden_states: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, cache=None, **extra):
        """First chunk: ``input_ids [b, s]``; later chunks: ``hidden_states [s, b, h]``.
        ``position_ids [s]``: global positions of these tokens (:meth:`default_positions`).
        ``cache``: generation's cache (``allocate_cache``); ``extra``: the family's
        ``extra_inputs``.

        Returns, on the last chunk, :meth:`output` (by default the per-token loss ``[b, s]``
        (fp32) when ``labels`` is given, else the logits ``[b, s, Vp]``); on other chunks the
        hidden states ``[s, b, h]``.
        """
        unknown = set(extra) - set(self.extra_inputs)
        if unknown:
            raise TypeError(f"{type(self).__name__}.forward got unexpected inputs "
                            f"{sorted(unknown)}")
        if position_ids is None:
            position_ids = self.default_positions(input_ids, cache)
        x = self.embed(input_ids, position_ids, extra) if self.pre_process else hidden_states
        inputs = self.layer_inputs(position_ids, cache, extra)
        for layer in self.layers.values():
            x = layer(x, *inputs)
        if not self.post_process:
            return x
        return self.output(self.final_norm(x), labels, extra)
