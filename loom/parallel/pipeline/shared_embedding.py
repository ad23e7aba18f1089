"""Gradients of weights shared between pipeline stages (tied input/output embeddings)."""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist
from torch import nn

from loom.parallel.fsdp import local_tensor
from loom.parallel.registry import named_parameters


def allreduce_embedding_grads(model_chunks: Sequence[nn.Module], mesh, grad_of=None) -> None:
    """Sum the gradients of every parameter the plan registered as ``pipeline_shared`` (the tied
    word embeddings of the first and last stage) over the embedding group, after the DP
    reduction, so both copies take the same optimizer step (Megatron's
    ``_allreduce_word_embedding_grads``). A no-op without pipelining. ``grad_of(p)``: where the
    gradient lives (default ``p.grad``; the distributed optimizer's main-gradient shard)."""
    group = mesh.groups.get("embedding")
    if mesh.pp_size == 1 or group is None:
        return
    for _, p, meta in named_parameters(model_chunks):
        grad = p.grad if grad_of is None else grad_of(p)
        if meta.pipeline_shared and grad is not None and grad.numel():
            dist.all_reduce(local_tensor(grad), group=group)  # ZeRO-3: alike shards
