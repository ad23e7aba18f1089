"""The expert-parallel token dispatchers (Megatron-Core's ``--moe-token-dispatcher-type``).

* ``alltoall``: each (token, choice) pair goes only to the EP rank holding its expert
  (``all_to_all_single`` with variable splits, the per-expert counts exchanged first), the
  local experts run, the outputs come back by the reverse all-to-all: 2 token all-to-alls
  forward and 2 backward per MoE layer. With ``--moe-shared-expert-overlap`` the dispatch
  all-to-all is started asynchronously and the shared expert computes while it is in flight.
* ``allgather``: every EP rank all-gathers the EP group's tokens and routing (all ranks have
  the same T; of the routing only the pairs each rank owns), runs its local experts on the
  pairs routed to them, and reduce-scatters the ``[e T k, h]`` outputs back (each pair is
  non-zero on exactly one rank, so the sum is that rank's output): more bytes than all-to-all
  when k < e, but no count exchange and fixed sizes. Backward: reduce-scatter of the token
  gradients, all-gather of the output gradients.

Both return the same numbers (the same pairs reach the same experts in the same order). A
rank dispatches only the pairs it owns (``pair_split``: with expert TP u < t the kept pairs,
sorted by expert, are split over the t/u expert-TP groups of the TP group; the EP group may
then hold TP ranks with the same tokens, each sending its own share: :mod:`loom.parallel.expert`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from loom.parallel.mappings import (copy_to_tensor_parallel_region,
                                    reduce_from_tensor_parallel_region)
from loom.parallel.sequence import (all_gather_into, gather_from_sequence_parallel_region,
                                    reduce_scatter_to_sequence_parallel_region)


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


class _Pending:
    """The handle of an all-to-all in flight (between :class:`_StartAllToAll` and
    :class:`_WaitAllToAll`)."""

    work = None


class _StartAllToAll(torch.autograd.Function):
    """Launch the all-to-all asynchronously; the returned buffer is filled once
    :class:`_WaitAllToAll` has waited. Backward: the reverse exchange (synchronous)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, pending):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        pending.work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits,
                                              group=group, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (_AllToAll.backward(ctx, grad)[0], None, None, None, None)


