"""Gemma 3's config rules (its ``check`` and ``refuse_own_flags`` hooks, :mod:`loom.models.family`):
the fixed layout written into the config, the local/global layer pattern, and its own flags
refused in another family's config. Its fields are declared in
:mod:`loom.config.model_gemma3` (Megatron's flag surface is one, as in Megatron)."""

from __future__ import annotations

from typing import Any

from loom.errors import ConfigError
from loom.models.family import LayerShape, other_family_flag, transformer_layers

layer_kinds = transformer_layers  # what the planner prices: transformer layers


def layer_shape(m: Any) -> LayerShape:
    """What the planner prices of a Gemma layer: its GeGLU MLP (gated, always), four norms
    (two without ``--no-gemma-post-norms``'s post-norms: Gemma 1) and the QK norms unless
    ``--no-gemma-qk-norm``."""
    return LayerShape(True, 4 if m.gemma_post_norms else 2, bool(m.gemma_qk_norm))

# What each family-specific flag is, for the refusal when --model-type is another family.
GEMMA3_ONLY = (
    ("sliding_window", "Gemma 3's local attention window"),
    ("layer_types", "Gemma 3's local/global layer pattern"),
    ("query_pre_attn_scalar", "Gemma 3's attention scale"),
    ("attn_logit_softcapping", "Gemma 3's attention-score soft-capping"),
    ("final_logit_softcapping", "Gemma 3's output-logit soft-capping"),
)


def refuse_own_flags(m: Any) -> None:
    """Gemma 3's own flags in another family's model config ``m`` are refused with "drop it"
    (``--rotary-scaling-factor``: Gemma 3's linear RoPE scaling here, YaRN's factor with
    ``--position-embedding-type yarn`` or MLA's ``--rope-type yarn`` elsewhere; without YaRN
    or MLA Megatron-LM ignores it, as the GPT family's check does: refused here is MLA without
    YaRN, whose softmax scale Megatron takes from it)."""
    yarn = m.position_embedding_type == "yarn" or (m.multi_latent_attention and
                                                    m.effective_rope_type == "yarn")
    if m.rotary_scaling_factor is not None and m.multi_latent_attention and not yarn:
        raise ConfigError(f"--rotary-scaling-factor: loom implements it as Gemma 3's "
                          f"linear RoPE scaling and as YaRN's factor (--position-embedding-"
                          f"type yarn, or --multi-latent-attention with --rope-type yarn); "
                          f"other scalings are not supported yet for --model-type "
                          f"{m.model_type}: drop --rotary-scaling-factor")
    for name, what in GEMMA3_ONLY:
        if getattr(m, name) is not None:
            raise other_family_flag(name, what, m.model_type)
    if not m.gemma_qk_norm:
        raise other_family_flag("no_gemma_qk_norm", "Gemma 2's layers without QK norm",
                                m.model_type)
    if not m.gemma_post_norms:
        raise other_family_flag("no_gemma_post_norms", "Gemma 1's layers without post-norms",
                                m.model_type)


def check(cfg: Any, world_size: int) -> None:
    """--model-type gemma3 fixes the layout (RMSNorm (1 + w), RoPE, GeGLU, no biases, tied
    output, RoPE rotating halves, its own RoPE scaling): written into the config so
    checkpoints describe it; ``--layer-types`` has one L or G per layer."""
    m = cfg.model
    for bad, flag in ((m.num_experts, "--num-experts"), (m.swiglu, "--swiglu"),
                      (m.untie_embeddings_and_output_weights,
                       "--untie-embeddings-and-output-weights"), (m.add_qkv_bias, "--add-qkv-bias")):
        if bad:
            raise ConfigError(f"{flag}: --model-type gemma3 has a fixed layout (GeGLU MLP, tied "
                              f"output, no biases): drop {flag}")
    if m.rotary_interleaved:
        raise ConfigError("--rotary-interleaved: --model-type gemma3 has Gemma 3's RoPE, "
                          "which rotates halves: drop --rotary-interleaved")
    for on, flag in ((m.use_rope_scaling, "--use-rope-scaling"),
                     (m.rotary_seq_len_interpolation_factor, "--rotary-seq-len-interpolation-"
                                                             "factor"),
                     (m.no_rope_freq, "--no-rope-freq")):
        if on is not None and on is not False:
            raise ConfigError(f"{flag}: --model-type gemma3 has Gemma 3's own RoPE (local and "
                              f"global bases; --rotary-scaling-factor scales the global one): "
                              f"drop {flag}")
    kinds = m.attention_layer_types
    if len(kinds) != m.num_layers or set(kinds) - set("LG"):
        raise ConfigError(f"--layer-types {kinds!r} must have --num-layers {m.num_layers} "
                          f"characters of L (local, sliding window) and G (global)")
    m.normalization, m.position_embedding_type, m.disable_bias_linear = "RMSNorm", "rope", True
