"""How the GPT / LLaMA model is parallelized: its plan and its initializers.

Tensor parallelism (Shoeybi et al. 2019, sec. 3): QKV and FC1 column-parallel (the fused
``(a d, g d, g d)`` and ``(f, f)`` blocks each split over TP, so every rank holds a/t heads and
g/t groups), the output projection and FC2 row-parallel: exactly 2 all-reduces forward and 2
backward per layer. The vocabulary is split in the embedding and in the output layer + loss.
Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2): norms and dropout on ``[s/t, b, h]``.
Context parallelism: the attention core gathers keys and values over CP.
"""

from __future__ import annotations

from typing import Callable

from loom.config import ModelConfig
from loom.models.family import StageSpec
from loom.models.init import (by_pattern, normal_init, ones_init, scaled_normal_init,
                              vocab_padded_init, zeros_init)
from loom.models.moe import run_experts
from loom.parallel.expert import MoEParallel
from loom.parallel.plan import (ColumnParallelLinear, ContextParallelCore, PartitionedRNG,
                                PipelineShared, PlanContext, RowParallelLinear,
                                SequenceParallelOutput, SequenceParallelParams,
                                VocabParallelEmbedding, VocabParallelLMHead)


def plan(cfg: ModelConfig, stage: StageSpec, ctx: PlanContext) -> list:
    """``[(module pattern, style)]`` for one chunk of the model."""
    a, g, d, f = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim, cfg.ffn_size
    out = [
        ("embedding.word_embeddings", VocabParallelEmbedding(cfg.vocab_size)),
        ("layers.*.self_attention.linear_qkv",
         ColumnParallelLinear(segments=(a * d, g * d, g * d))),
        ("layers.*.self_attention.linear_proj", RowParallelLinear()),
        ("layers.*.self_attention.core_attention", PartitionedRNG("tp")),
        ("layers.*.self_attention.core_attention", ContextParallelCore()),
        ("layers.*.mlp.linear_fc1", ColumnParallelLinear(segments=(f, f) if cfg.swiglu else None)),
        ("layers.*.mlp.linear_fc2", RowParallelLinear()),
        ("layers.*.mlp", MoEParallel(run_experts, swiglu=cfg.swiglu)),  # MoE layers: EP, expert TP
        ("output_layer", ColumnParallelLinear(vocab=True)),
        ("head", VocabParallelLMHead(cfg.vocab_size)),
        # sequence parallelism (no-ops unless --sequence-parallel with t > 1)
        ("embedding", SequenceParallelOutput()),
        ("layers.*.input_layernorm", SequenceParallelParams()),
        ("layers.*.pre_mlp_layernorm", SequenceParallelParams()),
        ("final_layernorm", SequenceParallelParams()),
        ("layers.*.hidden_dropout", PartitionedRNG("sp")),
    ]
    tied = not cfg.untie_embeddings_and_output_weights
    if tied and ctx.mesh.pp_size > 1 and (stage.pre_process or stage.post_process):
        out.append(("embedding.word_embeddings", PipelineShared(duplicate=not stage.pre_process)))
    return out


def init(cfg: ModelConfig) -> Callable:
    """``name -> InitFn``: N(0, std^2), output projections scaled by 1/sqrt(2L), zero biases,
    unit norm weights, zero vocabulary padding rows (Megatron-LM's initialization)."""
    std = cfg.init_method_std
    vocab = vocab_padded_init(normal_init(std), cfg.vocab_size)
    return by_pattern([
        ("*.bias", zeros_init),
        ("*norm.weight", ones_init),
        ("embedding.word_embeddings.weight", vocab),
        ("output_layer.weight", vocab),
        ("*.linear_proj.weight", scaled_normal_init(std, cfg.num_layers)),
        ("*.linear_fc2.weight", scaled_normal_init(std, cfg.num_layers)),
        ("*.weight", normal_init(std)),
    ])
