"""Mamba-2 / hybrid stacks' config rules (the family's ``check``, ``refuse_own_flags`` and
``layer_kinds`` hooks, :mod:`loom.models.family`): the layer pattern, SSM heads and groups
against the shape and the tensor-parallel size, no context parallelism. Its fields
are declared in :mod:`loom.config.model_mamba` (``--hybrid-override-pattern``'s depth and
pipeline segments are Megatron's rules of the flag: :mod:`loom.config.hybrid_pattern`)."""

from __future__ import annotations

from typing import Any

from loom.errors import ConfigError
from loom.models.family import other_family_flag

HYBRID_SYMBOLS = {"G": "Gated DeltaNet layers (G)", "D": "DeepSeek sparse-attention layers (D)",
                  "+": "multi-latent-attention layers (+)", "E": "MoE layers (E)",
                  "/": "multi-token-prediction layers (/)"}
"""Symbols of Megatron's hybrid patterns loom's Mamba stack does not build (it builds M, *, -)."""


def layer_kinds(m: Any) -> str:
    """One character per layer: ``M`` Mamba-2 mixer, ``*`` attention, ``-`` MLP
    (``--hybrid-override-pattern``, all ``M`` by default)."""
    return m.hybrid_override_pattern or "M" * m.num_layers


def refuse_own_flags(m: Any) -> None:
    """``--hybrid-override-pattern`` (or earlier releases' ``--hybrid-attention-ratio`` /
    ``--hybrid-mlp-ratio``) in another family's model config ``m``: "drop it"."""
    for name in ("hybrid_attention_ratio", "hybrid_mlp_ratio"):
        if getattr(m, name):
            raise other_family_flag(name, "a share of the layer kinds of a Mamba hybrid stack",
                                    m.model_type)
    if m.hybrid_override_pattern is not None:
        raise other_family_flag("hybrid_override_pattern",
                                "the layer kinds of a Mamba hybrid stack", m.model_type)


def check(cfg: Any, world_size: int) -> None:
    """The pattern's symbols and length, the SSM heads and groups against the shape and TP (a
    fix changes TP) and CP; no ``--use-rope-scaling`` (Megatron's MambaModel has none)."""
    m, tp, cp = (cfg.model, cfg.parallel.tensor_model_parallel_size,
                 cfg.parallel.context_parallel_size)
    pat = m.hybrid_override_pattern
    missing = [what for sym, what in HYBRID_SYMBOLS.items() if pat and sym in pat]
    if missing:
        raise ConfigError(f"--hybrid-override-pattern {pat!r}: loom's hybrid stack has no "
                          f"{', '.join(missing)}; it builds M (Mamba), * (attention), - (MLP)")
    if m.use_rope_scaling:
        raise ConfigError("--use-rope-scaling with --model-type mamba: Megatron's hybrid model "
                          "builds its RoPE without Llama 3.1's scaling (MambaModel takes none): "
                          "drop --use-rope-scaling")
    check_heads(m, tp, cp)


def check_heads(m: Any, tp: int, cp: int) -> None:
    """The pattern, SSM heads and groups of model config ``m`` against the shape and the
    tensor-parallel size ``tp`` (a fix changes ``tp``) and the context-parallel size ``cp``
    (heads divisible by ``tp cp``; groups per TP rank divisible by ``cp`` or dividing it:
    :mod:`loom.parallel.context.mamba`); also a checkpoint's model at another layout
    (``loom evaluate``)."""
    pat = layer_kinds(m)
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
