"""How the GPT / LLaMA model is parallelized: its plan and its initializers.

Tensor parallelism (Shoeybi et al. 2019, sec. 3): QKV and FC1 column-parallel (the fused
``(a d, g d, g d)`` and ``(f, f)`` blocks each split over TP, so every rank holds a/t heads and
g/t groups), the output projection and FC2 row-parallel: exactly 2 all-reduces forward and 2
backward per layer. The vocabulary is split in the embedding and in the output layer + loss.
Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2): norms and dropout on ``[s/t, b, h]``.
Context parallelism: the attention core gathers keys and values over CP.
Multi-latent attention (:func:`mla_plan`): up projections column-parallel, down projections
replicated, the shared RoPE key through :class:`TensorParallelInput`; multi-token prediction
(:func:`mtp_plan`): the decoder layers' styles on each MTP layer, its embedding shared with the
first stage like tied embeddings.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch import nn

from loom.config import ModelConfig
from loom.models.family import StageSpec
from loom.models.init import (by_pattern, normal_init, ones_init, scaled_normal_init,
                              vocab_padded_init, zeros_init)
from loom.models.gemma3.parallelize import PartialGradOverTP
from loom.models.gpt.mtp import roll_left
from loom.models.moe import run_experts, run_experts_grouped
from loom.parallel.expert import MoEParallel
from loom.parallel.mappings import copy_to_tensor_parallel_region
from loom.parallel.plan import (ColwiseParallel, ContextParallelCore, PartitionedRNG,
                                ParallelStyle, PipelineShared, PlanContext, RowwiseParallel,
                                SequenceParallelOutput, SequenceParallelParams,
                                VocabEmbeddingParallel, VocabHeadParallel)
from loom.parallel.context.split import gather_sequence, slice_for_cp
from loom.parallel.registry import ShardSpec
from loom.parallel.sequence import gather_from_sequence_parallel_region


class TensorParallelInput(ParallelStyle):
    """An identity module becomes the input region of a tensor-parallel consumer whose input
    is replicated (MLA's RoPE key, shared by the heads every rank splits): ``f`` (identity
    forward, all-reduce of the gradient over TP), or under SP the all-gather of ``[s/t, b, d]``
    along the sequence (reduce-scatter backward), as ``ColumnParallelLinear`` enters."""

    def apply(self, module, ctx):
        if ctx.mesh.tp_size == 1:
            return module, {}
        return _TensorParallelInput(ctx.mesh.groups["tp"], ctx.sp), {}


class _TensorParallelInput(nn.Module):
    def __init__(self, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, self.group)
        return copy_to_tensor_parallel_region(x, self.group)


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


def _cp_shift(x, group):
    """:func:`~loom.models.gpt.mtp.roll_left` of the whole sequence when this rank holds its
    load-balanced CP chunks ``[..., s/c]``: gathered in global order, shifted, cut again."""
    import torch.distributed as dist
    full = gather_sequence(x, group, x.dim() - 1)
    return slice_for_cp(roll_left(full), dist.get_rank(group), dist.get_world_size(group),
                        dim=x.dim() - 1)


def _cp_token_count(count, group):
    """The unmasked tokens over the CP group, and the multiplier c (the gradient average over
    CP turns each rank's ``c x local sum / global count`` into the global mean)."""
    import torch.distributed as dist
    total = count.detach().clone()
    dist.all_reduce(total, group=group)
    return total, float(dist.get_world_size(group))


class MTPContextParallel(ParallelStyle):
    """Multi-token prediction under context parallelism: the token shift crosses the CP chunks
    and the loss is normalized by the global token count (Megatron-Core's ``roll_tensor`` with
    a CP group)."""

    def apply(self, module, ctx):
        group = ctx.mesh.groups["cp"]
        if group is not None and hasattr(module, "shift"):
            module.shift = functools.partial(_cp_shift, group=group)
            module.token_count = functools.partial(_cp_token_count, group=group)
        return module, {}


def mla_plan() -> list:
    """Multi-latent attention: the up projections column-parallel (a/t heads per rank), the
    down projections and their norms replicated (sequence-split under SP: gradients summed
    over TP), the shared RoPE key entering the TP region (Megatron-Core's MLA under TP)."""
    at = "layers.*.self_attention."
    return [(at + n, ColwiseParallel()) for n in ("linear_q_proj", "linear_q_up_proj",
                                                       "linear_kv_up_proj")] + \
        [(at + n, SequenceParallelParams()) for n in ("linear_q_down_proj", "q_layernorm",
                                                      "linear_kv_down_proj", "kv_layernorm")] + \
        [(at + "k_pos_emb_region", TensorParallelInput())]


def mtp_plan(layer_plan: list) -> list:
    """Multi-token prediction (last chunk): each module's transformer layer takes the decoder
    layers' styles; its norms and ``eh_proj`` are replicated (sequence-split under SP)."""
    inner = [("mtp.layers.*.mtp_model_layer." + p[len("layers.*."):], style)
             for p, style in layer_plan if p.startswith("layers.*.")]
    return inner + [(f"mtp.layers.*.{n}", SequenceParallelParams())
                    for n in ("enorm", "hnorm", "eh_proj", "final_layernorm")] + \
        [("mtp", MTPContextParallel())]


def plan(cfg: ModelConfig, stage: StageSpec, ctx: PlanContext) -> list:
    """``[(module pattern, style)]`` for one chunk of the model."""
    a, g, d, f = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim, cfg.ffn_size
    out = (mla_plan() if cfg.multi_latent_attention else []) + [
        ("embedding.word_embeddings", VocabEmbeddingParallel(cfg.vocab_size)),
        ("layers.*.self_attention.linear_qkv",
         ColwiseParallel(segments=(a * d, g * d, g * d))),
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
    if cfg.mtp_num_layers and stage.post_process:
        out = mtp_plan(out) + out
    shared = not cfg.untie_embeddings_and_output_weights or cfg.mtp_num_layers  # MTP embeds too
    if shared and ctx.mesh.pp_size > 1 and (stage.pre_process or stage.post_process):
        out.append(("embedding.word_embeddings", PipelineShared(duplicate=not stage.pre_process)))
    return out


def init(cfg: ModelConfig) -> Callable:
    """``name -> InitFn``: N(0, std^2), output projections scaled by 1/sqrt(2L), zero biases,
    unit norm weights, zero vocabulary padding rows (Megatron-LM's initialization). Under
    ``--use-mup`` (width multiplier m) Megatron's ``init_method`` becomes N(0, std^2 / m) and
    the output projections N(0, std^2 / (2 L m)); the embeddings (word and position) and the
    output layer keep N(0, std^2) (its ``embedding_init_method``)."""
    std = cfg.init_method_std
    vocab = vocab_padded_init(normal_init(std), cfg.vocab_size)
    hidden_std = std / math.sqrt(cfg.width_multiplier)
    hidden = normal_init(hidden_std)
    return by_pattern([
        ("*.router.bias", hidden),  # Megatron's TopKRouter: init_method
        ("*.bias", zeros_init),
        ("*.router.expert_bias", zeros_init),
        ("*.core_attention.softmax_offset", hidden),  # learnable sinks (Megatron)
        ("*norm.weight", ones_init),
        ("embedding.word_embeddings.weight", vocab),
        ("embedding.position_embeddings.weight", normal_init(std)),
        ("output_layer.weight", vocab),
        ("*.linear_proj.weight", scaled_normal_init(hidden_std, cfg.num_layers)),
        ("*.linear_fc2.weight", scaled_normal_init(hidden_std, cfg.num_layers)),
        ("*.weight", hidden),
    ])
