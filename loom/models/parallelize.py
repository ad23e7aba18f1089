"""Plan entries and initializers the decoder families share (GPT's, and Mamba's attention and
MLP layers): how the blocks of :mod:`loom.models.attention`, :mod:`loom.models.mlp`,
:mod:`loom.models.moe` and :mod:`loom.models.chunk` are parallelized. A family's own
``parallelize.py`` adds the entries of its own modules.

Tensor parallelism (Shoeybi et al. 2019, sec. 3): QKV and FC1 column-parallel (the fused
``(a d, g d, g d)`` and ``(f, f)`` blocks each split over TP, so every rank holds a/t heads and
g/t groups), the output projection and FC2 row-parallel: exactly 2 all-reduces forward and 2
backward per layer. The vocabulary is split in the embedding and in the output layer + loss.
MoE layers: expert parallelism and expert TP (:class:`~loom.parallel.expert.MoEParallel`).
Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2): norms and dropout on ``[s/t, b, h]``.
Context parallelism: the attention core gathers keys and values over CP. Learnable attention
sinks split with the heads (:class:`HeadShardedSinks`); per-head QK norms see a/t heads
(:class:`~loom.parallel.plan.PartialGradOverTP`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from loom.config import ModelConfig
from loom.models.family import StageSpec
from loom.models.init import (by_pattern, linear_inits, ones_init, torchtitan_init,
                              vocab_padded_init, zeros_init)
from loom.models.moe import run_experts, run_experts_grouped
from loom.parallel.expert import MoEParallel
from loom.parallel.plan import (ColwiseParallel, ContextParallelCore, PartialGradOverTP,
                                PartitionedRNG, ParallelStyle, PipelineShared, PlanContext,
                                RowwiseParallel, SequenceParallelOutput, SequenceParallelParams,
                                VocabEmbeddingParallel, VocabHeadParallel)
from loom.parallel.registry import ShardSpec


class HeadShardedSinks(ParallelStyle):
    """A core's learnable attention sinks ``softmax_offset [a]`` (``--softmax-type
    learnable``) split over TP with the heads: this rank keeps its a/t (no communication; each
    head's sink only meets its own scores). Other cores are left alone."""

    def apply(self, module, ctx):
        sink = getattr(module, "softmax_offset", None)
        if not isinstance(sink, nn.Parameter):
            return module, {}
        a, t = sink.shape[0], ctx.mesh.tp_size
        if t > 1:
            module.softmax_offset = nn.Parameter(torch.empty(a // t, device="meta"))
        return module, {"softmax_offset": dict(full_shape=(a,), shard=ShardSpec(0))}


def decoder_plan(cfg: ModelConfig, stage: StageSpec, ctx: PlanContext,
                 tied: bool | None = None) -> list:
    """``[(module pattern, style)]`` of the shared decoder modules (``embedding``,
    ``layers.<i>.{input_layernorm, self_attention, pre_mlp_layernorm, mlp, hidden_dropout}``,
    ``final_layernorm``, ``output_layer``, ``head``) for one chunk; patterns that match nothing
    are no-ops. ``tied``: the word embedding also lives on the last pipeline stage (default:
    tied embeddings, ``not --untie-embeddings-and-output-weights``)."""
    a, g, d, f = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim, cfg.ffn_size
    out = [
        ("embedding.word_embeddings", VocabEmbeddingParallel(cfg.vocab_size)),
        ("layers.*.self_attention.linear_qkv",  # [Q; (gate;) K; V]
         ColwiseParallel(segments=((a * d,) * (2 if cfg.attention_output_gate else 1)
                                   + (g * d, g * d)))),
        ("layers.*.self_attention.linear_proj", RowwiseParallel()),
        ("layers.*.self_attention.core_attention", PartitionedRNG("tp")),
        ("layers.*.self_attention.core_attention", HeadShardedSinks()),  # --softmax-type
        ("layers.*.self_attention.core_attention", ContextParallelCore()),
        ("layers.*.mlp.linear_fc1", ColwiseParallel(segments=(f, f) if cfg.gated_linear_unit
                                                         else None)),
        ("layers.*.mlp.linear_fc2", RowwiseParallel()),
        ("layers.*.mlp", MoEParallel(  # MoE layers: EP, expert TP
            run_experts_grouped if cfg.moe_grouped_gemm else run_experts,
            swiglu=cfg.gated_linear_unit,
            dispatcher="allgather" if cfg.moe_token_dispatcher_type == "allgather" else "alltoall",
            overlap_shared=cfg.moe_shared_expert_overlap)),
        ("output_layer", ColwiseParallel(vocab=True)),
        ("head", VocabHeadParallel(cfg.softmax_vocab_size, logit_scale=cfg.logit_multiplier)),
        # sequence parallelism (no-ops unless --sequence-parallel with t > 1)
        ("embedding", SequenceParallelOutput()),
        ("layers.*.input_layernorm", SequenceParallelParams()),
        ("layers.*.pre_mlp_layernorm", SequenceParallelParams()),
        ("final_layernorm", SequenceParallelParams()),
        ("layers.*.hidden_dropout", PartitionedRNG("sp")),
    ]
    if cfg.qk_layernorm and not cfg.multi_latent_attention:  # per-head norms on a/t heads
        out += [(f"layers.*.self_attention.{n}", PartialGradOverTP())
                for n in ("q_layernorm", "k_layernorm")]
    if tied is None:
        tied = not cfg.untie_embeddings_and_output_weights
    if tied and ctx.mesh.pp_size > 1 and (stage.pre_process or stage.post_process):
        out.append(("embedding.word_embeddings", PipelineShared(duplicate=not stage.pre_process)))
    return out


def decoder_init(cfg: ModelConfig) -> Callable:
    """``name -> InitFn``: N(0, std^2), output projections scaled by 1/sqrt(2L), zero biases,
    unit norm weights, zero vocabulary padding rows (Megatron-LM's initialization); the word
    and position embeddings N(0, ``--embedding-init-method-std``^2) when given, everything
    Xavier-uniform under ``--init-method-xavier-uniform`` (:func:`loom.models.init.
    linear_inits`). Under ``--use-mup`` (width multiplier m) Megatron's ``init_method`` becomes
    N(0, std^2 / m) and the output projections N(0, std^2 / (2 L m)); the embeddings (word and
    position) and an untied output layer keep the embeddings' init (Megatron's GPTModel gives
    the output layer ``embedding_init_method`` under muP, ``init_method`` otherwise).
    ``--torchtitan-init``: torchtitan's (:func:`loom.models.init.torchtitan_init`)."""
    if cfg.torchtitan_init:
        return torchtitan_init(cfg)
    w = linear_inits(cfg, cfg.init_method_std / math.sqrt(cfg.width_multiplier))
    output_layer = w.embedding if cfg.use_mup else w.hidden
    return by_pattern([
        ("*.router.bias", w.hidden),  # Megatron's TopKRouter: init_method
        ("*.bias", zeros_init),
        ("*.router.expert_bias", zeros_init),
        ("*.core_attention.softmax_offset", w.hidden),  # learnable sinks (Megatron)
        ("*norm.weight", ones_init),
        ("embedding.word_embeddings.weight", vocab_padded_init(w.embedding, cfg.vocab_size)),
        ("embedding.position_embeddings.weight", w.embedding),
        ("output_layer.weight", vocab_padded_init(output_layer, cfg.vocab_size)),
        ("*.linear_proj.weight", w.output),
        ("*.linear_fc2.weight", w.output),
        # latent MoE's up projection: Megatron's output_layer_init_method (its down one
        # init_method, below)
        ("*.fc2_latent_proj.weight", w.output),
        ("*.weight", w.hidden),
    ])
