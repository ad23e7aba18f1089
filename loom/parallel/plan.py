"""Parallel plans: a model written as plain math is parallelized after construction.

A plan is a list of ``(module-name pattern, ParallelStyle)`` (``fnmatch`` patterns such as
``layers.*.mlp.linear_fc1``), as in torchtitan's ``parallelize_module``. Each style swaps in
loom's parallel module (or installs a region or strategy on the module) and reports how its
parameters relate to the unsharded model; :func:`apply_plan` collects that into the
:class:`~loom.parallel.registry.ParamRegistry`. The plain model is built on the ``meta``
device, so no rank ever allocates the full model; parameters are materialized on the mesh's
device and then initialized from the registry.

Styles are named as in a torchtitan plan (PyTorch's ``ColwiseParallel`` / ``RowwiseParallel``),
and install the layer Megatron-LM's ``megatron.core.tensor_parallel`` names (loom's
:mod:`loom.parallel.tensor`: the styles and the ``nn.Module`` s keep distinct names):
:class:`ColwiseParallel` installs ``ColumnParallelLinear`` and :class:`RowwiseParallel`
``RowParallelLinear`` (on an ``nn.Linear``), :class:`VocabEmbeddingParallel`
``VocabParallelEmbedding`` (on an ``nn.Embedding``), :class:`VocabHeadParallel`
``VocabParallelLMHead`` (output GEMM + vocab-parallel cross-entropy). They install modules on
plain tensors (PyTorch's DTensor styles shard into DTensors instead). Others:
:class:`SequenceParallelParams` (norms on ``[s/t, b, h]``), :class:`SequenceParallelOutput`
(scatter to the SP region), :class:`PartialGradOverTP` (per-head norms on TP-split heads),
:class:`PartitionedRNG` (dropout on partitioned activations),
:class:`ContextParallelCore`, :class:`PipelineShared` (tied embeddings across stages).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from torch import nn

from loom.parallel import tensor
from loom.parallel.context.attention import wrap_context_parallel
from loom.parallel.mesh import ParallelMesh
from loom.parallel.random import ForkedDropout, RNGTracker
from loom.parallel.registry import ParamMeta, ParamRegistry, ShardSpec
from loom.parallel.sequence import scatter_to_sequence_parallel_region

Fields = dict  # local parameter name -> ParamMeta keyword overrides


@dataclass(frozen=True)
class PlanContext:
    """What styles need: the mesh, the TP dropout generator, and whether activations between TP
    regions are sequence-split (``--sequence-parallel``, only meaningful when t > 1)."""

    mesh: ParallelMesh
    tracker: RNGTracker
    sequence_parallel: bool = False
    cp_comm_type: tuple = ("p2p",)  # --cp-comm-type: one for every layer, or one per layer

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.mesh.tp_size > 1


class ParallelStyle:
    """``apply(module, ctx) -> (replacement module, {param name: ParamMeta overrides})``."""

    def apply(self, module: nn.Module, ctx: PlanContext) -> tuple[nn.Module, Fields]:
        raise NotImplementedError

    def apply_named(self, name: str, module: nn.Module,
                    ctx: PlanContext) -> tuple[nn.Module, Fields]:
        """:meth:`apply` for a style that needs the module's name (its layer)."""
        return self.apply(module, ctx)


@dataclass(frozen=True)
class ColwiseParallel(ParallelStyle):
    """Turns an ``nn.Linear(in, out)`` into Megatron's ``ColumnParallelLinear``
    (:class:`loom.parallel.tensor.ColumnParallelLinear`): output features (each fused
    block of ``segments``) split over TP; ``vocab``: the output dimension is the padded
    vocabulary (weight ``[Vp, h]``)."""

    segments: Optional[tuple[int, ...]] = None
    vocab: bool = False

    def apply(self, module, ctx):
        out_f, in_f = module.weight.shape
        spec = ShardSpec(0, self.segments)
        new = tensor.ColumnParallelLinear(in_f, out_f, ctx.mesh, bias=module.bias is not None,
                                          segments=self.segments, sequence_parallel=ctx.sp)
        fields = {"weight": dict(full_shape=(out_f, in_f), shard=spec,
                                 vocab_dim=0 if self.vocab else None)}
        if module.bias is not None:
            fields["bias"] = dict(full_shape=(out_f,), shard=spec)
        return new, fields


@dataclass(frozen=True)
class RowwiseParallel(ParallelStyle):
    """Turns an ``nn.Linear(in, out)`` into Megatron's ``RowParallelLinear``
    (:class:`loom.parallel.tensor.RowParallelLinear`): input features split over TP,
    partial sums all-reduced (reduce-scattered along s under SP). The bias is replicated and,
    under SP, applied to this rank's tokens only (its gradient summed over TP)."""

    def apply(self, module, ctx):
        out_f, in_f = module.weight.shape
        new = tensor.RowParallelLinear(in_f, out_f, ctx.mesh, bias=module.bias is not None,
                                       sequence_parallel=ctx.sp)
        fields = {"weight": dict(full_shape=(out_f, in_f), shard=ShardSpec(1))}
        if module.bias is not None:
            fields["bias"] = dict(sequence_parallel=ctx.sp)
        return new, fields


@dataclass(frozen=True)
class VocabEmbeddingParallel(ParallelStyle):
    """Turns an ``nn.Embedding(Vp, h)`` into Megatron's ``VocabParallelEmbedding``
    (:class:`loom.parallel.tensor.VocabParallelEmbedding`: rows split over TP)."""

    vocab_size: int

    def apply(self, module, ctx):
        vp, h = module.weight.shape
        new = tensor.VocabParallelEmbedding(vp, h, ctx.mesh, vocab_size=self.vocab_size)
        return new, {"weight": dict(full_shape=(vp, h), shard=ShardSpec(0), vocab_dim=0)}


