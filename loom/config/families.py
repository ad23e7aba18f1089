"""Checks of the model families' own flags (Gemma 3, Mamba-2, BERT), part of the one validation
pass (:func:`loom.config.validate.validate_config`): each raises ConfigError naming the flag and
a fix valid for the user's model: a flag of another family is dropped, a layout that does not
fit is changed in its parallel sizes, never by switching --model-type or changing the shape."""

from __future__ import annotations

from typing import Any

from loom.errors import ConfigError

# What each family-specific flag is, for the refusal when --model-type is another family.
GEMMA3_ONLY = (
    ("sliding_window", "Gemma 3's local attention window"),
    ("layer_types", "Gemma 3's local/global layer pattern"),
    ("query_pre_attn_scalar", "Gemma 3's attention scale"),
    ("attn_logit_softcapping", "Gemma 3's attention-score soft-capping"),
    ("final_logit_softcapping", "Gemma 3's output-logit soft-capping"),
)


def _other_family(name: str, what: str, model_type: str) -> ConfigError:
    """``--NAME is WHAT, which --model-type MODEL_TYPE does not have: drop --NAME``: the fix
    keeps the user's family (never "use --model-type X", which would make another model)."""
    f = "--" + name.replace("_", "-")
    return ConfigError(f"{f} is {what}, which --model-type {model_type} does not have: drop {f}")


def check_gemma3(m: Any) -> None:
    """--model-type gemma3 fixes the layout (RMSNorm (1 + w), RoPE, GeGLU, no biases, tied
    output): written into the config so checkpoints describe it. Its own flags with another
    --model-type are refused with "drop it" (``--rotary-scaling-factor``: Gemma 3's linear
    RoPE scaling there, YaRN's factor with ``--position-embedding-type yarn`` or MLA's
    ``--rope-type yarn`` elsewhere)."""
    if m.model_type != "gemma3":
        yarn = m.position_embedding_type == "yarn" or (m.multi_latent_attention and
                                                        m.effective_rope_type == "yarn")
        if m.rotary_scaling_factor is not None and not yarn:
            raise ConfigError(f"--rotary-scaling-factor: loom implements it as Gemma 3's "
                              f"linear RoPE scaling and as YaRN's factor (--position-embedding-"
                              f"type yarn, or --multi-latent-attention with --rope-type yarn); "
                              f"other scalings are not supported yet for --model-type "
                              f"{m.model_type}: drop --rotary-scaling-factor")
        for name, what in GEMMA3_ONLY:
            if getattr(m, name) is not None:
                raise _other_family(name, what, m.model_type)
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


HYBRID_SYMBOLS = {"G": "Gated DeltaNet layers (G)", "D": "DeepSeek sparse-attention layers (D)",
                  "+": "multi-latent-attention layers (+)", "E": "MoE layers (E)",
                  "/": "multi-token-prediction layers (/)"}
"""Symbols of Megatron's hybrid patterns loom's Mamba stack does not build (it builds M, *, -)."""


def resolve_hybrid_pattern(m: Any, p: Any) -> None:
    """Megatron's ``--hybrid-override-pattern`` / ``--hybrid-layer-pattern`` (``m``: model,
    ``p``: parallel section, changed in place): the pattern sets the depth (a different
    ``--num-layers`` is ignored, as Megatron ignores it; said at start), and ``|`` splits it
    into pipeline segments: ``p`` segments of equal length are loom's even split, unequal
    first/last ones set ``--decoder-first/last-pipeline-num-layers``, ``v x p`` equal segments
    set ``--num-layers-per-virtual-pipeline-stage``. Raises ConfigError (Megatron's rules, or a
    layout loom's pipeline does not have)."""
    pat = m.hybrid_override_pattern
    if m.model_type != "mamba" or pat is None:
        return
    missing = [what for sym, what in HYBRID_SYMBOLS.items() if sym in pat]
    if missing:
        raise ConfigError(f"--hybrid-override-pattern {pat!r}: loom's hybrid stack has no "
                          f"{', '.join(missing)}; it builds M (Mamba), * (attention), - (MLP)")
    segments = pat.split("|")
    m.hybrid_override_pattern = "".join(segments)
    m.num_layers = len(m.hybrid_override_pattern)
    if len(segments) == 1:
        return
    pp, lengths = p.pipeline_model_parallel_size, [len(s) for s in segments]
    if len(segments) % pp:
        raise ConfigError(f"--hybrid-override-pattern {pat!r} has {len(segments)} pipeline "
                          f"segments (|), not a multiple of --pipeline-model-parallel-size {pp}")
    if p.decoder_first_pipeline_num_layers or p.decoder_last_pipeline_num_layers or \
            p.num_layers_per_virtual_pipeline_stage:
        raise ConfigError("--hybrid-override-pattern with | sets the pipeline layout: drop "
                          "--decoder-first/last-pipeline-num-layers and "
                          "--num-layers-per-virtual-pipeline-stage (Megatron's rule)")
    if len(set(lengths)) == 1:
        if len(segments) > pp:
            p.num_layers_per_virtual_pipeline_stage = lengths[0]
        return
    if len(segments) == pp and len(set(lengths[1:-1])) <= 1:
        p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers = \
            lengths[0], lengths[-1]
        return
    raise ConfigError(f"--hybrid-override-pattern {pat!r}: pipeline segments of {lengths} layers; "
                      f"loom's stages hold equal numbers of layers but the first and the last "
                      f"(and equal model chunks when interleaved)")


