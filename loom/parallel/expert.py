"""Expert parallelism (EP) and tensor parallelism inside mixture-of-experts layers.

The experts live on Megatron-Core's expert grid (:mod:`loom.parallel.mesh`): the ranks of a
pipeline stage re-folded as expert TP ``u`` x EP ``e`` x expert-DP, so an EP group may span TP,
CP and DP ranks (``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``; e.g. TP2
EP2 ETP1 on 4 ranks: the EP groups are the TP groups). The E experts are split over the e
ranks of the EP group (the ``ep_rank``-th E/e on each) and every expert is sharded over the u
ranks of its ``etp`` group like an MLP (FC1 by columns with its bias, FC2 by rows, its bias
added by expert-TP rank 0 only: :class:`~loom.models.moe.AddBias`); loom needs u to divide t,
so an expert's shards sit on ranks holding the same tokens.

Tokens. Every TP rank routes all of its micro-batch's tokens (under sequence parallelism the
layer all-gathers its ``[s/t, b, h]`` tokens first and keeps its own ``s/t`` slice of the
output), so the router, its load statistics and losses are exactly the single-process ones and
identical on the TP ranks. The kept (token, expert) pairs, sorted by expert, are then split over
the t/u expert-TP groups inside the TP group: the ranks of the j-th own every (t/u)-th pair
starting at j, and each rank dispatches its own pairs to the EP ranks holding their experts
(:mod:`loom.parallel.expert_dispatch`: all-to-all or all-gather / reduce-scatter), so each
pair meets each shard of its expert exactly once. The partial pair outputs of all k choices
and the shared expert's (sharded over TP) are summed over TP in ONE all-reduce before the router
weights combine them, so the router's gradient is exact and identical on every TP rank: 1
all-reduce forward and 1 backward per MoE layer, like a dense MLP. A latent MoE
(``--moe-latent-size``) projects every token on every TP rank (its projections are replicated,
like the router); its L-wide pair outputs and the shared expert's h-wide ones go flattened into
the one forward all-reduce, and backward sums the latent rows' and the shared expert's input
gradients in two. With u = t (the default) no
pair is split and this is expert TP as Megatron-Core's default; with u = 1 each expert is whole
and TP rank r runs every t-th pair.

Gradients. An expert shard's gradient on a rank is the sum over the pairs it ran; summed over
the expert-data-parallel group ``edp`` (the ranks holding the same shard) it covers every token
once. The gradient buffer averages over ``edp`` (n / (u e) ranks of the n = t c d in a stage)
and multiplies by n / (u e) / (d c) = t / (u e), giving the mean over the d c DP x CP ranks'
tokens like the dense gradients (:func:`expert_grad_scale`). Under context parallelism the
router's load statistics (and sinkhorn routing's column sums) are summed over the CP group.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from loom.parallel.expert_dispatch import ParallelDispatcher, all_to_all  # noqa: F401
from loom.parallel.mappings import reduce_from_tensor_parallel_region
from loom.parallel.plan import ParallelStyle, PlanContext
from loom.parallel.registry import ShardSpec
from loom.parallel.sequence import (gather_sequence_replicated_grad,
                                    scatter_to_sequence_parallel_region)


def _shard_mlp(mlp: nn.Module, t: int, tp_rank: int, swiglu: bool, expert: bool) -> dict:
    """Replace an expert MLP's linears by shard ``tp_rank`` of ``t`` (on the meta device: the
    expert-TP rank and size for a routed expert, the TP ones for the shared expert) and return
    their registry fields. Biases: FC1's is split like its columns; FC2's stays whole and only
    shard 0's partial output carries it (``add_fc2_bias``; every shard gets its full gradient),
    so the one all-reduce after the combine adds it once."""
    f1_out, h = mlp.linear_fc1.weight.shape
    bias = mlp.linear_fc1.bias is not None
    f = f1_out // 2 if swiglu else f1_out
    segments = (f, f) if swiglu else None
    mlp.linear_fc1 = nn.Linear(h, f1_out // t, bias=bias, device="meta")
    mlp.linear_fc2 = nn.Linear(f // t, h, bias=bias, device="meta")
    mlp.add_fc2_bias = tp_rank == 0
    fields = {"linear_fc1.weight": dict(full_shape=(f1_out, h), shard=ShardSpec(0, segments),
                                        expert_parallel=expert),
              "linear_fc2.weight": dict(full_shape=(h, f), shard=ShardSpec(1),
                                        expert_parallel=expert)}
    if bias:
        fields["linear_fc1.bias"] = dict(full_shape=(f1_out,), shard=ShardSpec(0, segments),
                                         expert_parallel=expert)
        fields["linear_fc2.bias"] = dict(expert_parallel=expert)
    return fields


@dataclass(frozen=True)
class MoEParallel(ParallelStyle):
    """For a module with ``experts`` (a ModuleDict keyed by global expert index): keep only this
    EP rank's experts, shard them over expert TP and the shared expert over TP, install the
    :class:`ParallelDispatcher` (this rank's share of the pairs: the module docstring). Other
    modules are left alone. ``run_experts``: the family's expert runner handed to the
    dispatcher (e.g. :func:`loom.models.moe.run_experts`)."""

    run_experts: Callable
    swiglu: bool = False
    dispatcher: str = "alltoall"
    overlap_shared: bool = False

    def apply(self, module, ctx: PlanContext):
        if not hasattr(module, "experts"):
            return module, {}
        mesh, fields = ctx.mesh, {}
        E, e, t, u = len(module.experts), mesh.ep_size, mesh.tp_size, mesh.etp_size
        local = E // e
        first = mesh.ep_rank * local
        for i in range(E):
            if not first <= i < first + local:
                del module.experts[str(i)]
        for name, mlp in module.experts.items():
            shards = _shard_mlp(mlp, u, mesh.etp_rank, self.swiglu, True) if u > 1 else {}
            for p, _ in mlp.named_parameters():
                fields[f"experts.{name}.{p}"] = dict(shards.get(p, {}), expert_parallel=True)
        if module.shared_experts is not None and t > 1:
            for p, kw in _shard_mlp(module.shared_experts, t, mesh.tp_rank, self.swiglu,
                                   False).items():
                fields[f"shared_experts.{p}"] = kw
        if t > 1 or e > 1:
            module.dispatcher = ParallelDispatcher(
                E, mesh.groups["tp"], mesh.groups.get("ep"), mesh.ep_rank, e,
                (mesh.tp_rank // u, t // u), run_experts=self.run_experts,
                kind=self.dispatcher, overlap_shared=self.overlap_shared)
        cp_group = mesh.groups["cp"]
        if cp_group is not None:  # the load-balancing loss over the whole sequence
            module.router.stats = ContextParallelRouterStats(cp_group)
            module.aux_scale = float(mesh.sizes["cp"])
        if mesh.groups["dp_cp"] is not None:  # global_aux_loss: the load over DP x CP
            module.router.global_stats = GlobalLoad(mesh.groups["dp_cp"])
        if ctx.sp:  # tokens [s/t, b, h] -> all of them on every TP rank -> back to [s/t, b, h]
            group = mesh.groups["tp"]
            module.register_forward_pre_hook(
                lambda mod, args: (gather_sequence_replicated_grad(args[0], group), *args[1:]))
            module.register_forward_hook(
                lambda mod, args, out: scatter_to_sequence_parallel_region(out, group))
        return module, fields


class ContextParallelRouterStats(nn.Module):
    """Sums the router's load statistics over the CP group, so the load-balancing loss is the
    whole sequence's (as on one rank): assignments and token counts all-reduced, the
    probability mass through an all-reduce whose backward is the identity (every CP rank then
    holds the same loss and differentiates it w.r.t. its own tokens). The MoE layer scales the
    loss's gradient by c (``aux_scale``), since gradients are averaged over DP x CP. Sinkhorn
    routing sums its per-expert column sums and token count through :meth:`sum`, so its
    balanced assignment is the whole sequence's too."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    @torch.no_grad()
    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the CP group (no gradient): sinkhorn routing's per-expert column
        sums and token count (:func:`loom.models.moe_router.sinkhorn`)."""
        out = t.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out

    def forward(self, routed, prob_mass, tokens):
        both = torch.cat([routed.detach(), tokens.detach().view(1)])
        dist.all_reduce(both, group=self.group)
        return both[:-1], reduce_from_tensor_parallel_region(prob_mass, self.group), both[-1]


class GlobalLoad(nn.Module):
    """``global_aux_loss``'s statistics: the assignments per expert summed over the DP x CP
    group (every rank routes its own tokens; TP ranks route the same ones). Returns the sum and
    the group's size."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, routed: torch.Tensor):
        total = routed.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total, dist.get_world_size(self.group)


@torch.no_grad()
def update_expert_bias(model_chunks: Sequence[nn.Module], group, rate: float) -> int:
    """The aux-loss-free bias update after an optimizer step (Wang et al. 2024, arXiv
    2408.15664, alg. 1; Megatron's ``get_updated_expert_bias``): for every router of these
    chunks holding an ``expert_bias [E]``, ``b += rate * sign(mean(n) - n)`` with ``n [E]`` the
    kept assignments it counted since the last update, summed over ``group`` (DP x CP: the
    step's global load; one all-reduce for all layers), so the bias is identical on every rank
    and every layout. Resets the counts (and ``global_aux_loss``'s running load). Returns the
    number of routers updated."""
    routers = [m for c in model_chunks for m in c.modules() if hasattr(m, "reset_load")]
    biased = [r for r in routers if getattr(r, "expert_bias", None) is not None]
    if biased:
        n = torch.stack([r.tokens_per_expert if r.tokens_per_expert is not None
                         else torch.zeros_like(r.expert_bias, dtype=torch.float32)
                         for r in biased]).float()
        if group is not None:
            dist.all_reduce(n, group=group)
        step = torch.sign(n.mean(-1, keepdim=True) - n) * rate
        for r, d in zip(biased, step):
            r.expert_bias.add_(d.to(r.expert_bias.dtype))
    for r in routers:
        r.reset_load()
    return len(biased)


@torch.no_grad()
def moe_layer_losses(model_chunks: Sequence[nn.Module], names: Sequence[str],
                     num_layers: int, mesh) -> dict[str, float]:
    """``--moe-per-layer-logging``: ``{"moe/<name>_layer_<i>": value}`` for every MoE layer i
    (a module of these chunks with a ``loss_log`` dict; i its global 0-based ``layer_number``,
    MTP layers after the L decoder layers) and every ``names`` loss
    (:func:`loom.models.moe.layer_loss_names`): what each layer summed since the last call
    (:func:`loom.models.moe.enable_layer_loss_log`: the loss without its coefficient, mean
    over the step's micro-batches), averaged over the DP x CP ranks. Megatron's values and
    TensorBoard names (``MoEMetricsTracker.report`` with ``per_layer_logging``: summed over
    the pipeline stages and the TP x CP reduce group, averaged over DP; loom's aux loss is
    already the whole micro-batch's on every TP and CP rank, so their mean equals it). One
    all-reduce over all ranks of a ``[len(names), num_layers]`` table (every rank holding a
    layer adds its value; each layer is on the t d c ranks of one stage). Resets the sums."""
    layers = [m for c in model_chunks for m in c.modules()  # MoE layers logging their losses
              if getattr(m, "loss_log", None) is not None]
    table = torch.zeros(len(names), num_layers, dtype=torch.float64, device=mesh.device)
    moe = torch.zeros(num_layers, dtype=torch.float64, device=mesh.device)
    for m in layers:
        moe[m.layer_number] = 1.0
        for i, name in enumerate(names):
            table[i, m.layer_number] = float(m.loss_log.get(name, 0.0))
        m.loss_log = {}
    both = torch.cat([table.view(-1), moe])
    if math.prod(mesh.sizes.values()) > 1:  # the mesh spans the default group's ranks
        dist.all_reduce(both)
    holders = mesh.tp_size * mesh.dp_size * mesh.sizes["cp"]
    table, moe = both[:-num_layers].view(len(names), num_layers) / holders, both[-num_layers:]
    return {f"moe/{name}_layer_{j}": float(table[i, j]) for i, name in enumerate(names)
            for j in range(num_layers) if moe[j] > 0}


def expert_grad_scale(mesh) -> float:
    """The factor on the expert gradients after their mean over ``edp``: that group's size over
    d c (= t / (u e); the module docstring), so they are the mean over the DP x CP ranks'
    tokens like the dense gradients. 1 on the dense grid (u = t, e = 1)."""
    return len(mesh.ranks["edp"]) / (mesh.sizes["dp"] * mesh.sizes["cp"])


class ReducerGroup:
    """Several gradient reducers acting as one (dense parameters over DP x CP, expert
    parameters over the expert-data-parallel group), with the reducer interface the schedules
    use. ``expert_scale`` multiplies the expert gradients after their reduction (the expert
    buffer usually applies :func:`expert_grad_scale` itself and this stays 1)."""

    def __init__(self, reducers: Sequence, expert_grads_of=None, expert_scale: float = 1.0):
        self.reducers = list(reducers)
        self.expert_params = list(expert_grads_of or [])
        self.expert_scale = expert_scale

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for r in self.reducers:
                stack.enter_context(r.no_sync())
            yield

    def finish_grad_sync(self) -> None:
        for r in self.reducers:
            r.finish_grad_sync()
        grads = [p.grad for p in self.expert_params if p.grad is not None]
        if grads and self.expert_scale != 1.0:
            torch._foreach_mul_(grads, self.expert_scale)

    def zero_grad(self) -> None:
        for r in self.reducers:
            r.zero_grad()
