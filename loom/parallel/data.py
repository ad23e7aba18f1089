"""Data parallelism: gradients averaged over the data(-x-context)-parallel group in buckets.

Every parameter's ``.grad`` is a view into a flat per-bucket buffer. Buckets are filled in the
reverse order of parameter registration (roughly the order backward produces gradients); when
backward has accumulated the last gradient of a bucket (``register_post_accumulate_grad_hook``),
the bucket is divided by the group size and its all-reduce is launched asynchronously, so
communication overlaps the rest of backward. :meth:`GradientReducer.finish_grad_sync` waits for
all of them before the optimizer step. During gradient accumulation, :meth:`no_sync` suppresses
the reduction until the last micro-batch (as ``torch.nn.parallel.DistributedDataParallel``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class _Bucket:
    params: list
    buffer: torch.Tensor
    pending: int = 0
    handle: Optional[object] = None
    launched: bool = False


class GradientReducer:
    """Bucketed, backward-overlapped gradient all-reduce for ``params`` over ``group``.

    Args: ``params`` (trainable parameters), ``group`` (``mesh.groups["dp_cp"]``; None = one rank,
    nothing to reduce), ``bucket_size`` (elements per bucket, ``--ddp-bucket-size``).
    Gradients are kept in fp32 buffers (``grad_dtype``). Call :meth:`zero_grad` instead of the
    optimizer's ``zero_grad`` (which would detach the views).
    """

    def __init__(self, params: Iterable[nn.Parameter], group: Optional[dist.ProcessGroup],
                 bucket_size: int = 40_000_000, grad_dtype: torch.dtype = torch.float32):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.params = [p for p in params if p.requires_grad]
        self.sync_enabled = True
        self.buckets: list[_Bucket] = []
        current, count = [], 0
        for p in reversed(self.params):
            current.append(p)
            count += p.numel()
            if count >= bucket_size:
                self._add_bucket(current, grad_dtype)
                current, count = [], 0
        if current:
            self._add_bucket(current, grad_dtype)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.zero_grad()

    def _add_bucket(self, params: list, dtype: torch.dtype) -> None:
        odd = sorted({str(p.dtype) for p in params if p.dtype != dtype})
        if odd:
            raise ValueError(f"GradientReducer keeps {dtype} gradients; parameters of dtype "
                             f"{', '.join(odd)} need grad_dtype to match (loom keeps fp32 master "
                             f"weights and uses autocast for --bf16)")
        numel = sum(p.numel() for p in params)
        buf = torch.zeros(numel, dtype=dtype, device=params[0].device)
        self.buckets.append(_Bucket(params=params, buffer=buf, pending=len(params)))

    def _attach(self) -> None:
        for b in self.buckets:
            offset = 0
            for p in b.params:
                n = p.numel()
                view = b.buffer[offset:offset + n].view_as(p)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
                offset += n

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self.sync_enabled or self.group is None:
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
        """Launch buckets whose gradients never all arrived (unused parameters), then wait."""
        if self.group is None:
            return
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        for b in self.buckets:
            b.handle.wait()
            b.handle, b.launched, b.pending = None, False, len(b.params)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()
            b.pending, b.launched, b.handle = len(b.params), False, None
        self._attach()
