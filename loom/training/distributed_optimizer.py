"""loom's distributed optimizer, also the optimizer of 16-bit training: fp32 master weights and
AdamW states for the elements this rank owns, and the parameter all-gather (Megatron-LM's
``MixedPrecisionOptimizer`` / ``DistributedOptimizer``, ``megatron/core/optimizer/
distrib_optimizer.py``; Rajbhandari et al. 2020, ZeRO, sec. 5.1-5.2). The gradients are not its
own: they live in the :class:`~loom.parallel.grad_buffer.GradBuffer` of each chunk (Megatron's
DDP gradient buffer), which the trainer builds in the mode :func:`buffer_mode` asks for
(reduce-scatter into 1/d shards; ZeRO-2 keeps only the shards).

Each trainable parameter ``p`` is owned, on this rank, over the flat range ``p.view(-1)[lo:hi]``
of its gradient buffer's reduce-scatter shard (:meth:`GradBuffer.shard_range`: the whole
parameter without sharding, the part inside this rank's 1/d of the bucket with the distributed
optimizer; possibly empty). For that range the optimizer keeps a 1-D fp32 *master* tensor: a
copy for 16-bit parameters (4 bytes/element), a view of the parameter itself for fp32 ones (as
Megatron; no copy). ``torch.optim.AdamW`` (fused where supported) steps the masters, in two
groups: weight decay on matrices, none on biases and 1-D parameters (decided per parameter, so a
range that spans several parameters is never decayed wrongly); ``--optimizer sgd`` steps them
with ``torch.optim.SGD`` instead (its momentum buffer is the one state, sharded the same way).
The masters' gradients are the reducer's reduced fp32 main-gradient ranges (:meth:`shard_grad`,
views: no copy).

Sharded, the parameters move into flat per-bucket buffers of their gradient buckets' layout
(:class:`ParamGather`). After the step the masters are copied into the (16-bit) parameters and
each bucket's parameter buffer is all-gathered (:meth:`ParamGather.start`); with
``--overlap-param-gather`` the all-gathers run asynchronously and each bucket is waited for by a
forward pre-hook of the first module that uses it in the next forward
(:meth:`DistributedOptimizer.hook_param_gather`), or by :meth:`finish_param_gather`.

Memory per parameter in bf16 (fp32 main gradients): 2 (weights) + 4 (main grads) + 12/d (fp32
master, exp_avg, exp_avg_sq) = 6 + 12/d; ZeRO-2 keeps 4/d of the gradients: 2 + 16/d.

``--use-precision-aware-optimizer`` (``precision``, :class:`~loom.training.state_precision.
StatePrecision`): between steps the masters and Adam's moments are stored in lower precision
(:class:`~loom.training.state_precision.StoredStates`: the fp32 master of a bf16 parameter as
its 2-byte remainder, lossless; the moments as ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``),
unpacked to fp32 for the step (:meth:`DistributedOptimizer.clip_grad_norm`) and packed again
after it: bf16 with bf16 moments keeps 2 + 4 + 6/d bytes per parameter.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Collection, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from loom.parallel.grad_buffer import GradBuffer, flat_buffers
from loom.parallel.mesh import ParallelMesh
from loom.parallel.registry import ParamMeta
from loom.training.muon import MatrixInfo, Muon, matrix_info
from loom.training.param_groups import GroupPlan, build_groups
from loom.training.state_precision import StatePrecision, StoredStates


NORM_BLOCK = 1 << 16  # elements per block of the gradient norm (see _sum_of_squares)
STATE_KEYS = {torch.optim.AdamW: ("exp_avg", "exp_avg_sq"),
              torch.optim.Adam: ("exp_avg", "exp_avg_sq"),  # --no-decoupled-weight-decay
              torch.optim.SGD: ("momentum_buffer",), Muon: ("exp_avg", "exp_avg_sq")}
"""The parameter-shaped states of each inner optimizer class (saved by parameter name; Muon's
own matrices keep ``momentum_buffer``, :meth:`DistributedOptimizer.keys_of`)."""


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """See :func:`_device_sum_of_squares`; gradients on several devices (host-offloaded
    masters' beside the accelerator's) are summed per device, then on ``device``."""
    by_device: dict = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    if len(by_device) <= 1:
        return _device_sum_of_squares(grads, device)
    return sum(_device_sum_of_squares(gs, d).to(device) for d, gs in by_device.items())


def _device_sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``sum_i ||g_i||^2`` in fp64: the L2 norms of blocks of ``NORM_BLOCK`` elements, squared
    and summed in fp64. The blocking is for accuracy: the CPU norm kernel accumulates
    sequentially in fp32, which on a 2 M-element gradient is off by ~2e-5 relative
    (``torch.nn.utils.get_total_norm`` included); 64 Ki blocks bring it under 1e-6
    (tests/unit/test_grad_norm_blocks.py). Each gradient's
    full blocks are one ``[n, NORM_BLOCK]`` view normed along its rows (one kernel), its tail one
    more: a 1.1 B-parameter model's 17 K blocks used to be 17 K views and a 17 K-tensor
    ``_foreach_norm``, ~0.1 s of host time per step on an H200 (benchmarks/gpu_profile.py)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    rows, tails = [], []
    for g in grads:
        flat = g.detach().reshape(-1)
        full = flat.numel() // NORM_BLOCK * NORM_BLOCK
        if full:
            rows.append(torch.linalg.vector_norm(flat[:full].view(-1, NORM_BLOCK), 2.0, dim=1))
        if full < flat.numel():
            tails.append(flat[full:])
    if tails:
        rows.append(torch.stack(torch._foreach_norm(tails, 2.0)))
    return torch.cat(rows).double().square().sum()


def count_zero_entries(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``sum_i (numel(g_i) - nnz(g_i))``: the zero entries of ``grads``, a 0-d fp64 tensor
    (exact below 2^53)."""
    total = sum(g.numel() - int(torch.count_nonzero(g)) for g in grads)
    return torch.tensor(float(total), dtype=torch.float64, device=device)


