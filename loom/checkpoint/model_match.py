"""Strict loading: a checkpoint loads only into the model it was trained as.

Weights reshard across layouts (TP, PP, DP, EP), and only the vocabulary padding may differ
(re-padded exactly); every other architecture flag must agree with the checkpoint's stored
config, otherwise loading is refused before any weight is read, naming each flag that differs
(a checkpoint of hidden 256 never loads into a model of hidden 128, 6 layers never silently
into 4). Torch-free.
"""

from __future__ import annotations

import dataclasses

from loom.config import ModelConfig
from loom.errors import ConfigError

# Model fields that change neither a parameter's shape nor the function the weights compute.
NOT_ARCHITECTURE = frozenset({
    "hidden_dropout", "attention_dropout", "init_method_std", "make_vocab_size_divisible_by",
    "seq_length", "max_position_embeddings", "group_query_attention", "moe_aux_loss_coeff",
    "moe_z_loss_coeff", "moe_expert_capacity_factor", "mamba_chunk_size",
    "exclude_padded_vocab",  # the loss's softmax columns, not the weights (issue 42)
    "embedding_init_method_std", "init_method_xavier_uniform",  # the initial weights only
    "fp32_residual_connection"})  # the residual stream's precision, not the function


def model_differences(saved: dict, model: ModelConfig, family) -> list[str]:
    """``--flag saved vs requested`` for every architecture flag of ``model`` that differs from
    the checkpoint's flat config ``saved`` (fields it lacks take their defaults), then the
    family's own shape facts (``family.checkpoint_differences``, a
    :class:`~loom.models.family.ModelFamily`: e.g. GPT's learned position table)."""
    out = []
    for f in dataclasses.fields(ModelConfig):
        if f.name in NOT_ARCHITECTURE:
            continue
        want = getattr(model, f.name)
        have = saved.get(f.name, f.default)
        if have != want:
            out.append(f"--{f.name.replace('_', '-')} {have} in the checkpoint, {want} here")
    return out + list(family.checkpoint_differences(saved, model))


def check_same_model(saved: dict, model: ModelConfig, ckpt_dir: str, family) -> None:
    """Raise ConfigError naming every architecture flag that differs from the checkpoint (and
    every shape fact of ``family``'s, see :func:`model_differences`)."""
    diff = model_differences(saved, model, family)
    if diff:
        raise ConfigError(f"--load: the checkpoint {ckpt_dir} holds another model: "
                          + "; ".join(diff) + ". Give the checkpoint's values (or train "
                          "without --load)")