@dataclass(frozen=True)
class VocabHeadParallel(ParallelStyle):
    """Turns the family's ``LMHead`` into :class:`loom.parallel.tensor.VocabParallelLMHead`: the
    output GEMM on vocabulary-parallel logits (input gathered from the SP region, or entered
    through ``f``) and the vocab-parallel cross-entropy (Megatron's ``output_layer`` +
    ``vocab_parallel_cross_entropy``). ``vocab_size``: the columns the softmax spans
    (``ModelConfig.softmax_vocab_size``; None: all Vp, the padded ones included).
    ``softcap``: Gemma's final-logit soft-capping (``softcap * tanh(logits / softcap)``;
    output GEMM and loss then run unfused); ``logit_scale``: the logits' multiplier (muP)."""

    vocab_size: Optional[int]
    softcap: Optional[float] = None
    logit_scale: float = 1.0

    def apply(self, module, ctx):
        return tensor.VocabParallelLMHead(ctx.mesh, self.vocab_size, ctx.sp,
                                          softcap=self.softcap,
                                          logit_scale=self.logit_scale), {}


@dataclass(frozen=True)
class SequenceParallelParams(ParallelStyle):
    """Every parameter of the module sees ``[s/t, b, h]`` tokens: gradients summed over TP."""

    def apply(self, module, ctx):
        return module, {n: dict(sequence_parallel=ctx.sp) for n, _ in module.named_parameters()}


@dataclass(frozen=True)
class PartialGradOverTP(ParallelStyle):
    """The module's parameters see TP-split activations (per-head norms of queries and keys,
    applied to this rank's a/t heads): each rank's gradient is a partial sum, summed over TP."""

    def apply(self, module, ctx):
        return module, {n: dict(tp_partial_grad=ctx.mesh.tp_size > 1)
                        for n, _ in module.named_parameters()}


@dataclass(frozen=True)
class SequenceParallelOutput(ParallelStyle):
    """Scatter the module's ``[s, b, h]`` output to this rank's ``[s/t, b, h]`` (SP)."""

    def apply(self, module, ctx):
        if ctx.sp:
            group = ctx.mesh.groups["tp"]
            module.register_forward_hook(
                lambda mod, args, out: scatter_to_sequence_parallel_region(out, group))
        return module, {}


@dataclass(frozen=True)
class PartitionedRNG(ParallelStyle):
    """Dropout over activations that differ per TP rank (partitioned heads; tokens under SP)
    draws from the per-TP-rank generator. ``when``: "tp" (t > 1) or "sp" (sequence-parallel)."""

    when: str = "tp"

    def apply(self, module, ctx):
        active = ctx.sp if self.when == "sp" else ctx.mesh.tp_size > 1
        if not active:
            return module, {}
        if isinstance(module, nn.Dropout):
            return ForkedDropout(module.p, ctx.tracker), {}
        module.rng = ctx.tracker
        return module, {}


@dataclass(frozen=True)
class ContextParallelCore(ParallelStyle):
    """Wrap an attention core to run over the CP group by the layer's ``--cp-comm-type``
    (:class:`~loom.parallel.context.ContextParallelAttention`; the layer index is read from
    the module name ``layers.<i>.``)."""

    def apply(self, module, ctx):
        return self.apply_named("", module, ctx)

    def apply_named(self, name, module, ctx):
        return wrap_context_parallel(module, ctx.mesh, ctx.cp_comm_type, name), {}


@dataclass(frozen=True)
class PipelineShared(ParallelStyle):
    """The module's weight also lives on another pipeline stage (tied embeddings): gradients
    summed over the embedding group; ``duplicate``: this copy stays out of the norm."""

    duplicate: bool = False

    def apply(self, module, ctx):
        return module, {"weight": dict(pipeline_shared=True, duplicate=self.duplicate)}


Plan = Sequence[tuple[str, ParallelStyle]]


def apply_plan(model: nn.Module, plan: Plan, ctx: PlanContext,
               init_for: Callable[[str], Callable]) -> ParamRegistry:
    """Apply ``plan`` to ``model`` (built on the meta device), materialize every parameter on
    ``ctx.mesh.device`` (uninitialized) and return the registry (``init_for(name)`` gives each
    parameter's full-tensor initializer). Styles apply in plan order; several may match one
    module; a pattern may match nothing (a pipeline chunk lacks the embedding, say). On a
    meta mesh (the planner's exact count, :mod:`loom.planner.meta_count`) the parameters stay
    where they are, on the meta device: no ``to_empty`` pass (3.9 s per rank of a 235B MoE,
    which also allocated untouched CPU storage while the count's mesh was a CPU one)."""
    overrides: dict[str, dict] = {}
    modules = list(model.named_modules())  # listed again only after a module was replaced
    for pattern, style in plan:
        match = re.compile(fnmatch.translate(pattern)).match
        replaced = False
        for name, module in modules:
            if not name or not match(name):
                continue
            new, fields = style.apply_named(name, module, ctx)
            if new is not module:
                model.set_submodule(name, new)
                replaced = True
            for pname, kw in fields.items():
                overrides.setdefault(f"{name}.{pname}", {}).update(kw)
        if replaced:
            modules = list(model.named_modules())
    if ctx.mesh.device.type != "meta":
        model.to_empty(device=ctx.mesh.device)
    registry = ParamRegistry()
    for name, p in model.named_parameters():
        kw = dict(overrides.get(name, {}))
        full_shape = tuple(kw.pop("full_shape", tuple(p.shape)))
        registry.add(name, ParamMeta(full_shape=full_shape, init=init_for(name), **kw))
    return registry