def reduce_grad_sums(dense: torch.Tensor, experts: Optional[torch.Tensor], mesh: ParallelMesh,
                     dense_sharded: bool, experts_sharded: bool) -> torch.Tensor:
    """A per-element statistic's sums (0-d fp64, e.g. squares) of this rank's gradients that
    count (:meth:`~loom.parallel.mesh.ParallelMesh.counts_for_norm`) -> its value over the
    whole model, each element once (a collective). ``dense``: of the dense parameters (and of
    the experts on the dense grid); ``experts``: of the experts on their own grid
    (:attr:`~loom.parallel.mesh.ParallelMesh.experts_apart`; None otherwise). ``*_sharded``:
    whether this rank holds a shard of the reduced gradients (distributed optimizer, ZeRO-3;
    dense over DP x CP, experts over ``edp``), every rank then adding its own; else only the
    first replica adds (the dense sums need no DP x CP reduction, the experts' one over the
    stage's DP x CP ranks: their expert-DP replicas cut across TP, CP and DP). Then summed over
    the model-parallel group (TP x PP): the expert shards of a stage sit on its t c d ranks,
    so DP x CP then TP x PP covers each once. At most one all-reduce on ``dp_cp`` and one on
    ``mp``."""
    if experts is not None:
        if not (experts_sharded or mesh.expert_coords["edp"] == 0):
            experts = torch.zeros_like(experts)
        if not dense_sharded:  # dense replicas hold equal sums: the first one's
            first = mesh.coords["cp"] == 0 and mesh.coords["dp"] == 0
            dense = dense if first else torch.zeros_like(dense)
        dense = dense + experts
    groups = mesh.groups
    if (dense_sharded or experts is not None) and groups.get("dp_cp") is not None:
        dist.all_reduce(dense, group=groups["dp_cp"])
    if groups["mp"] is not None:
        dist.all_reduce(dense, group=groups["mp"])
    return dense


