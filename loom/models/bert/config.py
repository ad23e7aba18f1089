"""BERT's config rules (its ``check`` and ``refuse_own_flags`` hooks, :mod:`loom.models.family`):
bidirectional, learned positions, tied output, no context parallelism; its own flags refused
in another family's config. Its fields are declared in
:mod:`loom.config.model_bert`."""

from __future__ import annotations

from typing import Any

from loom.errors import ConfigError
from loom.models.family import other_family_flag, transformer_layers

layer_kinds = transformer_layers  # what the planner prices: transformer layers


def refuse_own_flags(m: Any) -> None:
    """``--bert-binary-head`` / ``--post-layernorm`` in another family's model config ``m``:
    "drop it"."""
    for name, what in (("bert_binary_head", "BERT's sentence-order head"),
                       ("post_layernorm", "BERT's post-LN layer order")):
        if getattr(m, name):
            raise other_family_flag(name, what, m.model_type)


def cp_refusal(model_cfg: Any) -> str:
    """Why BERT runs no context parallelism (the planner asks this through
    ``FamilyRegistry.cp_refusal``; :func:`check` refuses the flag with it)."""
    return ("--model-type bert (the padding mask and the [CLS] pooler would need the sequence "
            "gathered over CP)")


def check(cfg: Any, world_size: int) -> None:
    """BERT's rules on ``cfg`` (a LoomConfig being validated): no CP, dense MLPs, learned
    positions, a tied output, room for [CLS] A [SEP] (B [SEP]), no fill-in-the-middle."""
    m = cfg.model
    if cfg.parallel.context_parallel_size > 1:
        raise ConfigError(f"--context-parallel-size > 1 is not supported with "
                          f"{cp_refusal(m)}: use 1, and TP/SP/PP/DP to scale")
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
    if cfg.data.fim_data:
        raise ConfigError("--fim-data with --model-type bert: fill-in-the-middle reorders "
                          "next-token samples (Megatron's GPT dataset); BERT masks tokens instead")
