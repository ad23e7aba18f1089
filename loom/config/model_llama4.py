"""Llama 4's attention, beyond Megatron-Core's: the fields of :class:`Llama4AttentionFields` (a
mixin of ModelConfig; loom's own flags, as no Megatron-LM parser has them) and their rules
(:func:`check_llama4_attention`). Llama 4 (Meta 2025; ``transformers.models.llama4``,
``Llama4TextAttention``) interleaves RoPE layers with NoPE layers (``--no-rope-freq``, "iRoPE"):

- ``--qk-l2-norm-rope-layers-only``: ``--qk-l2-norm`` (each query and key head scaled to unit
  mean square) in the RoPE layers only; Megatron-Core's ``--qk-l2-norm`` normalizes every
  layer, Megatron-Bridge's Llama 4 layer spec the RoPE layers only, as Meta's model does.
- ``--attention-chunk-size C``: the RoPE layers attend within chunks of C positions: the query
  at position i sees the keys j <= i with ``j // C == i // C`` (transformers'
  ``create_chunked_causal_mask``); the NoPE layers attend over the whole sequence.
- ``--attn-temperature-floor-scale F`` (with ``--attn-temperature-scale a``, default 0.1): the
  NoPE layers multiply the query at position i by ``log(floor((i + 1) / F) + 1) a + 1``
  (Llama 4's attention temperature tuning, Nakanishi 2025, "Scalable-Softmax Is Superior for
  Attention"), which is 1 before position F - 1.

Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from loom.config.fields import opt
from loom.errors import ConfigError


@dataclass
class Llama4AttentionFields:
    """The flags of the module docstring; a mixin of ModelConfig (all off by default)."""

    qk_l2_norm_rope_layers_only: bool = opt(
        False, "with --qk-l2-norm and --no-rope-freq: normalize queries and keys in the RoPE "
               "layers only, as Llama 4 does (Megatron-Core's --qk-l2-norm: every layer; "
               "loom's own flag; gpt family)")
    attention_chunk_size: Optional[int] = opt(
        None, "the RoPE layers attend within chunks of this many positions (the query at i "
              "sees keys j <= i with j // C == i // C: Llama 4's chunked attention); the NoPE "
              "layers (--no-rope-freq) over the whole sequence (loom's own flag; gpt family)",
        gt=0)
    attn_temperature_floor_scale: Optional[int] = opt(
        None, "Llama 4's attention temperature tuning: the NoPE layers (--no-rope-freq) scale "
              "the query at position i by log(floor((i + 1) / F) + 1) x "
              "--attn-temperature-scale + 1 (loom's own flag; gpt family)", gt=0)
    attn_temperature_scale: float = opt(
        0.1, "with --attn-temperature-floor-scale: the temperature's slope a (Llama 4's "
             "attn_scale)", gt=0)

    def is_chunked_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (0-based) attends within chunks: a RoPE layer
        under ``--attention-chunk-size``."""
        return self.attention_chunk_size is not None and \
            not self.is_no_rope_layer(layer_number)

    def is_temperature_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (0-based) scales its queries by position: a
        NoPE layer under ``--attn-temperature-floor-scale``."""
        return self.attn_temperature_floor_scale is not None and \
            self.is_no_rope_layer(layer_number)


LLAMA4_FLAGS = (("qk_l2_norm_rope_layers_only", "Llama 4's QK norm in the RoPE layers only"),
                ("attention_chunk_size", "Llama 4's chunked attention"),
                ("attn_temperature_floor_scale", "Llama 4's attention temperature tuning"))
"""The gpt family's own (``(field, what)``): refused in another family's config."""


def check_llama4_attention(cfg: Any) -> None:
    """Refuse what loom does not build with these flags (``cfg``: the LoomConfig being
    validated): the QK-norm restriction without ``--qk-l2-norm`` and NoPE layers; the
    temperature without NoPE layers; chunks or the temperature with multi-latent or DeepSeek
    sparse attention, a sliding window or attention sinks (another core), or with context
    parallelism beyond one chunk (its ring does not mask by chunk). Raises a one-line
    ConfigError."""
    m, p = cfg.model, cfg.parallel
    nope = m.no_rope_freq is not None and any(m.is_no_rope_layer(i)
                                              for i in range(m.num_layers or 0))
    if m.qk_l2_norm_rope_layers_only and not (m.qk_l2_norm and nope):
        raise ConfigError("--qk-l2-norm-rope-layers-only restricts --qk-l2-norm to the RoPE "
                          "layers: give --qk-l2-norm and NoPE layers (--no-rope-freq), or drop "
                          "it")
    if m.attn_temperature_floor_scale is not None and not nope:
        raise ConfigError("--attn-temperature-floor-scale tunes the NoPE layers' queries: this "
                          "model has none (give --no-rope-freq, or drop it)")
    chunked = m.attention_chunk_size is not None
    if not (chunked or m.attn_temperature_floor_scale is not None):
        return
    for on, what in ((m.multi_latent_attention, "--multi-latent-attention"),
                     (m.dsa, "--experimental-attention-variant dsa"),
                     (m.window is not None, "--window-size"),
                     (m.softmax_type != "vanilla", f"--softmax-type {m.softmax_type}")):
        if on:
            raise ConfigError(f"--attention-chunk-size / --attn-temperature-floor-scale are "
                              f"Llama 4's standard attention: not with {what}")
    if chunked and p.context_parallel_size > 1 and m.seq_length > m.attention_chunk_size:
        raise ConfigError(f"--attention-chunk-size {m.attention_chunk_size} with "
                          f"--context-parallel-size {p.context_parallel_size}: loom's context "
                          f"parallelism does not mask by chunk; use --context-parallel-size 1 "
                          f"or --seq-length at most {m.attention_chunk_size}")