def buffer_mode(training) -> dict:
    """The gradient-buffer mode this optimizer needs under the training config ``training``:
    ``reduce_scatter`` (``--use-distributed-optimizer``: each rank keeps 1/d of every bucket)
    and ``shard_gradients`` (``--zero-stage 2``: only that 1/d is kept between micro-batches).
    ZeRO-3 (FSDP2) uses no gradient buffer at all."""
    return dict(reduce_scatter=bool(training.use_distributed_optimizer),
                shard_gradients=training.zero_stage == 2)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    """``dist.all_gather_single`` (``all_gather_into_tensor`` on an older torch), looked up at
    call time (tests count the calls)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


class ParamGather:
    """The parameters of a reduce-scattering :class:`GradBuffer` in flat per-bucket buffers of
    the same (padded) layout, and their all-gather after each rank updated its 1/d: one
    ``all_gather_single`` per bucket over the buffer's group. Construction moves every
    parameter's storage into its bucket's buffer (``p.data`` becomes a view)."""

    def __init__(self, grads: GradBuffer):
        self.grads = grads
        self.buffers: dict[int, torch.Tensor] = {}  # id(bucket) -> the parameters' storage
        self.handles: dict[int, object] = {}  # id(bucket) -> pending all-gather
        for b in grads.buckets:
            buf = torch.zeros(b.buffer.numel(), dtype=b.params[0].dtype, device=b.buffer.device)
            for p, o in zip(b.params, b.offsets):
                buf[o:o + p.numel()].copy_(p.detach().reshape(-1))
                p.data = buf[o:o + p.numel()].view_as(p)
            self.buffers[id(b)] = buf

    def start(self, async_op: bool) -> None:
        """All-gather every bucket's parameter buffer from the shards the ranks updated, in the
        order the next forward uses them (the reverse of the buckets', which follow backward):
        a group's collectives run one after another, so the first layer's bucket arrives first
        and the later ones behind the forward (Megatron-Core's order: its first all-gather is
        the first-used bucket's, ``DistributedOptimizer.zero_grad``); ``async_op``: return at
        once (``--overlap-param-gather``), :meth:`wait` or the forward pre-hooks of :meth:`hook`
        wait."""
        g = self.grads
        if g.group is None:
            return
        for b in reversed(g.buckets):
            buf = self.buffers[id(b)]
            per = buf.numel() // g.size
            mine = buf[g.rank * per:(g.rank + 1) * per].clone()
            handle = _all_gather(buf, mine, g.group, async_op=async_op)
            if async_op:
                self.handles[id(b)] = handle

    def wait(self, buckets: Optional[Iterable] = None) -> None:
        """Wait for the pending all-gathers (of ``buckets``, default all)."""
        for b in self.grads.buckets if buckets is None else buckets:
            handle = self.handles.pop(id(b), None)
            if handle is not None:
                handle.wait()

    def hook(self, model: nn.Module) -> None:
        """Forward pre-hooks on every module of ``model`` that holds parameters of this buffer:
        before a module's forward, the all-gathers of its parameters' buckets are waited for
        (so the next forward overlaps the gathers of later buckets)."""
        if self.grads.group is None:
            return
        for module in model.modules():
            mine = {id(b): b for p in module.parameters(recurse=False)
                    if (b := self.grads.bucket_of(p)) is not None}
            if mine:
                module.register_forward_pre_hook(
                    lambda mod, args, bs=list(mine.values()): self.wait(bs))


@dataclass(eq=False)
class _Range:
    name: str
    param: nn.Parameter
    meta: ParamMeta
    reducer: GradBuffer
    lo: int
    hi: int
    master: torch.Tensor  # 1-D fp32, hi - lo elements
    copy: bool  # the master is a copy (16-bit parameter), not a view of the parameter
    expert: bool  # reduced (and sharded) over the expert-data-parallel group
    muon: Optional[MatrixInfo] = None  # orthogonalized by Muon: how its update is whole
    keep: str = "fp32"  # the master between steps: fp32, remainder or scaled (StatePrecision)
    offloaded: bool = False  # --optimizer-cpu-offload: master and states in host memory


class DistributedOptimizer:
    """AdamW on fp32 master ranges of 16-bit and/or DP-sharded parameters (see the module).

    Args: ``named`` (``(name, parameter, ParamMeta)`` of this rank's chunks), ``reducers`` (the
    chunks' gradient buffers, which own the main gradients and the shard ranges; built in
    :func:`buffer_mode`'s mode), ``groups_kw``
    (AdamW keyword arguments: lr, betas, eps, fused), ``weight_decay``, ``mesh`` (norm groups),
    ``sharded`` (the distributed optimizer: the norm is summed over the DP x CP shards),
    ``overlap_param_gather``, ``decoupled`` (``--decoupled-lr``: the extra keys of a third
    group, :func:`loom.training.optimizer.decoupled_group`, holding the parameters whose
    ``id`` is in ``decoupled_params``), ``optim_class`` (``torch.optim.AdamW`` or ``SGD``,
    ``groups_kw`` its keyword arguments), ``timers`` (:class:`~loom.training.timers.Timers`:
    the optimizer's level-1 phases), ``precision`` (``--use-precision-aware-optimizer``'s
    storage, AdamW only; None: fp32), ``offload_fraction`` (``--optimizer-cpu-offload``: the
    first ranges, in order, up to this share of the elements keep an fp32 master and fp32
    states on the CPU, stepped there by the same AdamW, which groups its tensors by device, as
    Megatron's HybridDeviceOptimizer with torch's Adam; their gradients are copied to the host
    before the norm, the weights back after the step; None: no offload).
    ``optim`` is the inner ``torch.optim`` optimizer (LR scheduler, ``param_groups``)."""

    def __init__(self, named, reducers, mesh: ParallelMesh, sharded: bool,
                 overlap_param_gather: bool = False, *, plan: GroupPlan,
                 decoupled_params: Collection[int] = (), optim_class: type = torch.optim.AdamW,
                 optim_kw: Optional[dict] = None, timers=None,
                 precision: Optional[StatePrecision] = None,
                 offload_fraction: Optional[float] = None):
        if precision is not None and optim_class not in (torch.optim.AdamW, torch.optim.Adam):
            raise ValueError("--use-precision-aware-optimizer stores Adam's states only")
        self.mesh, self.sharded, self.overlap_param_gather = mesh, sharded, overlap_param_gather
        self.precision = precision
        self.timers = timers if timers is not None else (lambda name: contextlib.nullcontext())
        optim_kw = dict(optim_kw or {})
        # momentum 0: SGD keeps no state
        self.state_keys = STATE_KEYS[optim_class] if optim_kw.get("momentum", 1) else ()
        self.reducers = flat_buffers(reducers)
        self.gathers = [ParamGather(r) for r in self.reducers if r.reduce_scatter]
        reducer_of = {id(p): r for r in self.reducers for p in r.params}
        apart = mesh.experts_apart
        self.ranges: list[_Range] = []
        placed = []
        named = [(n, p, m) for n, p, m in named if p.requires_grad]
        total = sum(reducer_of[id(p)].shard_range(p)[1] - reducer_of[id(p)].shard_range(p)[0]
                    for _, p, _ in named)
        to_host = (offload_fraction or 0.0) * total  # elements whose optimizer lives on the CPU
        for name, p, meta in named:
            r = reducer_of[id(p)]
            lo, hi = r.shard_range(p)
            flat = p.detach().view(-1)[lo:hi]
            offloaded = to_host > 0 and hi > lo
            to_host -= (hi - lo) * offloaded
            copy = p.dtype != torch.float32 or offloaded
            master = (flat.float().clone() if copy else flat).to("cpu" if offloaded else
                                                                 flat.device)
            index = plan.index(name, p, id(p) in decoupled_params)
            muon = matrix_info(name, meta, mesh) if plan.kinds[index].muon else None
            keep = precision.master_mode(p.dtype) \
                if precision is not None and copy and not offloaded else "fp32"
            self.ranges.append(_Range(name, p, meta, r, lo, hi, master, copy,
                                      apart and meta.expert_parallel, muon, keep, offloaded))
            placed.append((index, master))
        groups = build_groups(plan, placed, mesh.device)
        if optim_class is Muon:  # whole-matrix updates from the ranges (_orthogonalize)
            optim_kw["orthogonalize"] = self._orthogonalize
        self.optim = optim_class(groups, **optim_kw)
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        self.steps = 0
        # --use-precision-aware-optimizer: the masters and moments as stored between steps
        self.stored = StoredStates(precision, self.ranges, self.optim.state, self.state_keys)
        self.stored.pack()

    def keys_of(self, rg: _Range) -> tuple:
        """The parameter-shaped states of ``rg``'s parameter (Muon's momentum, or the other
        optimizer's)."""
        return ("momentum_buffer",) if rg.muon is not None else self.state_keys

    def _orthogonalize(self, items: list) -> list:
        """:class:`~loom.training.muon.Muon`'s step 3 on master ranges: ``[(master, update
        range)]`` -> this rank's range of each orthogonalized whole matrix (None where it holds
        none). A matrix split over the DP shards is summed from its ranges (zeros elsewhere:
        exact) by one all-reduce over the reducer's group; one inside this rank's shard needs
        no communication. Collective over the DP (and TP) groups: every rank passes every
        Muon range, in the same order."""
        by_master = {id(rg.master): rg for rg in self.ranges}
        out = []
        for master, u in items:
            rg = by_master[id(master)]
            p, r = rg.param, rg.reducer
            whole = u
            if r.reduce_scatter and r.group is not None:
                owners = r.shard_owners(p)
                if len(owners) > 1:
                    whole = torch.zeros(p.numel(), dtype=u.dtype, device=u.device)
                    whole[rg.lo:rg.hi] = u
                    dist.all_reduce(whole, group=r.group)
            if rg.hi == rg.lo:
                out.append(None)
                continue
            orth = rg.muon.orthogonalize(whole.view(p.shape), self.optim.settings)
            out.append(orth.reshape(-1)[rg.lo:rg.hi])
        return out

    # -- one step ---------------------------------------------------------------------------------
    def _attach_grads(self, inv_scale: float) -> list[torch.Tensor]:
        grads = []
        for rg in self.ranges:
            g = rg.reducer.shard_grad(rg.param)  # to the host for an offloaded master
            rg.master.grad = g if g.dtype == torch.float32 and g.device == rg.master.device \
                else g.to(rg.master.device, torch.float32)
            grads.append(rg.master.grad)
        if inv_scale != 1.0 and grads:
            torch._foreach_mul_(grads, inv_scale)
        return grads

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients, each element once: squares of the masters'
        gradient ranges that count (:meth:`ParamMeta.counts_for_norm`), summed over the DP x
        CP shards (expert ranges over their expert-data-parallel shards) and the
        model-parallel group (:func:`reduce_grad_sums`); fp64 sums, one scalar all-reduce per
        group. 0-d fp32."""
        return self._summed(lambda r: r.master.grad, _sum_of_squares).sqrt().float()

    def count_zeros(self) -> int:
        """``--log-num-zeros-in-grad``: zero entries of the reduced main gradients, each element
        once, summed like :meth:`grad_norm` (Megatron's ``count_zeros_fp32``)."""
        return int(self._summed(lambda r: r.reducer.shard_grad(r.param), count_zero_entries))

    def _summed(self, grad_of, stat) -> torch.Tensor:
        """``stat(gradients, device)`` (a 0-d fp64 sum) over the ranges that count, reduced
        over the DP x CP shards, the expert groups and the model-parallel group."""
        dev, counts = self.mesh.device, self.mesh.counts_for_norm
        dense = [grad_of(r) for r in self.ranges if not r.expert
                 and counts(r.meta) and r.hi > r.lo]
        experts = [grad_of(r) for r in self.ranges if r.expert
                   and counts(r.meta) and r.hi > r.lo]
        experts = stat(experts, dev) if self.mesh.experts_apart else None
        return reduce_grad_sums(stat(dense, dev), experts, self.mesh, self.sharded, False)

    def clip_grad_norm(self, max_norm: float, inv_scale: float = 1.0) -> float:
        """Attach the reduced main gradients to the masters (times ``inv_scale``: the fp16 loss
        scale's inverse), clip them to global norm ``max_norm`` (<= 0: no clipping); returns the
        norm before clipping (inf/NaN when any gradient is)."""
        self.finish_param_gather()
        self.stored.unpack()  # --use-precision-aware-optimizer: fp32 masters and moments
        with self.timers("optimizer-copy-to-main-grad"):
            grads = self._attach_grads(inv_scale)
        with self.timers("optimizer-clip-main-grad"):
            norm = self.grad_norm()
            value = float(norm)
            if max_norm > 0 and math.isfinite(value) and max_norm / (value + 1e-6) < 1.0 and \
                    grads:
                torch._foreach_mul_(grads, max_norm / (value + 1e-6))
        return value

    @torch.no_grad()
    def step(self) -> None:
        """AdamW (or SGD) on the masters, masters -> parameters, parameter all-gather
        (asynchronous with ``--overlap-param-gather``). Call :meth:`clip_grad_norm` first."""
        with self.timers("optimizer-inner-step"):
            self.optim.step()
        self.steps += 1
        with self.timers("optimizer-copy-main-to-model-params"):
            self.copy_masters_to_params()
            self.stored.pack()
        with self.timers("params-all-gather"):
            for g in self.gathers:
                g.start(async_op=self.overlap_param_gather)
        for rg in self.ranges:
            rg.master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for rg in self.ranges:
            rg.master.grad = None

    @torch.no_grad()
    def copy_masters_to_params(self) -> None:
        """Parameters from the (unpacked) masters; a remainder-kept master's parameter is
        written by :meth:`StoredStates.pack`."""
        for rg in self.ranges:
            if rg.copy and rg.hi > rg.lo and rg.keep != "remainder":
                rg.param.detach().view(-1)[rg.lo:rg.hi].copy_(rg.master)

    @torch.no_grad()
    def copy_params_to_masters(self) -> None:
        """Masters from the parameters (after loading weights without optimizer states)."""
        with self.stored.unpacked():
            for rg in self.ranges:
                if rg.copy:
                    rg.master.copy_(rg.param.detach().view(-1)[rg.lo:rg.hi])

    def finish_param_gather(self) -> None:
        """Wait for every pending parameter all-gather (before reading the parameters)."""
        for g in self.gathers:
            g.wait()

    def hook_param_gather(self, chunks: Iterable[nn.Module]) -> None:
        """``--overlap-param-gather``: each bucket's all-gather is waited for by a forward
        pre-hook of the first module of ``chunks`` that uses it (:meth:`ParamGather.hook`)."""
        for chunk in chunks:
            for g in self.gathers:
                g.hook(chunk)

    # -- checkpoints: states by parameter name at TP-local full shape -----------------------------
    def _full(self, values: dict, wanted=None) -> dict:
        """``{id(range): 1-D tensor}`` -> ``{name: full flat fp32 tensor}``: the DP shards
        gathered per bucket (one ``all_gather_single`` per bucket over the reducer's group)
        for the ranges ``wanted(range)`` selects (default all; a bucket holding none is
        skipped: the choice is a parameter's, the same on every rank of the group)."""
        out = {}
        by_param = {id(rg.param): rg for rg in self.ranges}
        for r in self.reducers:
            for b in r.buckets:
                mine = [(p, o) for p, o in zip(b.params, b.offsets)
                        if wanted is None or wanted(by_param[id(p)])]
                if not mine:
                    continue
                per = b.buffer.numel() // r.size if r.reduce_scatter else b.buffer.numel()
                base = r.rank * per if r.reduce_scatter else 0
                local = torch.zeros(per, dtype=torch.float32, device=b.buffer.device)
                for p, o in mine:
                    rg = by_param[id(p)]
                    if rg.hi > rg.lo:
                        local[o + rg.lo - base:o + rg.hi - base] = values[id(rg)]
                full = local
                if r.reduce_scatter and r.group is not None:
                    full = torch.empty(per * r.size, dtype=torch.float32, device=local.device)
                    _all_gather(full, local, r.group, async_op=False)
                for p, o in mine:
                    out[by_param[id(p)].name] = full[o:o + p.numel()].view_as(p).cpu()
        return out

    def state_by_name(self, names: set) -> dict:
        """``{name: {"step", "exp_avg", "exp_avg_sq"[, "master_param"]}}`` (SGD's and Muon's
        matrices: ``{"momentum_buffer"[, "master_param"]}``) for ``names``, each at the
        parameter's (TP-local) shape; collective over every reducer's group (all ranks of the DP
        x CP group must call it). Empty before the first step."""
        if self.steps == 0:
            return {}
        with self.stored.unpacked():
            return self._state_by_name(names)

    def _state_by_name(self, names: set) -> dict:
        keys = sorted({k for rg in self.ranges for k in self.keys_of(rg)})
        fulls = {k: self._full({id(rg): self.optim.state[rg.master][k] for rg in self.ranges
                                if rg.hi > rg.lo and k in self.keys_of(rg)},
                               lambda rg, k=k: k in self.keys_of(rg)) for k in keys}
        masters = self._full({id(rg): rg.master for rg in self.ranges}) \
            if any(rg.copy for rg in self.ranges) else {}
        out = {}
        for rg in self.ranges:
            if rg.name not in names or not (self.keys_of(rg) or masters):
                continue
            st = {k: fulls[k][rg.name] for k in self.keys_of(rg)}
            if "exp_avg" in st:
                st["step"] = torch.tensor(float(self.steps))
            if masters:
                st["master_param"] = masters[rg.name]
            out[rg.name] = st
        return out

    @torch.no_grad()
    def load_state_by_name(self, states: dict) -> None:
        """Adam states (and fp32 masters) from ``{name: {key: tensor at the parameter's shape}}``;
        a parameter without ``master_param`` takes its master from its (loaded) weights."""
        self.stored.unpack()
        for rg in self.ranges:
            st = states.get(rg.name)
            if rg.copy:
                src = st.get("master_param") if st else None
                src = rg.param.detach() if src is None else src
                rg.master.copy_(src.reshape(-1)[rg.lo:rg.hi].to(rg.master))
            elif st and "master_param" in st:  # a 16-bit run's exact weights
                rg.master.copy_(st["master_param"].reshape(-1)[rg.lo:rg.hi].to(rg.master))
            keys = self.keys_of(rg)
            if not st or not keys or keys[0] not in st:
                continue
            state = {k: st[k].reshape(-1)[rg.lo:rg.hi].to(rg.master).clone() for k in keys}
            if "exp_avg" in state:  # Adam's step count (SGD has none: loom counts its own)
                step = float(st.get("step", 0))
                state["step"] = torch.tensor(step, dtype=torch.float32, device=rg.master.device)
                self.steps = int(step)
            self.steps = max(self.steps, 1)
            self.optim.state[rg.master] = state
        self.copy_masters_to_params()
        self.stored.pack()


def param_bytes(optimizer: DistributedOptimizer) -> dict:
    """Bytes held on this rank by kind: ``params`` (the model's parameters), ``main_grads``
    (gradient buffers and ZeRO-2 shards), ``master`` (fp32 master copies; 0 for fp32
    parameters, whose masters are views), ``optimizer`` (Adam's exp_avg and exp_avg_sq, SGD's
    momentum buffer), each as stored (``--use-precision-aware-optimizer``: between steps, in its
    storage dtype; the per-tensor fp32 scales aside); ``host``: the masters and states of the
    ranges ``--optimizer-cpu-offload`` keeps in host memory (not in ``master``/``optimizer``)."""
    params = {id(rg.param): rg.param for rg in optimizer.ranges}
    out = {"params": sum(p.numel() * p.element_size() for p in params.values()),
           "main_grads": sum(r.grad_bytes() for r in optimizer.reducers),
           "master": 0, "optimizer": 0, "host": 0}
    for rg in optimizer.ranges:
        slot = optimizer.stored.packed.get(id(rg), {})
        master = 0 if not rg.copy else (slot["master"].nbytes() if "master" in slot
                                        else rg.master.numel() * 4)
        st = optimizer.optim.state.get(rg.master, {})
        states = sum(v.nbytes() for k, v in slot.items() if k != "master") + sum(
            v.numel() * v.element_size() for k, v in st.items()
            if k in optimizer.state_keys or k == "momentum_buffer")
        if rg.offloaded:
            out["host"] += master + states
        else:
            out["master"] += master
            out["optimizer"] += states
    return out