def check_mamba(m: Any, tp: int, cp: int) -> None:
    """Mamba-2 / hybrid stacks: the layer pattern, SSM heads and groups against the shape and
    the tensor-parallel size ``tp`` (a fix changes ``tp``) and the context-parallel size
    ``cp`` (heads divisible by ``tp cp``; groups per TP rank divisible by ``cp`` or dividing it:
    :mod:`loom.parallel.context.mamba`)."""
    if m.hybrid_override_pattern is not None and m.model_type != "mamba":
        raise _other_family("hybrid_override_pattern", "the layer kinds of a Mamba hybrid stack",
                            m.model_type)
    if m.model_type != "mamba":
        return
    pat = m.hybrid_override_pattern or "M" * m.num_layers
    d_inner, hd, ng = m.mamba_d_inner, m.mamba_head_dim, m.mamba_num_groups
    width = ("--mamba-num-heads x --mamba-head-dim" if m.mamba_num_heads is not None
             else "--mamba-expand x --hidden-size")
    if len(pat) != m.num_layers or set(pat) - set("M*-"):
        raise ConfigError(f"--hybrid-override-pattern {pat!r} must have --num-layers "
                          f"{m.num_layers} characters of M (Mamba), * (attention), - (MLP)")
    if d_inner % hd or (d_inner // hd) % ng:
        raise ConfigError(f"Mamba: {width} = {d_inner} must split into heads of "
                          f"--mamba-head-dim {hd}, a multiple of --mamba-num-groups {ng}")
    heads = d_inner // hd  # a multiple of ng (checked above): a fitting tp divides ng
    fix = (f"use a --tensor-model-parallel-size dividing --mamba-num-groups {ng} "
           f"({', '.join(str(d) for d in range(1, ng + 1) if ng % d == 0)})")
    if "M" in pat and heads % tp:
        raise ConfigError(f"{heads} Mamba heads ({width} / --mamba-head-dim) not divisible "
                          f"by --tensor-model-parallel-size {tp}: {fix}")
    if "M" in pat and ng % tp:
        raise ConfigError(f"--mamba-num-groups {ng} is not divisible by "
                          f"--tensor-model-parallel-size {tp}: {fix}")
    g_t = ng // tp  # CP: each rank scans H/(t c) heads of the whole sequence (Megatron's rules)
    if "M" in pat and cp > 1 and (heads % (tp * cp) or (g_t % cp and cp % g_t)):
        raise ConfigError(f"--context-parallel-size {cp} with Mamba layers: {heads} heads must "
                          f"be divisible by --tensor-model-parallel-size x "
                          f"--context-parallel-size = {tp * cp}, and {g_t} groups per TP rank "
                          f"(--mamba-num-groups / TP) divisible by {cp} or dividing it")


def check_bert(m: Any, cp: int) -> None:
    """BERT: bidirectional, learned positions, tied output, no context parallelism."""
    if m.model_type != "bert":
        for name, what in (("bert_binary_head", "BERT's sentence-order head"),
                           ("post_layernorm", "BERT's post-LN layer order")):
            if getattr(m, name):
                raise _other_family(name, what, m.model_type)
        return
    if cp > 1:
        raise ConfigError("--context-parallel-size > 1 is not supported with --model-type bert "
                          "(the padding mask and the [CLS] pooler would need the sequence "
                          "gathered over CP): use 1, and TP/SP/PP/DP to scale")
    if m.num_experts:
        raise ConfigError("--num-experts: --model-type bert has dense MLPs only: drop "
                          "--num-experts")
    if m.position_embedding_type != "learned_absolute":
        raise ConfigError(f"--position-embedding-type {m.position_embedding_type}: BERT uses "
                          f"learned_absolute positions: drop --position-embedding-type")
    if m.untie_embeddings_and_output_weights:
        raise ConfigError("--untie-embeddings-and-output-weights: BERT's masked-LM output is "
                          "tied to the word embeddings: drop the flag")
    least = 5 if m.bert_binary_head else 3
    if m.seq_length < least:
        raise ConfigError(f"--seq-length {m.seq_length}: a BERT sample needs at least {least} "
                          f"positions ([CLS] A [SEP]{' B [SEP]' if m.bert_binary_head else ''}): "
                          f"use --seq-length {least} or more")
