"""Qwen3-Next's attention fields of :class:`~loom.config.sections.ModelConfig`: the gated
attention output and Gated DeltaNet linear-attention layers (Megatron-LM's flag names, meanings
and defaults: ``TransformerConfig.attention_output_gate``, ``experimental_attention_variant``,
``linear_*`` and ``arguments.py``'s ``--linear-attention-freq``), and their checks
(:func:`check_gdn`, part of the one validation pass).

- ``--attention-output-gate``: the standard attention layers also project a gate of a d
  values per head and multiply ``sigmoid(gate)`` into the attention output before the output
  projection (Qiu et al. 2025, "Gated Attention for Large Language Models"; Qwen3-Next).
- ``--experimental-attention-variant gated_delta_net`` (Megatron's deprecated spelling of
  ``gdn``) with ``--linear-attention-freq N``: of every N layers, the first N - 1 are Gated
  DeltaNet layers (Yang, Kautz, Hatamizadeh 2024) and the N-th standard attention
  (Megatron's ``get_linear_attention_pattern``), or a list such as ``([1]*3+[0])*2`` with 1 for
  a Gated DeltaNet layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from loom.config.fields import opt
from loom.config.model_dsa import check_dsa
from loom.config.model_moe import parse_moe_layer_freq
from loom.errors import ConfigError

AttentionVariant = Literal["gdn", "gdn2", "dsa", "gated_delta_net"]


@dataclass
class GatedDeltaNetFields:
    """Output-gate and Gated DeltaNet flags; a mixin of ModelConfig (off by default)."""

    attention_output_gate: bool = opt(False, "gate the attention output: sigmoid of a "
                                             "per-head projection of the layer input, times "
                                             "the attention output before the output "
                                             "projection (Qwen3-Next)")
    experimental_attention_variant: Optional[AttentionVariant] = opt(
        None, "gdn (or gated_delta_net): Gated DeltaNet linear-attention layers, placed by "
              "--linear-attention-freq; dsa: DeepSeek sparse attention on MLA layers")
    linear_attention_freq: Optional[str] = opt(
        None, "which layers are Gated DeltaNet: an int N (of every N layers the first N - 1; "
              "the N-th is standard attention), or a list such as ([1]*3+[0])*2 (1: Gated "
              "DeltaNet)")
    linear_conv_kernel_dim: int = opt(4, "Gated DeltaNet: width of the causal depthwise "
                                         "convolution over queries, keys and values", ge=1)
    linear_key_head_dim: int = opt(128, "Gated DeltaNet: query and key head dimension", ge=1)
    linear_value_head_dim: int = opt(128, "Gated DeltaNet: value and gate head dimension", ge=1)
    linear_num_key_heads: int = opt(16, "Gated DeltaNet: query and key heads", ge=1)
    linear_num_value_heads: int = opt(32, "Gated DeltaNet: value heads (a multiple of the key "
                                          "heads; each key head serves consecutive ones)", ge=1)
    apply_wd_to_qk_layernorm: bool = opt(False, "weight decay on the query / key norms' "
                                                "parameters too (Qwen3-Next; Megatron-Core's "
                                                "rule; other norms and biases stay undecayed)")

    @property
    def gated_delta_net(self) -> bool:
        """Whether some layers are Gated DeltaNet layers."""
        return self.experimental_attention_variant in ("gdn", "gated_delta_net")

    def is_gdn_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (0-based) is a Gated DeltaNet layer (Megatron's
        ``get_linear_attention_pattern``: an int N makes layer i standard attention when
        (i + 1) % N == 0)."""
        if not self.gated_delta_net:
            return False
        text = str(self.linear_attention_freq).strip()
        if "[" not in text:
            return (layer_number + 1) % int(text) != 0
        return bool(parse_moe_layer_freq(text, self.num_layers,
                                         "--linear-attention-freq")[layer_number])


def check_gdn(m: Any, tp: int, cp: int) -> None:
    """Refuse output-gate / Gated DeltaNet flags that do not fit (``tp``, ``cp``: the parallel
    sizes): Megatron's own rules (a layer pattern is needed, value heads a multiple of key
    heads, both divisible by t x c; no gate with MLA; SiLU), and what loom lacks (GDN2, GDN
    under context parallelism, with MTP or in another family). Raises ConfigError naming the
    flag and a fix."""
    if m.apply_wd_to_qk_layernorm and m.qk_layernorm and m.apply_layernorm_1p:
        raise ConfigError("--apply-wd-to-qk-layernorm with --apply-layernorm-1p: Megatron "
                          "decays each norm's w toward 0 (its gain toward 1); loom's norms hold "
                          "the gain 1 + w, which AdamW's decay would pull toward 0: drop one of "
                          "them")
    if m.attention_output_gate and m.multi_latent_attention:
        raise ConfigError("--attention-output-gate gates standard attention (Megatron has no "
                          "gate for MLA either): drop it or --multi-latent-attention")
    variant = m.experimental_attention_variant
    if variant == "gdn2":
        raise ConfigError("--experimental-attention-variant gdn2: loom has no Gated "
                          "DeltaNet-2 (channel-wise decay): use gdn")
    check_dsa(m, cp)
    if not m.gated_delta_net:
        if m.linear_attention_freq is not None:
            raise ConfigError("--linear-attention-freq places Gated DeltaNet layers: add "
                              "--experimental-attention-variant gdn or drop it")
        return
    if m.linear_attention_freq is None:  # another family: loom.models.gpt.config refuses it
        raise ConfigError(f"--experimental-attention-variant {variant} needs "
                          f"--linear-attention-freq (which layers are Gated DeltaNet), e.g. 4")
    text = str(m.linear_attention_freq).strip()
    if "[" in text:
        parse_moe_layer_freq(text, m.num_layers, "--linear-attention-freq")
    elif not text.isdigit() or int(text) < 1:
        raise ConfigError(f"--linear-attention-freq {text!r}: give an int N >= 1 or a list "
                          f"such as '([1]*3+[0])*{max(m.num_layers // 4, 1)}'")
    if m.multi_latent_attention:
        raise ConfigError("--experimental-attention-variant gdn with --multi-latent-attention: "
                          "loom's Gated DeltaNet stacks use standard attention layers")
    if not m.swiglu:
        raise ConfigError("Gated DeltaNet layers take SiLU from --swiglu (Megatron's kernels "
                          "assert it): add --swiglu")
    if m.mtp_num_layers:
        raise ConfigError("--mtp-num-layers with Gated DeltaNet layers: loom's multi-token "
                          "prediction layers are attention layers; drop --mtp-num-layers")
    nk, nv = m.linear_num_key_heads, m.linear_num_value_heads
    if nv % nk:
        raise ConfigError(f"--linear-num-value-heads {nv} must be a multiple of "
                          f"--linear-num-key-heads {nk}")
    for flag, n in (("--linear-num-key-heads", nk), ("--linear-num-value-heads", nv)):
        if n % tp:
            raise ConfigError(f"{flag} {n} must be a multiple of --tensor-model-parallel-size "
                              f"{tp} (the heads split over TP)")
    if cp > 1:
        raise ConfigError("--context-parallel-size > 1 with Gated DeltaNet layers: loom has no "
                          "context-parallel delta rule; use --context-parallel-size 1")
