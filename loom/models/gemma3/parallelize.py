"""How Gemma 3 is parallelized: its plan and its initializers.

Tensor parallelism as in the GPT family (Q, KV and FC1 column-parallel, the output projection
and FC2 row-parallel, the vocabulary split in the embedding and the output + loss), with two
Gemma-specific pieces:

* **Fewer KV heads than TP ranks** (Gemma 3 270M has one): when t is a multiple of g, every rank
  holds the whole KV weight ``[2 g d, h]`` (replicated) and computes only the group its a/t query
  heads read (Megatron's KV-head replication). Each rank's gradient of that weight is partial
  (its own heads), so the registry marks it to be summed over TP.
* **QK-norm weights** act on per-head activations that TP splits: their gradients are partial
  sums too, summed over TP the same way (``ParamMeta.tp_partial_grad``;
  :class:`~loom.parallel.plan.PartialGradOverTP`).

Final-logit soft-capping needs the logits, so with it the output GEMM and the vocab-parallel
cross-entropy run unfused (:class:`~loom.parallel.plan.VocabParallelLMHead` with ``softcap``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ModelConfig
from loom.models.family import StageSpec
from loom.models.init import by_pattern, linear_inits, vocab_padded_init, zeros_init
from loom.parallel.mappings import copy_to_tensor_parallel_region
from loom.parallel.mesh import ParallelMesh
from loom.parallel.plan import (ColwiseParallel, ContextParallelCore, ParallelStyle,
                                PartialGradOverTP, PartitionedRNG, PipelineShared, PlanContext,
                                RowwiseParallel, SequenceParallelOutput, SequenceParallelParams,
                                VocabEmbeddingParallel, VocabHeadParallel)
from loom.parallel.sequence import gather_from_sequence_parallel_region


class ReplicatedKVLinear(nn.Module):
    """The fused KV projection with g < t groups: the whole weight ``[2 g d, h]`` on every rank;
    output ``[..., 2 d]``: K and V of group ``tp_rank * g // t`` only."""

    def __init__(self, out_features: int, in_features: int, groups: int, mesh: ParallelMesh,
                 sequence_parallel: bool):
        super().__init__()
        self.group, self.sp = mesh.groups["tp"], sequence_parallel
        self.local_groups = 1  # the KV heads this rank computes (a KV cache's size)
        d = out_features // (2 * groups)
        j = mesh.tp_rank * groups // mesh.tp_size
        self.rows = (slice(j * d, (j + 1) * d), slice((groups + j) * d, (groups + j + 1) * d))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=mesh.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp:
            x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)
        w = torch.cat([self.weight[self.rows[0]], self.weight[self.rows[1]]], dim=0)
        return F.linear(x, w)


@dataclass(frozen=True)
class ReplicatedKV(ParallelStyle):
    """``nn.Linear(h, 2 g d)`` -> :class:`ReplicatedKVLinear` (t a multiple of g)."""

    groups: int

    def apply(self, module, ctx):
        out_f, in_f = module.weight.shape
        new = ReplicatedKVLinear(out_f, in_f, self.groups, ctx.mesh, ctx.sp)
        return new, {"weight": dict(tp_partial_grad=ctx.mesh.tp_size > 1)}


def plan(cfg: ModelConfig, stage: StageSpec, ctx: PlanContext) -> list:
    """``[(module pattern, style)]`` for one chunk of the model."""
    g, d, f, t = cfg.num_kv_groups, cfg.head_dim, cfg.ffn_size, ctx.mesh.tp_size
    kv = ColwiseParallel(segments=(g * d, g * d)) if g % t == 0 else ReplicatedKV(g)
    head = VocabHeadParallel(cfg.softmax_vocab_size, softcap=cfg.final_logit_softcapping)
    out = [
        ("embedding.word_embeddings", VocabEmbeddingParallel(cfg.vocab_size)),
        ("layers.*.self_attention.linear_q", ColwiseParallel()),
        ("layers.*.self_attention.linear_kv", kv),
        ("layers.*.self_attention.q_layernorm", PartialGradOverTP()),
        ("layers.*.self_attention.k_layernorm", PartialGradOverTP()),
        ("layers.*.self_attention.linear_proj", RowwiseParallel()),
        ("layers.*.self_attention.core_attention", PartitionedRNG("tp")),
        ("layers.*.self_attention.core_attention", ContextParallelCore()),
        ("layers.*.mlp.linear_fc1", ColwiseParallel(segments=(f, f))),
        ("layers.*.mlp.linear_fc2", RowwiseParallel()),
        ("head", head),
        # sequence parallelism (no-ops unless --sequence-parallel with t > 1)
        ("embedding", SequenceParallelOutput()),
        ("layers.*.input_layernorm", SequenceParallelParams()),
        ("layers.*.post_self_attn_layernorm", SequenceParallelParams()),
        ("layers.*.pre_mlp_layernorm", SequenceParallelParams()),
        ("layers.*.post_mlp_layernorm", SequenceParallelParams()),
        ("final_layernorm", SequenceParallelParams()),
        ("layers.*.hidden_dropout", PartitionedRNG("sp")),
    ]
    if ctx.mesh.pp_size > 1 and (stage.pre_process or stage.post_process):
        out.append(("embedding.word_embeddings", PipelineShared(duplicate=not stage.pre_process)))
    return out


def init(cfg: ModelConfig) -> Callable:
    """``name -> InitFn``: N(0, std^2), output projections scaled by 1/sqrt(2L), zero norm
    weights (the gain is ``1 + weight``), zero vocabulary padding rows; the embeddings
    N(0, ``--embedding-init-method-std``^2) when given, Xavier-uniform weights under
    ``--init-method-xavier-uniform`` (:func:`loom.models.init.linear_inits`)."""
    w = linear_inits(cfg)
    return by_pattern([
        ("*norm.weight", zeros_init),
        ("embedding.word_embeddings.weight", vocab_padded_init(w.embedding, cfg.vocab_size)),
        ("*.linear_proj.weight", w.output),
        ("*.linear_fc2.weight", w.output),
        ("*.weight", w.hidden),
    ])
