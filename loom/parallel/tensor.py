"""Tensor-parallel layers (Shoeybi et al. 2019, "Megatron-LM", sec. 3).

``ColumnParallelLinear`` splits the output features over the t ranks of the TP group,
``RowParallelLinear`` splits the input features; an MLP (or attention block) is
column-parallel then row-parallel, so it needs one all-reduce forward (``g``, in the row layer)
and one backward (``f``, in the column layer). ``VocabParallelEmbedding`` splits the vocabulary;
:func:`vocab_parallel_cross_entropy` computes the loss without gathering full-vocabulary logits.

The layers hold only this rank's shard; how each shard relates to the full tensor (and how the
full tensor is initialized) is recorded by the parallel plan in the parameter registry
(:mod:`loom.parallel.registry`), not on the parameters.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loom.parallel.cross_entropy import linear_cross_entropy
from loom.parallel.mappings import (copy_to_tensor_parallel_region,
                                    gather_from_tensor_parallel_region,
                                    reduce_from_tensor_parallel_region,
                                    scatter_to_tensor_parallel_region)
from loom.parallel.mesh import ParallelMesh
from loom.parallel.sequence import (gather_from_sequence_parallel_region,
                                    reduce_scatter_to_sequence_parallel_region,
                                    start_gather_dim0, start_reduce_scatter_dim0)


# -- the sequence-parallel column GEMM -------------------------------------------------------------------

class _SequenceGatherLinear(torch.autograd.Function):
    """``F.linear(all_gather_s(x), weight, bias)`` for ``x [s/t, b, in]`` (this rank's sequence
    shard) that saves the *shard* for backward, not the gathered ``[s, b, in]``: ``1/t`` of the
    bytes (Korthikanti et al. 2022, sec. 4.2.2, store the sequence-parallel input and
    all-gather it again in backward; Megatron-Core's column-parallel GEMM does the same).

    Backward, in order: start the all-gather of the saved shard; compute the input gradient
    ``dY W`` ``[s, b, in]`` while it runs; start its reduce-scatter to ``[s/t, b, in]``; wait for
    the gather and compute ``dW = dY^T X`` ``[out/t, in]`` and ``db`` while the reduce-scatter
    runs; wait. The math is F.linear's backward followed by the SP region's reduce-scatter: the
    same products, one extra all-gather of ``s b in`` elements per backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(start_gather_dim0(x, group)(), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad = grad.contiguous()
        gathered = start_gather_dim0(x, ctx.group) if need_w else None
        grad_x = start_reduce_scatter_dim0(grad.matmul(weight), ctx.group) if need_x else None
        grad_w = grad_b = None
        flat = grad.reshape(-1, grad.shape[-1])
        if need_w:
            full = gathered()
            grad_w = flat.t().matmul(full.reshape(-1, full.shape[-1]))
        if need_b and ctx.has_bias:
            grad_b = flat.sum(dim=0)
        return grad_x() if need_x else None, grad_w, grad_b, None


def sequence_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             group) -> torch.Tensor:
    """``x [s/t, b, in]`` all-gathered along the sequence, times ``weight [out/t, in]``: ``[s, b,
    out/t]``, saving only the shard for backward (:class:`_SequenceGatherLinear`)."""
    return _SequenceGatherLinear.apply(x, weight, bias, group)


# -- layers --------------------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by columns: rank r holds ``A_r`` of shape
    ``[out/t, in]`` and produces ``Y_r = X A_r`` ``[..., out/t]``.

    Args: ``input_size``, ``output_size`` (full sizes), ``mesh``, ``bias``, ``gather_output``
    (all-gather the output to ``[..., out]``), ``segments`` (fused blocks, each split t ways,
    see :class:`~loom.parallel.registry.ShardSpec`), ``sequence_parallel`` (input is
    ``[s/t, b, in]``, all-gathered along the sequence instead of ``f``; backward gathers it
    again, so only the shard is saved: :func:`sequence_parallel_linear`).
    Raises ValueError when a block is not divisible by t.
    Forward input ``[..., in]`` (replicated over TP); output ``[..., out/t]`` or ``[..., out]``.
    """

    def __init__(self, input_size: int, output_size: int, mesh: ParallelMesh, *, bias: bool = True,
                 gather_output: bool = False, segments: Optional[tuple[int, ...]] = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel and mesh.tp_size > 1
        t = mesh.tp_size
        for seg in segments or (output_size,):
            if seg % t:
                raise ValueError(f"output block {seg} not divisible by tensor parallel size {t}")
        self.group = mesh.groups["tp"]
        self.gather_output = gather_output
        self.weight = nn.Parameter(torch.empty(output_size // t, input_size, device=mesh.device))
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size // t, device=mesh.device))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = sequence_parallel_linear(x, self.weight, self.bias, self.group)
        else:
            y = F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by rows: rank r holds ``A_r`` of shape ``[out, in/t]``,
    computes ``X_r A_r`` and the partial sums are all-reduced (``g``); the bias is added once.

    Forward input ``[..., in/t]`` when ``input_is_parallel`` (else ``[..., in]``, scattered);
    output ``[..., out]`` replicated over TP, or with ``sequence_parallel`` reduce-scattered to
    ``[s/t, b, out]`` (the bias is then applied to this rank's tokens, so the plan registers it
    as sequence-parallel and its gradient is summed over TP).
    """

    def __init__(self, input_size: int, output_size: int, mesh: ParallelMesh, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel and mesh.tp_size > 1
        t = mesh.tp_size
        if input_size % t:
            raise ValueError(f"input size {input_size} not divisible by tensor parallel size {t}")
        self.group = mesh.groups["tp"]
        self.input_is_parallel = input_is_parallel
        self.weight = nn.Parameter(torch.empty(output_size, input_size // t, device=mesh.device))
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, device=mesh.device))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(F.linear(x, self.weight), self.group)
        else:
            y = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split over the vocabulary: rank r holds rows
    ``[r Vp/t, (r+1) Vp/t)`` of the padded table ``[Vp, h]``.

    Ids outside this rank's range give zero rows and the partial lookups are all-reduced.
    Rows ``>= vocab_size`` (padding to a multiple of ``make_vocab_size_divisible_by x t``) are
    initialized to zero and never looked up. Input ids ``[...]``; output ``[..., h]``.
    """

    def __init__(self, padded_vocab_size: int, hidden_size: int, mesh: ParallelMesh, *,
                 vocab_size: int):
        super().__init__()
        t = mesh.tp_size
        if padded_vocab_size % t:
            raise ValueError(f"padded vocab {padded_vocab_size} not divisible by t={t}")
        self.group = mesh.groups["tp"]
        self.vocab_size = vocab_size
        per = padded_vocab_size // t
        self.vocab_start, self.vocab_end = mesh.tp_rank * per, (mesh.tp_rank + 1) * per
        self.weight = nn.Parameter(torch.empty(per, hidden_size, device=mesh.device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.group)


# -- loss ----------------------------------------------------------------------------------------------

class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size):
        logits = logits.float()
        n_local = logits.shape[-1]
        col = torch.arange(vocab_start, vocab_start + n_local, device=logits.device)
        logits = logits.masked_fill(col >= vocab_size, float("-inf"))  # padded vocabulary
        logits_max = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (target < vocab_start) | (target >= vocab_start + n_local)
        local_t = (target - vocab_start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            both = torch.stack([predicted, sum_exp])
            dist.all_reduce(both, group=group)
            predicted, sum_exp = both[0], both[1]
        loss = sum_exp.log() - predicted
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax.clone()
        onehot = torch.zeros_like(grad).scatter_(-1, local_t.unsqueeze(-1), 1.0)
        grad.sub_(onehot * (~outside).unsqueeze(-1).to(grad.dtype))
        return grad * grad_loss.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, mesh: ParallelMesh,
                                 vocab_size: int) -> torch.Tensor:
    """Per-token cross-entropy from vocabulary-parallel logits, never gathering the vocabulary.

    ``logits``: ``[..., Vp/t]`` (this rank's vocabulary shard, any float dtype; computed in fp32);
    ``target``: ``[...]`` global token ids; ``vocab_size``: the columns the softmax spans (the
    true V: padded columns excluded; Vp or more: all included, Megatron's default). Returns
    the loss per token ``[...]`` (fp32). Forward runs 2
    all-reduces on the TP group (max, then [target logit, sum of exp]); backward none
    (Megatron-LM's ``vocab_parallel_cross_entropy``).
    """
    group = mesh.groups["tp"]
    start = mesh.tp_rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, group, start, vocab_size)


class VocabParallelLMHead(nn.Module):
    """Output GEMM and loss over vocabulary-parallel logits: ``x [s, b, h]`` (``[s/t, b, h]``
    under sequence parallelism: all-gathered; otherwise entered through ``f``), ``weight``
    ``[Vp/t, h]``. Returns the per-token loss ``[b, s]`` (fp32) against ``labels [b, s]``
    (:func:`~loom.parallel.cross_entropy.linear_cross_entropy`: the full logits never exist),
    or this rank's logits ``[b, s, Vp/t]``. ``vocab_size``: the columns the softmax spans (V
    with ``--exclude-padded-vocab``), None for all Vp (Megatron-Core's default).

    With ``softcap`` (Gemma's final-logit soft-capping) the logits ``[s, b, Vp/t]`` become
    ``softcap * tanh(logits / softcap)``, so the output GEMM and the vocab-parallel
    cross-entropy run unfused (:func:`vocab_parallel_cross_entropy`). ``logit_scale``: the
    logits' multiplier (muP's ``--mup-output-mult``), applied to ``x`` (the same product)."""

    def __init__(self, mesh: ParallelMesh, vocab_size: Optional[int],
                 sequence_parallel: bool = False, softcap: Optional[float] = None,
                 logit_scale: float = 1.0):
        super().__init__()
        self.mesh, self.vocab_size, self.softcap = mesh, vocab_size, softcap
        self.logit_scale = logit_scale
        self.sequence_parallel = sequence_parallel and mesh.tp_size > 1

    def forward(self, x: torch.Tensor, weight: torch.Tensor,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        group = self.mesh.groups["tp"]
        columns = self.vocab_size or weight.shape[0] * self.mesh.tp_size
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, group)
        else:
            x = copy_to_tensor_parallel_region(x, group)
        if self.logit_scale != 1.0:
            x = x * self.logit_scale
        if self.softcap is not None:
            logits = torch.tanh(F.linear(x, weight) / self.softcap) * self.softcap  # [s, b, Vp/t]
            if labels is None:
                return logits.transpose(0, 1)
            return vocab_parallel_cross_entropy(logits, labels.t(), self.mesh, columns).t()
        if labels is None:
            return F.linear(x, weight).transpose(0, 1)  # [b, s, Vp/t]
        # training: the output GEMM and the loss fused, chunked over tokens, in [s, b] order
        loss = linear_cross_entropy(x, weight, labels.t(), group=group,
                                    vocab_start=self.mesh.tp_rank * weight.shape[0],
                                    vocab_size=columns)
        return loss.t()
