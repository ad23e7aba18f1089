"""How BERT is parallelized: its plan and its initializers.

Tensor parallelism as in the GPT family (QKV and FC1 column-parallel, output projection and
FC2 row-parallel, the vocabulary split in the embedding and in the tied masked-LM output); the
masked-LM output bias is split with the vocabulary (:class:`VocabParallelBias`). The masked-LM
transform (dense, GeLU, LN), the pooler and the binary head are small and replicated over TP.
Sequence parallelism: norms, dropout and the masked-LM transform run on ``[s/t, b, h]`` (their
parameters' gradients summed over TP); the pooler gathers the sequence first
(:class:`GatherSequenceInput`), because [CLS] lives on TP rank 0's slice only. Context
parallelism is refused for BERT (:mod:`loom.config.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from loom.config import ModelConfig
from loom.models.family import StageSpec
from loom.models.init import by_pattern, linear_inits, ones_init, vocab_padded_init, zeros_init
from loom.parallel.plan import (ColwiseParallel, ParallelStyle, PartitionedRNG, PipelineShared,
                                PlanContext, RowwiseParallel, SequenceParallelOutput,
                                SequenceParallelParams, VocabEmbeddingParallel, VocabHeadParallel)
from loom.parallel.registry import ShardSpec
from loom.parallel.sequence import gather_sequence_replicated_grad


@dataclass(frozen=True)
class VocabParallelBias(ParallelStyle):
    """A module's ``bias [Vp]`` over the vocabulary -> this rank's ``[Vp/t]`` rows."""

    def apply(self, module, ctx):
        vp, t = module.bias.shape[0], ctx.mesh.tp_size
        if vp % t:
            raise ValueError(f"padded vocab {vp} not divisible by t={t}")
        new = type(module)(vp // t)
        return new, {"bias": dict(full_shape=(vp,), shard=ShardSpec(0), vocab_dim=0)}


@dataclass(frozen=True)
class GatherSequenceInput(ParallelStyle):
    """Under sequence parallelism, the module's input ``[s/t, b, h]`` is all-gathered to
    ``[s, b, h]`` first; it computes the same on every TP rank, so backward keeps this rank's
    slice of the (identical) gradient."""

    def apply(self, module, ctx):
        if ctx.sp:
            group = ctx.mesh.groups["tp"]
            module.register_forward_pre_hook(
                lambda mod, args: (gather_sequence_replicated_grad(args[0], group), *args[1:]))
        return module, {}


def plan(cfg: ModelConfig, stage: StageSpec, ctx: PlanContext) -> list:
    """``[(module pattern, style)]`` for one chunk of BERT."""
    a, g, d = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim
    f = cfg.ffn_size
    out = [
        ("embedding.word_embeddings", VocabEmbeddingParallel(cfg.vocab_size)),
        ("layers.*.self_attention.linear_qkv",
         ColwiseParallel(segments=(a * d, g * d, g * d))),
        ("layers.*.self_attention.linear_proj", RowwiseParallel()),
        ("layers.*.self_attention.core_attention", PartitionedRNG("tp")),
        ("layers.*.mlp.linear_fc1", ColwiseParallel(segments=(f, f) if cfg.swiglu else None)),
        ("layers.*.mlp.linear_fc2", RowwiseParallel()),
        ("output_layer", VocabParallelBias()),
        ("head", VocabHeadParallel(cfg.softmax_vocab_size)),
        # sequence parallelism (no-ops unless --sequence-parallel with t > 1)
        ("embedding", SequenceParallelOutput()),
        ("layers.*.*layernorm", SequenceParallelParams()),
        ("final_layernorm", SequenceParallelParams()),
        ("lm_head", SequenceParallelParams()),
        ("pooler", GatherSequenceInput()),
        ("layers.*.hidden_dropout", PartitionedRNG("sp")),
    ]
    if ctx.mesh.pp_size > 1 and (stage.pre_process or stage.post_process):
        out.append(("embedding.word_embeddings", PipelineShared(duplicate=not stage.pre_process)))
    return out


def init(cfg: ModelConfig) -> Callable:
    """``name -> InitFn``: Megatron's BERT initialization (N(0, std^2), output projections
    scaled by 1/sqrt(2L), zero biases, unit norm weights, zero vocabulary padding rows; the
    word, position and token-type embeddings N(0, ``--embedding-init-method-std``^2) when
    given, Xavier-uniform weights under ``--init-method-xavier-uniform``:
    :func:`loom.models.init.linear_inits`)."""
    w = linear_inits(cfg)
    return by_pattern([
        ("*.bias", zeros_init),
        ("*norm.weight", ones_init),
        ("embedding.word_embeddings.weight", vocab_padded_init(w.embedding, cfg.vocab_size)),
        ("embedding.*_embeddings.weight", w.embedding),
        ("*.linear_proj.weight", w.output),
        ("*.linear_fc2.weight", w.output),
        ("*.weight", w.hidden),
    ])
