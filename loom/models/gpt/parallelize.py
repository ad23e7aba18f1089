"""How the GPT / LLaMA model is parallelized: its plan and its initializers.

The decoder's attention, MLP / MoE, vocabulary and sequence-parallel entries and Megatron-LM's
initialization are shared with the other decoder families (:mod:`loom.models.parallelize`).
GPT's own: multi-latent attention (:func:`mla_plan`): up projections column-parallel, down
projections replicated, the shared RoPE key through :class:`TensorParallelInput`; multi-token
prediction (:func:`mtp_plan`): the decoder layers' styles on each MTP layer, its embedding
shared with the first stage like tied embeddings.
"""

from __future__ import annotations

import functools

from torch import nn

from loom.config import ModelConfig
from loom.models.family import StageSpec
from loom.models.gpt.gdn import gdn_blocks
from loom.models.init import a_log_init, by_pattern, conv_init, ones_init
from loom.models.mtp import roll_left
from loom.models.parallelize import decoder_init, decoder_plan
from loom.parallel.context.split import gather_sequence, slice_for_cp
from loom.parallel.mappings import copy_to_tensor_parallel_region
from loom.parallel.mamba_styles import ChannelParallelParams
from loom.parallel.plan import (ColwiseParallel, ParallelStyle, PartialGradOverTP, PlanContext,
                                RowwiseParallel, SequenceParallelParams)
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


def _cp_shift(x, group):
    """:func:`~loom.models.mtp.roll_left` of the whole sequence when this rank holds its
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


class TensorParallelSum(ParallelStyle):
    """An identity module becomes the sum over TP of a no-gradient tensor (DSA's target:
    attention probabilities summed over this rank's heads, then over all heads)."""

    def apply(self, module, ctx):
        if ctx.mesh.tp_size == 1:
            return module, {}
        return _TensorParallelSum(ctx.mesh.groups["tp"]), {}


class _TensorParallelSum(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x):
        import torch.distributed as dist
        x = x.detach().clone()
        dist.all_reduce(x, group=self.group)
        return x


def mla_plan(dsa: bool = False) -> list:
    """Multi-latent attention: the up projections column-parallel (a/t heads per rank), the
    down projections and their norms replicated (sequence-split under SP: gradients summed
    over TP), the shared RoPE key entering the TP region (Megatron-Core's MLA under TP). With
    ``dsa`` (:mod:`loom.models.gpt.dsa`): the replicated indexer reads the whole sequence
    (gathered under SP; it reads detached inputs, so nothing flows back) and the target's
    head sum is summed over TP."""
    at = "layers.*.self_attention."
    core = at + "core_attention."
    return ([(core + "input_region", TensorParallelInput()),
             (core + "head_sum_region", TensorParallelSum())] if dsa else []) + [(at + n, ColwiseParallel()) for n in ("linear_q_proj", "linear_q_up_proj",
                                                       "linear_kv_up_proj")] + \
        [(at + n, SequenceParallelParams()) for n in ("linear_q_down_proj", "q_layernorm",
                                                      "linear_kv_down_proj", "kv_layernorm")] + \
        [(at + "k_pos_emb_region", TensorParallelInput())]


def gdn_plan(cfg: ModelConfig) -> list:
    """Gated DeltaNet layers (:mod:`loom.models.gpt.gdn`), split by heads: ``in_proj``
    column-parallel (each of its six blocks split t ways), the convolution channels of
    ``[Q; K; V]``, ``A_log`` and ``dt_bias`` split alike, ``out_proj`` row-parallel; the output
    norm's weight, shared by the heads, sees this rank's heads (gradient summed over TP)."""
    qk, _, v, *_ = gdn_blocks(cfg)
    out = []
    for i in range(cfg.num_layers):
        if cfg.is_gdn_layer(i):
            at = f"layers.{i}.self_attention"
            out += [(at + ".in_proj", ColwiseParallel(segments=gdn_blocks(cfg))),
                    (at + ".conv1d", ChannelParallelParams((("weight", (qk, qk, v)),))),
                    (at, ChannelParallelParams((("A_log", None), ("dt_bias", None)))),
                    (at + ".out_norm", PartialGradOverTP()),
                    (at + ".out_proj", RowwiseParallel())]
    return out


def mtp_plan(layer_plan: list) -> list:
    """Multi-token prediction (last chunk): each module's transformer layer takes the decoder
    layers' styles; its norms and ``eh_proj`` are replicated (sequence-split under SP)."""
    inner = [("mtp.layers.*.mtp_model_layer." + p[len("layers.*."):], style)
             for p, style in layer_plan if p.startswith("layers.*.")]
    return inner + [(f"mtp.layers.*.{n}", SequenceParallelParams())
                    for n in ("enorm", "hnorm", "eh_proj", "final_layernorm")] + \
        [("mtp", MTPContextParallel())]


def plan(cfg: ModelConfig, stage: StageSpec, ctx: PlanContext) -> list:
    """``[(module pattern, style)]`` for one chunk of the model: the shared decoder plan
    (:func:`loom.models.parallelize.decoder_plan`) with multi-latent attention's entries first
    and, on the last chunk, the multi-token prediction modules' (the embedding then lives on
    the last stage too)."""
    out = (mla_plan(cfg.dsa) if cfg.multi_latent_attention else []) + gdn_plan(cfg) + decoder_plan(
        cfg, stage, ctx, tied=not cfg.untie_embeddings_and_output_weights
        or bool(cfg.mtp_num_layers))  # MTP embeds tokens on the last stage
    if cfg.mtp_num_layers and stage.post_process:
        out = mtp_plan(out) + out
    return out


def init(cfg: ModelConfig):
    """``name -> InitFn``: Megatron-LM's initialization (:func:`loom.models.parallelize.
    decoder_init`), and Gated DeltaNet's own parameters as Megatron's ``GatedDeltaNet``
    initializes them: ``A_log = log U[1, 16]``, ``dt_bias`` ones, the convolution PyTorch's
    default (``U(+-1/sqrt(K))``); its projections are ``init_method`` and the scaled
    ``output_layer_init_method`` like attention's."""
    decoder = decoder_init(cfg)
    if not cfg.gated_delta_net:
        return decoder
    gdn = by_pattern([("*.self_attention.A_log", a_log_init),
                      ("*.self_attention.dt_bias", ones_init),
                      ("*.self_attention.conv1d.weight", conv_init),
                      ("*.self_attention.out_proj.weight", decoder("*.linear_proj.weight"))])

    def lookup(name: str):
        try:
            return gdn(name)
        except KeyError:
            return decoder(name)
    return lookup
