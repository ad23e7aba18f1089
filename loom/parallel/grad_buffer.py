"""The gradient buffer of data parallelism: gradients averaged over the data(-x-context)-parallel
group in buckets (Megatron-Core's ``DistributedDataParallel`` / ``ParamAndGradBuffer``,
``megatron/core/distributed/param_and_grad_buffer.py``; the gradient half only: the parameters'
shards, fp32 masters, Adam states and the parameter all-gather are the distributed optimizer's,
:mod:`loom.training.distributed_optimizer`).

Each parameter owns a slice of a flat per-bucket buffer. Buckets are filled in the reverse order
of parameter registration (roughly the order backward produces gradients); when backward has
accumulated the last gradient of a bucket (``register_post_accumulate_grad_hook``), the bucket is
divided by the group size and its reduction is launched asynchronously, so communication
overlaps the rest of backward. :meth:`GradBuffer.finish_grad_sync` waits for all of them
before the optimizer step. During gradient accumulation, :meth:`GradBuffer.no_sync` suppresses
the reduction until the last micro-batch (as ``torch.nn.parallel.DistributedDataParallel``).
``overlap=False`` (the trainer's default, Megatron's ``--overlap-grad-reduce`` off) launches no
reduction during backward: :meth:`GradBuffer.finish_grad_sync` reduces the buckets one after the
other.

The per-bucket reduction is an all-reduce, or, when the optimizer is sharded
(``reduce_scatter=True``, which the distributed optimizer asks for: ZeRO stage 1, Rajbhandari et
al. 2020 sec. 5.1), a reduce-scatter (``reduce_scatter_single``) of the bucket padded to a
multiple of d, after which rank r holds the reduced r-th 1/d of every bucket
(:meth:`GradBuffer.shard_range`). ``shard_gradients=True`` (ZeRO stage 2, sec. 5.2) reduce-scatters
every micro-batch's gradients into a persistent 1/d shard and frees the full bucket buffer
(its storage shrinks to 0 bytes until the next backward); with ``overlap`` each bucket's
reduce-scatter is launched by its last gradient's hook during backward, as the all-reduce is,
and waited for when the micro-batch's backward ends. ZeRO-3 is not this class: FSDP2 shards
parameters and gradients itself (:mod:`loom.parallel.fsdp`).

Main gradients (Megatron-LM's ``main_grad``; Micikevicius et al. 2018, "Mixed precision
training"): with 16-bit parameters, or with ``reduce_scatter=True``, the buffers are the fp32 main
gradients and parameters never keep a ``.grad``: each hook adds autograd's (16-bit) gradient
into the parameter's buffer slice and frees it; read them with :meth:`GradBuffer.main_grad` /
:meth:`GradBuffer.shard_grad`.

No per-step zeroing and no add on the first micro-batch: :meth:`GradBuffer.zero_grad` only
sets ``.grad = None``; the first gradient of a step is produced by autograd as a fresh tensor
(``AccumulateGrad`` moves it into ``.grad``) and the hook copies it into the parameter's buffer
slice and makes ``.grad`` that slice (one copy instead of a zeroing pass plus an add); later
micro-batches accumulate in place. Without a group (one DP rank) there are no buffers at all:
``.grad`` is autograd's own tensor. Parameters that received no gradient get zeros in
:meth:`GradBuffer.finish_grad_sync`, so every parameter has a gradient for the optimizer.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

MIN_BUCKET_PER_RANK = 250_000  # elements; a ring all-reduce moves bucket / d per step
MAX_BUCKET = 40_000_000  # Megatron-LM's default bucket size (elements)
TARGET_BUCKETS = 4  # at least ~3/4 of the gradient's all-reduce overlaps backward


def default_bucket_size(num_elements: int, dp_size: int) -> int:
    """Elements per bucket: ``clamp(ceil(P / 4), 250 000 d, 40 M)`` for P gradient elements and
    d data-parallel ranks. Four buckets let the first three all-reduces overlap the rest of
    backward even for small models (a single 40 M bucket, Megatron's default, never overlaps
    below 40 M parameters); the floor grows with d as Megatron's ``max(40 M, 1 M d)`` does, since
    a ring all-reduce splits the bucket into d pieces and each must stay bandwidth-bound
    (a 1 MB piece is, for gloo on this host; the planner's alpha-beta fit)."""
    return max(MIN_BUCKET_PER_RANK * max(dp_size, 1),
               min(MAX_BUCKET, math.ceil(max(num_elements, 1) / TARGET_BUCKETS)))


@dataclass(eq=False)  # identity: buckets hold tensors
class Bucket:
    params: list
    buffer: torch.Tensor  # gradients (fp32 main grads), padded to a multiple of d when sharded
    views: list
    offsets: list  # each parameter's first element in the buffer
    pending: int = 0
    handle: Optional[object] = None
    launched: bool = False
    shard: Optional[torch.Tensor] = None  # ZeRO-2: this rank's reduced 1/d, kept
    has_shard: bool = False  # ZeRO-2: the shard holds this step's gradients
    index: int = 0  # its place in the buffer's buckets


class GradBuffer:
    """Bucketed gradient reduction (all-reduce, or reduce-scatter) for ``params`` over ``group``.

    Args: ``params`` (trainable parameters), ``group`` (``mesh.groups["dp_cp"]``; None = one rank,
    nothing to reduce), ``bucket_size`` (elements per bucket, ``--ddp-bucket-size``; None or
    0 = :func:`default_bucket_size`), ``grad_dtype`` (the buffers' dtype, fp32), ``overlap``
    (launch a bucket's reduction in backward when its last gradient arrives,
    ``--overlap-grad-reduce``), ``reduce_scatter`` (buckets padded to a multiple of d and
    reduce-scattered into 1/d shards: asked for by the distributed optimizer, whose parameter
    buffers take the same layout), ``shard_gradients`` (ZeRO-2: keep only the shard),
    ``own_bucket`` (parameters that get a bucket of their own: the pipeline-shared embedding,
    so its shard ranges agree on the first and last stage), ``scale`` (multiplies the average: 1/e for
    expert gradients reduced over the expert-data-parallel group).
    Call :meth:`zero_grad` instead of the optimizer's ``zero_grad``. Parameters whose dtype
    differs from ``grad_dtype`` (16-bit) always use main gradients. ``on_launch(index,
    buffer)``, when set, sees each bucket's local gradients just before its reduction (Megatron's
    ``check_grads`` in ``start_grad_sync``: the rerun state machine's bucket validations).
    """

    def __init__(self, params: Iterable[nn.Parameter], group: Optional[dist.ProcessGroup],
                 bucket_size: Optional[int] = None, grad_dtype: torch.dtype = torch.float32, *,
                 overlap: bool = True, reduce_scatter: bool = False,
                 shard_gradients: bool = False, own_bucket: Iterable[nn.Parameter] = (),
                 scale: float = 1.0):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.params = [p for p in params if p.requires_grad]
        self.overlap, self.reduce_scatter, self.scale = overlap, reduce_scatter, scale
        self.shard_gradients = shard_gradients and reduce_scatter and self.size > 1
        self.main_grads = reduce_scatter or any(p.dtype != grad_dtype for p in self.params)
        self.sync_enabled = True
        self.deferring = False  # in deferred(): gradients accumulate, nothing is launched
        self.buckets: list[Bucket] = []
        self.on_launch: Optional[Callable[[int, torch.Tensor], None]] = None
        self._bucket_of: dict[int, Bucket] = {}
        self._index_of: dict[int, int] = {}
        if group is not None or self.main_grads:
            self.bucket_size = bucket_size or default_bucket_size(
                sum(p.numel() for p in self.params), self.size)
            alone = {id(p) for p in own_bucket}
            current, count = [], 0
            for p in reversed(self.params):
                if id(p) in alone:
                    self._add_bucket([p], grad_dtype)
                    continue
                current.append(p)
                count += p.numel()
                if count >= self.bucket_size:
                    self._add_bucket(current, grad_dtype)
                    current, count = [], 0
            if current:
                self._add_bucket(current, grad_dtype)
            # the hook holds the buffer weakly: a parameter's hooks live in autograd's C++ node,
            # where Python's collector cannot see the cycle parameter -> hook -> buffer ->
            # parameter, so a strong hook kept every bucket (and the model) alive after the
            # trainer was dropped (measured on the H200: +12 GiB per Trainer built in a process)
            hook = functools.partial(_grad_ready, weakref.ref(self))
            for p in self.params:
                p.register_post_accumulate_grad_hook(hook)
        self.zero_grad()

    def _add_bucket(self, params: list, dtype: torch.dtype) -> None:
        numel = sum(p.numel() for p in params)
        padded = -(-numel // self.size) * self.size if self.reduce_scatter else numel
        buf = torch.zeros(padded, dtype=dtype, device=params[0].device)
        views, offsets, offset = [], [], 0
        for p in params:
            views.append(buf[offset:offset + p.numel()].view_as(p))
            offsets.append(offset)
            offset += p.numel()
        b = Bucket(params=params, buffer=buf, views=views, offsets=offsets, pending=len(params),
                   index=len(self.buckets))
        if self.shard_gradients:
            b.shard = torch.zeros(padded // self.size, dtype=dtype, device=buf.device)
        self.buckets.append(b)
        for i, p in enumerate(params):
            self._bucket_of[id(p)] = b
            self._index_of[id(p)] = i

    # -- where a parameter's gradient lives ------------------------------------------------------
    def shard_range(self, p: torch.Tensor) -> tuple[int, int]:
        """``(lo, hi)``: the elements ``p.view(-1)[lo:hi]`` whose reduced gradient this rank
        holds after the reduce-scatter, the r-th 1/d of ``p``'s bucket (the distributed
        optimizer owns the same range: its fp32 master and Adam states);
        ``(0, numel)`` without sharding; ``lo == hi`` when this rank owns none of ``p``."""
        if not self.reduce_scatter or id(p) not in self._bucket_of:
            return 0, p.numel()
        b = self._bucket_of[id(p)]
        o = b.offsets[self._index_of[id(p)]]
        per = b.buffer.numel() // self.size if not self.shard_gradients else b.shard.numel()
        lo = min(max(self.rank * per, o), o + p.numel()) - o
        hi = max(min((self.rank + 1) * per, o + p.numel()), o) - o
        return lo, max(lo, hi)

    def shard_owners(self, p: torch.Tensor) -> range:
        """The ranks of the group whose :meth:`shard_range` of ``p`` is not empty (this rank
        alone without sharding)."""
        if not self.reduce_scatter or id(p) not in self._bucket_of or p.numel() == 0:
            return range(self.rank, self.rank + 1)
        b = self._bucket_of[id(p)]
        o = b.offsets[self._index_of[id(p)]]
        per = b.buffer.numel() // self.size if not self.shard_gradients else b.shard.numel()
        return range(o // per, (o + p.numel() - 1) // per + 1)

    def main_grad(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """``p``'s gradient buffer slice (shape of ``p``; fp32 main gradient), or ``p.grad``
        without buffers; None under ZeRO-2 (the full buffer is freed)."""
        if id(p) not in self._bucket_of:
            return p.grad
        if self.shard_gradients:
            return None
        b = self._bucket_of[id(p)]
        return b.views[self._index_of[id(p)]]

    def shard_grad(self, p: torch.Tensor) -> torch.Tensor:
        """The reduced gradient of ``p.view(-1)[lo:hi]`` (:meth:`shard_range`), 1-D, a view into
        the buffer (ZeRO-2: into the kept shard); the whole flattened gradient without
        sharding. Valid after :meth:`finish_grad_sync`."""
        lo, hi = self.shard_range(p)
        if id(p) not in self._bucket_of:
            return p.grad.view(-1)
        b = self._bucket_of[id(p)]
        o = b.offsets[self._index_of[id(p)]]
        if self.shard_gradients:
            base = self.rank * b.shard.numel()
            return b.shard[o + lo - base:o + hi - base]
        return b.buffer[o + lo:o + hi]

    def grad_bytes(self) -> int:
        """Bytes of gradient storage held now (buffers and ZeRO-2 shards)."""
        return sum(b.buffer.untyped_storage().nbytes() + (b.shard.numel() * b.shard.element_size()
                                                          if b.shard is not None else 0)
                   for b in self.buckets)

    # -- backward ---------------------------------------------------------------------------------
    def _adopt(self, p: torch.Tensor) -> None:
        """Move autograd's gradient into the buffer. Main gradients: add it to the slice and
        free it. Otherwise make ``p.grad`` the slice: copy autograd's first gradient of the step
        into it, or zeros if there was none."""
        b = self._bucket_of[id(p)]
        view = b.views[self._index_of[id(p)]]
        if self.main_grads:
            if self.shard_gradients and b.buffer.untyped_storage().nbytes() == 0:
                b.buffer.untyped_storage().resize_(b.buffer.numel() * b.buffer.element_size())
                b.buffer.zero_()
            if p.grad is not None:
                view.add_(p.grad)
                p.grad = None
            return
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        else:
            return
        p.grad = view

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        self._adopt(p)
        # ZeRO-2 reduces every micro-batch, so its buckets launch with or without no_sync
        if self.deferring or not self.overlap or not (self.sync_enabled or self.shard_gradients):
            return
        b = self._bucket_of[id(p)]
        b.pending -= 1
        if b.pending == 0:
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        b.launched = True
        if self.on_launch is not None:
            self.on_launch(b.index, b.buffer)
        if self.group is not None:
            b.buffer.div_(self.size)
        if self.scale != 1.0:
            b.buffer.mul_(self.scale)
        if self.group is None:
            return
        if not self.reduce_scatter:
            b.handle = dist.all_reduce(b.buffer, group=self.group, async_op=True)
            return
        per = b.buffer.numel() // self.size
        b.handle = _reduce_scatter(b.buffer[self.rank * per:(self.rank + 1) * per], b.buffer,
                                   self.group, async_op=True)

    def _reduce_into_shards(self) -> None:
        """ZeRO-2, at the end of each micro-batch's backward: reduce-scatter the buckets not
        launched during it (all of them without ``overlap``; in bucket order, the same calls on
        every rank), wait for every bucket's reduce-scatter, add this rank's 1/d to the kept
        shard and free the full buffer. With ``overlap`` a bucket's reduce-scatter was launched
        asynchronously by the hook of its last gradient, overlapping the rest of backward."""
        for b in self.buckets:
            if b.launched:
                continue
            if b.buffer.untyped_storage().nbytes() == 0:  # no gradient since the last one
                b.buffer.untyped_storage().resize_(b.buffer.numel() * b.buffer.element_size())
                b.buffer.zero_()
            self._launch(b)
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
            per = b.shard.numel()
            mine = b.buffer[self.rank * per:(self.rank + 1) * per]
            if b.has_shard:
                b.shard.add_(mine)
            else:
                b.shard.copy_(mine)
            b.has_shard, b.launched, b.handle, b.pending = True, False, None, len(b.params)
            b.buffer.untyped_storage().resize_(0)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (all but the last micro-batch); under ZeRO-2 the
        micro-batch's gradients are reduce-scattered into the shards when it ends."""
        prev, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = prev
            if self.shard_gradients:
                self._reduce_into_shards()

    @contextlib.contextmanager
    def deferred(self):
        """Gradients that arrive inside accumulate but launch no reduction, not even ZeRO-2's
        per-micro-batch one: a zero-bubble schedule's input-gradient pass (B) of a micro-batch
        whose weight-gradient pass (W, in ``no_sync`` or not) comes later. A bucket with such a
        gradient is reduced when its micro-batch (ZeRO-2) or the step ends."""
        prev, self.deferring = self.deferring, True
        try:
            yield
        finally:
            self.deferring = prev

    def finish_grad_sync(self) -> None:
        """Give parameters without a gradient zeros, launch the buckets not launched during
        backward (all of them without ``overlap``; those with unused parameters), then wait for
        every reduction."""
        if not self.buckets:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif self.scale != 1.0:
                    p.grad.mul_(self.scale)
            return
        if self.shard_gradients:
            self._reduce_into_shards()
            return
        for b in self.buckets:
            if not b.launched:
                for p in b.params:
                    self._adopt(p)
                self._launch(b)
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
            b.handle, b.launched, b.pending = None, False, len(b.params)

    def zero_grad(self) -> None:
        """Forget this step's gradients: ``.grad = None`` (no pass over memory), or with main
        gradients zero the buffers (ZeRO-2: the shards)."""
        for p in self.params:
            p.grad = None
        for b in self.buckets:
            b.pending, b.launched, b.handle = len(b.params), False, None
            if self.main_grads and not self.shard_gradients:
                b.buffer.zero_()
            b.has_shard = False

    def bucket_of(self, p: torch.Tensor) -> Optional[Bucket]:
        """The bucket holding ``p``'s gradient, or None (no buffers, or not in this buffer)."""
        return self._bucket_of.get(id(p))


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    """``dist.reduce_scatter_single`` (``reduce_scatter_tensor`` on an older torch), looked up
    at call time (tests count the calls)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


def flat_buffers(buffers) -> list[GradBuffer]:
    """The :class:`GradBuffer` objects of per-chunk gradient reducers (a
    :class:`~loom.parallel.expert.ReducerGroup` holds several: dense and expert parameters;
    FSDP2's :class:`~loom.parallel.fsdp.FSDPGradients` is returned as it is)."""
    return [r for x in buffers for r in getattr(x, "reducers", [x])]


def _grad_ready(buffer: "weakref.ref[GradBuffer]", p: torch.Tensor) -> None:
    """A parameter's post-accumulate-grad hook: :meth:`GradBuffer._on_grad_ready` of the buffer,
    while it exists (a dropped buffer's parameters accumulate plain ``.grad`` again)."""
    owner = buffer()
    if owner is not None:
        owner._on_grad_ready(p)
