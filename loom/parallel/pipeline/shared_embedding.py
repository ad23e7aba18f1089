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
    gradient lives (default ``p.grad``; the distributed optimizer's main-gradient shard).

    When both copies are on this rank (ZB-V's V layout puts the first and the last virtual stage
    on stage 0, in two chunks) their gradients are summed here, with no collective (the other
    end of the embedding group then holds no copy and joins none)."""
    group = mesh.groups.get("embedding")
    if mesh.pp_size == 1:
        return
    copies: dict = {}  # name -> this rank's gradients of the shared parameter of that name
    for name, p, meta in named_parameters(model_chunks):
        grad = p.grad if grad_of is None else grad_of(p)
        if meta.pipeline_shared and grad is not None and grad.numel():
            copies.setdefault(name, []).append(local_tensor(grad))
    for grads in copies.values():
        if len(grads) > 1:  # both ends here: sum locally
            total = sum(g.clone() for g in grads)
            for g in grads:
                g.copy_(total)
        elif group is not None:
            dist.all_reduce(grads[0], group=group)  # ZeRO-3: alike shards
