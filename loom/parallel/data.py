"""Data parallelism: gradients averaged over the data(-x-context)-parallel group in buckets.

Each parameter owns a slice of a flat per-bucket buffer (Megatron-LM's contiguous grad buffer,
``megatron/core/distributed/param_and_grad_buffer.py``). Buckets are filled in the reverse order
of parameter registration (roughly the order backward produces gradients); when backward has
accumulated the last gradient of a bucket (``register_post_accumulate_grad_hook``), the bucket is
divided by the group size and its all-reduce is launched asynchronously, so communication
overlaps the rest of backward. :meth:`GradientReducer.finish_grad_sync` waits for all of them
before the optimizer step. During gradient accumulation, :meth:`no_sync` suppresses the
reduction until the last micro-batch (as ``torch.nn.parallel.DistributedDataParallel``).

No per-step zeroing and no add on the first micro-batch: :meth:`GradientReducer.zero_grad` only
sets ``.grad = None``; the first gradient of a step is produced by autograd as a fresh tensor
(``AccumulateGrad`` moves it into ``.grad``) and the hook copies it into the parameter's buffer
slice and makes ``.grad`` that slice (one copy instead of a zeroing pass plus an add); later
micro-batches accumulate in place. Without a group (one DP rank) there are no buffers at all:
``.grad`` is autograd's own tensor. Parameters that received no gradient get zeros in
:meth:`finish_grad_sync`, so every parameter has a gradient for the optimizer, as before.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterable, Optional

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
class _Bucket:
    params: list
    buffer: torch.Tensor
    views: list
    pending: int = 0
    handle: Optional[object] = None
    launched: bool = False


class GradientReducer:
    """Bucketed, backward-overlapped gradient all-reduce for ``params`` over ``group``.

    Args: ``params`` (trainable parameters), ``group`` (``mesh.groups["dp_cp"]``; None = one rank,
    nothing to reduce), ``bucket_size`` (elements per bucket, ``--ddp-bucket-size``; None or
    0 = :func:`default_bucket_size`), ``grad_dtype`` (the buffers' dtype, fp32).
    Call :meth:`zero_grad` instead of the optimizer's ``zero_grad``.

    Raises ValueError when a parameter's dtype differs from ``grad_dtype``.
    """

    def __init__(self, params: Iterable[nn.Parameter], group: Optional[dist.ProcessGroup],
                 bucket_size: Optional[int] = None, grad_dtype: torch.dtype = torch.float32):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.params = [p for p in params if p.requires_grad]
        odd = sorted({str(p.dtype) for p in self.params if p.dtype != grad_dtype})
        if odd:
            raise ValueError(f"GradientReducer keeps {grad_dtype} gradients; parameters of dtype "
                             f"{', '.join(odd)} need grad_dtype to match (loom keeps fp32 master "
                             f"weights and uses autocast for --bf16)")
        self.sync_enabled = True
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._view_of: dict[int, torch.Tensor] = {}
        if group is not None:
            self.bucket_size = bucket_size or default_bucket_size(
                sum(p.numel() for p in self.params), self.size)
            current, count = [], 0
            for p in reversed(self.params):
                current.append(p)
                count += p.numel()
                if count >= self.bucket_size:
                    self._add_bucket(current, grad_dtype)
                    current, count = [], 0
            if current:
                self._add_bucket(current, grad_dtype)
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.zero_grad()

    def _add_bucket(self, params: list, dtype: torch.dtype) -> None:
        numel = sum(p.numel() for p in params)
        buf = torch.empty(numel, dtype=dtype, device=params[0].device)  # written before read
        views, offset = [], 0
        for p in params:
            views.append(buf[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        b = _Bucket(params=params, buffer=buf, views=views, pending=len(params))
        self.buckets.append(b)
        for p, v in zip(params, views):
            self._bucket_of[id(p)] = b
            self._view_of[id(p)] = v

    def _adopt(self, p: torch.Tensor) -> None:
        """Make ``p.grad`` its buffer slice: copy autograd's first gradient of the step into it,
        or zeros if there was none."""
        view = self._view_of[id(p)]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        else:
            return
        p.grad = view

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        self._adopt(p)
        if not self.sync_enabled:
            return
        b = self._bucket_of[id(p)]
        b.pending -= 1
        if b.pending == 0:
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        b.buffer.div_(self.size)
        b.handle = dist.all_reduce(b.buffer, group=self.group, async_op=True)
        b.launched = True

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (all but the last micro-batch)."""
        prev, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = prev

    def finish_grad_sync(self) -> None:
        """Give parameters without a gradient zeros, launch buckets whose gradients never all
        arrived (unused parameters), then wait for every all-reduce."""
        if self.group is None:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return
        for b in self.buckets:
            if not b.launched:
                for p in b.params:
                    self._adopt(p)
                self._launch(b)
        for b in self.buckets:
            b.handle.wait()
            b.handle, b.launched, b.pending = None, False, len(b.params)

    def zero_grad(self) -> None:
        """Forget this step's gradients (``.grad = None``; no pass over memory)."""
        for p in self.params:
            p.grad = None
        for b in self.buckets:
            b.pending, b.launched, b.handle = len(b.params), False, None
