"""Expert parallelism (EP) and tensor parallelism inside mixture-of-experts layers.

The E experts are split over the e ranks of the EP group, which is carved out of the
data-parallel dimension (Megatron-Core: ``--expert-model-parallel-size``; EP rank = DP rank mod
e). Each rank routes its own tokens, sends every (token, choice) pair to the rank holding its
expert with ``all_to_all_single`` (variable split sizes: the per-expert counts are exchanged
first), runs its local experts, and sends the outputs back: 2 all-to-alls of tokens forward
and 2 backward per MoE layer. Expert gradients are summed over the EP group by the all-to-all's
backward and reduced over the expert-data-parallel group (DP ranks holding the same experts).

Under TP the experts are sharded like an MLP (FC1 by columns, FC2 by rows, no biases) and the
partial expert outputs of all k choices and the shared expert are summed over TP in ONE
all-reduce before the router weights combine them, so the router's gradient is exact and
identical on every TP rank: 1 all-reduce forward and 1 backward per MoE layer, like a dense MLP.
With ``--expert-tensor-parallel-size 1`` the experts stay whole on every TP rank (Megatron-Core's
expert TP 1: wider expert GEMMs) and TP rank r runs every t-th of the routed (token, expert)
pairs, starting at r; the same one all-reduce sums the pair outputs (each computed on exactly
one TP rank), and the experts' gradients, partial over TP, are summed over it after backward
(``ParamMeta.tp_partial_grad``). The shared expert stays sharded over TP.
Under context parallelism the router's load statistics are summed over the CP group. Under
sequence parallelism the layer all-gathers its ``[s/t, b, h]`` tokens first (every TP rank
routes all of them, so the router's load statistics are the full micro-batch's) and keeps its
own ``s/t`` slice of the output.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from loom.parallel.mappings import (copy_to_tensor_parallel_region,
                                    reduce_from_tensor_parallel_region)
from loom.parallel.plan import ParallelStyle, PlanContext
from loom.parallel.registry import ShardSpec
from loom.parallel.sequence import (gather_sequence_replicated_grad,
                                    scatter_to_sequence_parallel_region)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        # under torch.compile a fresh tensor, never the buffer the collective filled in place:
        # torch 2.11's Dynamo returns traced intermediates as extra outputs, and AOTAutograd then
        # routes this output's gradient to that duplicate (backward on zeros; see
        # loom.parallel.mappings.ConjugateCollective)
        return out.clone() if torch.compiler.is_compiling() else out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return g, None, None, None


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
               group) -> torch.Tensor:
    """Autograd-aware ``all_to_all_single`` along dim 0: ``in_splits[r]`` rows go to rank r,
    ``out_splits[r]`` rows come from rank r; backward runs the reverse exchange."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class ParallelDispatcher(nn.Module):
    """The MoE dispatcher under TP and/or EP (see the module docstring). Same contract as
    :class:`~loom.models.moe.LocalDispatcher`: ``forward(tokens [T, h], routing, experts,
    shared)`` (``routing.experts``, ``.kept`` ``[T, k]``: expert ids and kept choices) returns
    ``[T, k, h]`` expert outputs (zeros where dropped) and the shared expert's ``[T, h]`` (or
    None), summed over TP. ``run_experts(tokens [n, h], ids [n], experts, first) -> [n, h]``
    runs tokens sorted by global expert id through ``experts[str(id)]`` (the family's, e.g.
    :func:`loom.models.moe.run_experts`)."""

    def __init__(self, num_experts: int, tp_group, ep_group, ep_rank: int, ep_size: int,
                 pair_split: tuple[int, int] = (0, 1), *, run_experts: Callable):
        super().__init__()
        self.run_experts = run_experts
        self.E, self.tp_group, self.ep_group = num_experts, tp_group, ep_group
        self.e, self.local = ep_size, num_experts // ep_size
        self.first = ep_rank * self.local
        self.pair_rank, self.pair_stride = pair_split  # expert TP 1: this TP rank's pairs

    def forward(self, tokens, routing, experts: nn.ModuleDict,
                shared: Optional[nn.Module] = None):
        T, k = routing.experts.shape
        x = copy_to_tensor_parallel_region(tokens, self.tp_group)  # f: input grads summed over TP
        flat = routing.experts.reshape(-1)
        pairs = routing.kept.reshape(-1).nonzero().squeeze(-1)
        pairs = pairs[torch.argsort(flat[pairs], stable=True)]
        if self.pair_stride > 1:  # still sorted by expert
            pairs = pairs[self.pair_rank::self.pair_stride]
        send, ids = x[pairs // k], flat[pairs]
        if self.ep_group is None:
            out = self.run_experts(send, ids, experts)
        else:
            per_expert = torch.bincount(ids, minlength=self.E).view(self.e, self.local)
            recv_per_expert = torch.empty_like(per_expert)
            dist.all_to_all_single(recv_per_expert, per_expert.contiguous(), group=self.ep_group)
            send_counts = per_expert.sum(1).tolist()
            recv_counts = recv_per_expert.sum(1).tolist()
            recv = all_to_all(send, recv_counts, send_counts, self.ep_group)
            local_ids = torch.repeat_interleave(
                torch.arange(self.local, device=x.device).repeat(self.e),
                recv_per_expert.reshape(-1))
            order = torch.argsort(local_ids, stable=True)  # source-major -> expert-major
            done = self.run_experts(recv[order], local_ids[order] + self.first, experts, self.first)
            back = done.new_empty(done.shape).index_copy(0, order, done)
            out = all_to_all(back, send_counts, recv_counts, self.ep_group)
        full = x.new_zeros(T * k, x.shape[-1]).index_copy(0, pairs, out)
        shared_out = shared(x) if shared is not None else None
        if self.tp_group is not None:  # partial sums of every rank's expert shards: one all-reduce
            both = full if shared_out is None else torch.cat([full, shared_out])
            both = reduce_from_tensor_parallel_region(both, self.tp_group)
            full, shared_out = (both, None) if shared_out is None else both.split([T * k, T])
        return full.view(T, k, -1), shared_out


def _shard_mlp(mlp: nn.Module, t: int, swiglu: bool, expert: bool) -> dict:
    """Replace an expert MLP's linears by this TP rank's shards (on the meta device) and
    return their registry fields."""
    f1_out, h = mlp.linear_fc1.weight.shape
    f = f1_out // 2 if swiglu else f1_out
    segments = (f, f) if swiglu else None
    mlp.linear_fc1 = nn.Linear(h, f1_out // t, bias=False, device="meta")
    mlp.linear_fc2 = nn.Linear(f // t, h, bias=False, device="meta")
    return {"linear_fc1.weight": dict(full_shape=(f1_out, h), shard=ShardSpec(0, segments),
                                      expert_parallel=expert),
            "linear_fc2.weight": dict(full_shape=(h, f), shard=ShardSpec(1),
                                      expert_parallel=expert)}


@dataclass(frozen=True)
class MoEParallel(ParallelStyle):
    """For a module with ``experts`` (a ModuleDict keyed by global expert index): keep only this
    EP rank's experts, shard experts and the shared expert over TP, install the
    :class:`ParallelDispatcher`. Other modules are left alone. ``run_experts``: the family's
    expert runner handed to the dispatcher (e.g. :func:`loom.models.moe.run_experts`)."""

    run_experts: Callable
    swiglu: bool = False

    def apply(self, module, ctx: PlanContext):
        if not hasattr(module, "experts"):
            return module, {}
        mesh, fields = ctx.mesh, {}
        E, e, t = len(module.experts), mesh.ep_size, mesh.tp_size
        whole = t > 1 and mesh.etp_size == 1  # experts unsharded, pairs split over TP
        local = E // e
        first = mesh.ep_rank * local
        for i in range(E):
            if not first <= i < first + local:
                del module.experts[str(i)]
        for name, mlp in module.experts.items():
            shards = _shard_mlp(mlp, t, self.swiglu, True) if t > 1 and not whole else {}
            for p, _ in mlp.named_parameters():
                fields[f"experts.{name}.{p}"] = dict(shards.get(p, {}), expert_parallel=True,
                                                     tp_partial_grad=whole)
        if module.shared_experts is not None and t > 1:
            for p, kw in _shard_mlp(module.shared_experts, t, self.swiglu, False).items():
                fields[f"shared_experts.{p}"] = kw
        if t > 1 or e > 1:
            module.dispatcher = ParallelDispatcher(
                E, mesh.groups["tp"], mesh.groups.get("ep"), mesh.ep_rank, e,
                (mesh.tp_rank, t) if whole else (0, 1), run_experts=self.run_experts)
        cp_group = mesh.groups["cp"]
        if cp_group is not None:  # the load-balancing loss over the whole sequence
            module.aux_stats = ContextParallelRouterStats(cp_group)
            module.aux_scale = float(mesh.sizes["cp"])
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
    loss's gradient by c (``aux_scale``), since gradients are averaged over DP x CP."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, routed, prob_mass, tokens):
        both = torch.cat([routed.detach(), tokens.detach().view(1)])
        dist.all_reduce(both, group=self.group)
        return both[:-1], reduce_from_tensor_parallel_region(prob_mass, self.group), both[-1]


class ReducerGroup:
    """Several gradient reducers acting as one (dense parameters over DP x CP, expert
    parameters over the expert-data-parallel group), with the reducer interface the schedules
    use. ``expert_scale`` multiplies the expert gradients after their reduction: they hold the
    sum over the EP group's tokens averaged over d/e ranks, and the mean over all d DP ranks'
    tokens is wanted, hence 1/e."""

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