class _WaitAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf, pending):
        pending.work.wait()
        return buf.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ParallelDispatcher(nn.Module):
    """The MoE dispatcher under TP and/or EP (the module docstrings of this module and of
    :mod:`loom.parallel.expert`). Same contract as :class:`~loom.models.moe.LocalDispatcher`:
    ``forward(tokens [T, w], routing, experts, shared, shared_tokens)`` (``routing.experts``,
    ``.kept`` ``[T, k]``: expert ids and kept choices; ``w``: h, or the latent size of
    ``--moe-latent-size``) returns ``[T, k, w]`` expert outputs (zeros where dropped) and the
    shared expert's ``[T, h]`` on ``shared_tokens [T, h]`` (default ``tokens``; or None), summed
    over TP.
    ``run_experts(tokens [n, h], ids [n], experts, first) -> [n, h]`` runs tokens, sorted by
    their global expert id, through ``experts[str(id)]`` (the family's, e.g.
    :func:`loom.models.moe.run_experts`). ``pair_split``: ``(j, n)``, this rank owns every n-th
    kept pair (sorted by expert) starting at j. ``kind``: ``alltoall`` or ``allgather``;
    ``overlap_shared``: compute the shared expert during the dispatch all-to-all. ``trace``:
    None, or a list that receives the order of events (tests)."""

    def __init__(self, num_experts: int, tp_group, ep_group, ep_rank: int, ep_size: int,
                 pair_split: tuple[int, int] = (0, 1), *, run_experts: Callable,
                 kind: str = "alltoall", overlap_shared: bool = False):
        super().__init__()
        self.run_experts = run_experts
        self.E, self.tp_group, self.ep_group = num_experts, tp_group, ep_group
        self.e, self.local = ep_size, num_experts // ep_size
        self.first = ep_rank * self.local
        self.pair_rank, self.pair_stride = pair_split  # expert TP u < t: this rank's pairs
        self.kind, self.overlap_shared = kind, overlap_shared
        self.trace: Optional[list] = None

    def _note(self, event: str) -> None:
        if self.trace is not None:
            self.trace.append(event)

    def _pairs(self, flat: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """Indices into the ``[T k]`` pairs of those this rank owns, sorted by expert."""
        pairs = kept.reshape(-1).nonzero().squeeze(-1)
        pairs = pairs[torch.argsort(flat[pairs], stable=True)]
        if self.pair_stride > 1:  # still sorted by expert
            pairs = pairs[self.pair_rank::self.pair_stride]
        return pairs

    def _owned(self, routing) -> torch.Tensor:
        """``[T, k]`` bool: the kept pairs this rank owns."""
        T, k = routing.experts.shape
        if self.pair_stride == 1:
            return routing.kept
        pairs = self._pairs(routing.experts.reshape(-1), routing.kept)
        return torch.zeros(T * k, dtype=torch.bool, device=pairs.device).index_fill_(
            0, pairs, True).view(T, k)

    def _alltoall(self, x, routing, experts, shared, xs):
        """Returns the ``[T k, w]`` pair outputs and the shared expert's output on ``xs`` (or
        None)."""
        T, k = routing.experts.shape
        flat = routing.experts.reshape(-1)
        pairs = self._pairs(flat, routing.kept)
        send, ids = x[pairs // k], flat[pairs]
        shared_out = None
        if self.ep_group is None:
            out = self.run_experts(send, ids, experts)
        else:
            per_expert = torch.bincount(ids, minlength=self.E).view(self.e, self.local)
            recv_per_expert = torch.empty_like(per_expert)
            dist.all_to_all_single(recv_per_expert, per_expert.contiguous(), group=self.ep_group)
            send_counts = per_expert.sum(1).tolist()
            recv_counts = recv_per_expert.sum(1).tolist()
            if self.overlap_shared and shared is not None:
                pending = _Pending()
                buf = _StartAllToAll.apply(send, recv_counts, send_counts, self.ep_group, pending)
                self._note("dispatch all-to-all started")
                shared_out = shared(xs)
                self._note(f"shared expert done (all-to-all completed: "
                           f"{pending.work.is_completed()})")
                recv = _WaitAllToAll.apply(buf, pending)
                self._note("dispatch all-to-all waited")
            else:
                recv = all_to_all(send, recv_counts, send_counts, self.ep_group)
            local_ids = torch.repeat_interleave(
                torch.arange(self.local, device=x.device).repeat(self.e),
                recv_per_expert.reshape(-1))
            order = torch.argsort(local_ids, stable=True)  # source-major -> expert-major
            done = self.run_experts(recv[order], local_ids[order] + self.first, experts,
                                    self.first)
            back = done.new_empty(done.shape).index_copy(0, order, done)
            out = all_to_all(back, send_counts, recv_counts, self.ep_group)
        full = x.new_zeros(T * k, x.shape[-1]).index_copy(0, pairs, out)
        return full, shared_out

    def _allgather(self, x, routing, experts):
        T, k = routing.experts.shape
        g = self.ep_group
        xs = gather_from_sequence_parallel_region(x, g)  # [e T, h]; backward reduce-scatters
        experts_all = torch.empty((self.e * T, k), dtype=routing.experts.dtype, device=x.device)
        kept_all = torch.empty((self.e * T, k), dtype=torch.uint8, device=x.device)
        all_gather_into(experts_all, routing.experts.contiguous(), g)
        all_gather_into(kept_all, self._owned(routing).to(torch.uint8).contiguous(), g)
        flat = experts_all.reshape(-1)
        local = (flat >= self.first) & (flat < self.first + self.local)
        kept = kept_all.bool() & local.view(-1, k)  # pairs owned by their sender
        pairs = kept.reshape(-1).nonzero().squeeze(-1)
        pairs = pairs[torch.argsort(flat[pairs], stable=True)]
        done = self.run_experts(xs[pairs // k], flat[pairs], experts, self.first)
        full = x.new_zeros(self.e * T * k, x.shape[-1]).index_copy(0, pairs, done)
        return reduce_scatter_to_sequence_parallel_region(full, g)  # [T k, h]

    def forward(self, tokens, routing, experts: nn.ModuleDict,
                shared: Optional[nn.Module] = None, shared_tokens=None):
        T, k = routing.experts.shape
        x = copy_to_tensor_parallel_region(tokens, self.tp_group)  # f: input grads summed over TP
        xs = x
        if shared is not None and shared_tokens is not None and shared_tokens is not tokens:
            xs = copy_to_tensor_parallel_region(shared_tokens, self.tp_group)  # latent MoE
        if self.kind == "allgather" and self.ep_group is not None:
            full, shared_out = self._allgather(x, routing, experts), None
        else:
            full, shared_out = self._alltoall(x, routing, experts, shared, xs)
        if shared is not None and shared_out is None:
            shared_out = shared(xs)
        if self.tp_group is not None:  # partial sums of every rank's expert shards: one all-reduce
            if shared_out is None:
                full = reduce_from_tensor_parallel_region(full, self.tp_group)
            else:  # flattened: the shared expert's width h may differ from the latent size
                w, h = full.shape[-1], shared_out.shape[-1]
                both = reduce_from_tensor_parallel_region(
                    torch.cat([full.reshape(-1), shared_out.reshape(-1)]), self.tp_group)
                full, shared_out = both.split([full.numel(), shared_out.numel()])
                full, shared_out = full.view(T * k, w), shared_out.view(T, h)
        return full.view(T, k, -1), shared_out
