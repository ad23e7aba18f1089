"""Checks of the model families' own flags (Gemma 3, Mamba-2, BERT), part of the one validation
pass (:func:`loom.config.validate.validate_config`): each raises ConfigError naming the flag and
the fix."""

from __future__ import annotations

from typing import Any

from loom.errors import ConfigError


def check_gemma3(m: Any) -> None:
    """--model-type gemma3 fixes the layout (RMSNorm (1 + w), RoPE, GeGLU, no biases, tied
    output): written into the config so checkpoints describe it; its flags need it."""
    named = [f for f in ("sliding_window", "layer_types", "rotary_scaling_factor",
                         "query_pre_attn_scalar", "attn_logit_softcapping",
                         "final_logit_softcapping") if getattr(m, f) is not None]
    if m.model_type != "gemma3":
        if named:
            raise ConfigError(f"--{named[0].replace('_', '-')} needs --model-type gemma3")
        return
    for bad, flag in ((m.num_experts, "--num-experts"), (m.swiglu, "--swiglu"),
                      (m.untie_embeddings_and_output_weights,
                       "--untie-embeddings-and-output-weights"), (m.add_qkv_bias, "--add-qkv-bias")):
        if bad:
            raise ConfigError(f"{flag}: --model-type gemma3 has a fixed layout (GeGLU MLP, tied "
                              f"output, no biases): drop {flag}")
    kinds = m.attention_layer_types
    if len(kinds) != m.num_layers or set(kinds) - set("LG"):
        raise ConfigError(f"--layer-types {kinds!r} must have --num-layers {m.num_layers} "
                          f"characters of L (local, sliding window) and G (global)")
    m.normalization, m.position_embedding_type, m.disable_bias_linear = "RMSNorm", "rope", True


def check_mamba(m: Any, tp: int, cp: int) -> None:
    if m.hybrid_override_pattern is not None and m.model_type != "mamba":
        raise ConfigError("--hybrid-override-pattern needs --model-type mamba")
    if m.model_type != "mamba":
        return
    pat = m.hybrid_override_pattern or "M" * m.num_layers
    d_inner, hd, ng = m.mamba_expand * m.hidden_size, m.mamba_head_dim, m.mamba_num_groups
    if len(pat) != m.num_layers or set(pat) - set("M*-"):
        raise ConfigError(f"--hybrid-override-pattern {pat!r} must have --num-layers "
                          f"{m.num_layers} characters of M (Mamba), * (attention), - (MLP)")
    if d_inner % hd or (d_inner // hd) % ng:
        raise ConfigError(f"Mamba: --mamba-expand x --hidden-size = {d_inner} must split into "
                          f"heads of --mamba-head-dim {hd}, a multiple of --mamba-num-groups {ng}")
    if "M" in pat and (d_inner // hd) % tp:
        raise ConfigError(f"{d_inner // hd} Mamba heads (--mamba-expand x --hidden-size / "
                          f"--mamba-head-dim) not divisible by --tensor-model-parallel-size {tp}")
    if "M" in pat and ng % tp:
        raise ConfigError(f"--mamba-num-groups {ng} is not divisible by "
                          f"--tensor-model-parallel-size {tp}: choose G a multiple of t")
    if "M" in pat and cp > 1:
        raise ConfigError("--context-parallel-size > 1 is not supported with Mamba layers "
                          "(the scan would need the state passed between CP ranks): use 1")


def check_bert(m: Any, cp: int) -> None:
    """BERT: bidirectional, learned positions, tied output, no context parallelism."""
    if m.model_type != "bert":
        for name in ("bert_binary_head", "post_layernorm"):
            if getattr(m, name):
                raise ConfigError(f"--{name.replace('_', '-')} needs --model-type bert")
        return
    if cp > 1:
        raise ConfigError("--context-parallel-size > 1 is not supported with --model-type bert "
                          "(the padding mask and the [CLS] pooler would need the sequence "
                          "gathered over CP): use 1, and TP/SP/PP/DP to scale")
    if m.num_experts:
        raise ConfigError("--num-experts: --model-type bert has dense MLPs only")
    if m.position_embedding_type != "learned_absolute":
        raise ConfigError("--position-embedding-type: BERT uses learned_absolute positions")
    if m.untie_embeddings_and_output_weights:
        raise ConfigError("--untie-embeddings-and-output-weights: BERT's masked-LM output is "
                          "tied to the word embeddings")
    least = 5 if m.bert_binary_head else 3
    if m.seq_length < least:
        raise ConfigError(f"--seq-length {m.seq_length}: a BERT sample needs at least {least} "
                          f"positions ([CLS] A [SEP]{' B [SEP]' if m.bert_binary_head else ''})")
