"""Tensor-parallel layers (Shoeybi et al. 2019, "Megatron-LM", sec. 3).

``ColumnParallelLinear`` splits the output features over the t ranks of the TP group,
``RowParallelLinear`` splits the input features; an MLP (or attention block) is
column-parallel then row-parallel, so it needs one all-reduce forward (``g``, in the row layer)
and one backward (``f``, in the column layer). ``VocabParallelEmbedding`` splits the vocabulary;
:func:`vocab_parallel_cross_entropy` computes the loss without gathering full-vocabulary logits.

Every parameter carries its sharding: ``param.shard`` (a :class:`ShardSpec`, or absent when the
parameter is replicated over TP) and ``param.init_fn`` (builds the *full* tensor from a seeded
generator). :func:`initialize_parameters` materializes the full tensor from a seed derived from
the parameter's name and keeps this rank's shard, so a TP run starts from exactly the weights of
the single-process run with the same seed. Checkpoints and Hugging Face interop reuse
:func:`shard_tensor` / :func:`unshard_tensors`.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loom.parallel.mappings import (copy_to_tensor_parallel_region,
                                    gather_from_tensor_parallel_region,
                                    reduce_from_tensor_parallel_region,
                                    scatter_to_tensor_parallel_region)
from loom.parallel.mesh import ParallelMesh
from loom.parallel.sequence import (gather_from_sequence_parallel_region,
                                    reduce_scatter_to_sequence_parallel_region)

InitFn = Callable[[tuple, torch.Generator], torch.Tensor]


# -- sharding metadata ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardSpec:
    """How a parameter's full tensor is split over the t TP ranks.

    ``dim``: the partitioned dimension. ``segments``: sizes (in the full tensor) of fused blocks
    along ``dim`` that are each split t ways, e.g. ``(a d, g d, g d)`` for a fused QKV weight or
    ``(f, f)`` for SwiGLU's gate and up projections; rank r holds the concatenation of the r-th
    chunk of every segment. None = one segment.
    """

    dim: int
    segments: Optional[tuple[int, ...]] = None

    def to_dict(self) -> dict:
        return {"dim": self.dim, "segments": list(self.segments) if self.segments else None}


def shard_tensor(full: torch.Tensor, spec: Optional[ShardSpec], rank: int, t: int) -> torch.Tensor:
    """This rank's shard of ``full`` (``spec`` None = replicated: ``full`` itself)."""
    if spec is None or t == 1:
        return full
    segs = spec.segments or (full.shape[spec.dim],)
    pieces = [seg.chunk(t, dim=spec.dim)[rank] for seg in full.split(list(segs), dim=spec.dim)]
    return torch.cat(pieces, dim=spec.dim)


def unshard_tensors(shards: Sequence[torch.Tensor], spec: Optional[ShardSpec]) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: the full tensor from the shards of ranks 0..t-1."""
    if spec is None or len(shards) == 1:
        return shards[0]
    t = len(shards)
    segs = spec.segments or (shards[0].shape[spec.dim] * t,)
    local = [s // t for s in segs]
    per_rank = [sh.split(local, dim=spec.dim) for sh in shards]
    return torch.cat([torch.cat([per_rank[r][i] for r in range(t)], dim=spec.dim)
                      for i in range(len(segs))], dim=spec.dim)


def fit_full_shape(full: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Zero-pad or trim ``full`` to ``shape`` (vocabulary padding differs between TP sizes:
    Vp is a multiple of ``make_vocab_size_divisible_by x t``; rows past V are zero)."""
    if tuple(full.shape) == tuple(shape):
        return full
    out = full.new_zeros(shape)
    common = tuple(slice(0, min(a, b)) for a, b in zip(full.shape, shape))
    out[common] = full[common]
    return out


def normal_init(std: float) -> InitFn:
    """N(0, std^2) (Megatron's ``init_method_normal``)."""
    return lambda shape, g: torch.empty(shape).normal_(0.0, std, generator=g)


def scaled_normal_init(std: float, num_layers: int) -> InitFn:
    """N(0, (std / sqrt(2 L))^2) for output projections (Megatron's ``scaled_init_method_normal``;
    GPT-2 paper sec. 2.3)."""
    return normal_init(std / math.sqrt(2.0 * num_layers))


def vocab_padded_init(init_fn: InitFn, vocab_size: int) -> InitFn:
    """``init_fn`` on the true ``[V, ...]`` rows, zeros on the padding rows ``[V, Vp)``, so the
    weights do not depend on the padded size (hence on t)."""
    def init(shape, g):
        w = init_fn((vocab_size, *shape[1:]), g)
        return torch.cat([w, torch.zeros(shape[0] - vocab_size, *shape[1:])], dim=0)
    return init


def zeros_init(shape, g):
    return torch.zeros(shape)


def ones_init(shape, g):
    return torch.ones(shape)


def _tag(p: nn.Parameter, full_shape: tuple, init_fn: InitFn, spec: Optional[ShardSpec]) -> None:
    p.full_shape = tuple(full_shape)
    p.init_fn = init_fn
    if spec is not None:
        p.shard = spec


def param_seed(seed: int, name: str) -> int:
    """Stable per-parameter seed: the same name gets the same weights on every layout."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def initialize_parameters(module: nn.Module, seed: int, tp_rank: int, tp_size: int) -> None:
    """Fill every parameter from its ``init_fn`` with a generator seeded by its name.

    The full tensor is built (on CPU) and this rank's shard is copied in, so the result does not
    depend on t or on the pipeline stage that holds the parameter. Parameters without an
    ``init_fn`` keep their values.
    """
    for name, p in module.named_parameters():
        init_fn = getattr(p, "init_fn", None)
        if init_fn is None:
            continue
        g = torch.Generator().manual_seed(param_seed(seed, name))
        full = init_fn(p.full_shape, g)
        p.copy_(shard_tensor(full, getattr(p, "shard", None), tp_rank, tp_size).to(p.dtype))


def is_tensor_parallel(p: torch.Tensor) -> bool:
    return getattr(p, "shard", None) is not None


# -- layers --------------------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by columns: rank r holds ``A_r`` of shape
    ``[out/t, in]`` and produces ``Y_r = X A_r`` ``[..., out/t]``.

    Args: ``input_size``, ``output_size`` (full sizes), ``mesh``, ``bias``, ``gather_output``
    (all-gather the output to ``[..., out]``), ``segments`` (fused blocks, see
    :class:`ShardSpec`), ``init_fn`` (full-weight initializer), ``sequence_parallel`` (input is
    ``[s/t, b, in]``, all-gathered along the sequence instead of ``f``).
    Forward input ``[..., in]`` (replicated over TP); output ``[..., out/t]`` or ``[..., out]``.
    """

    def __init__(self, input_size: int, output_size: int, mesh: ParallelMesh, *, bias: bool = True,
                 gather_output: bool = False, segments: Optional[tuple[int, ...]] = None,
                 init_fn: InitFn = normal_init(0.02), sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel and mesh.tp_size > 1
        t = mesh.tp_size
        for seg in segments or (output_size,):
            if seg % t:
                raise ValueError(f"output block {seg} not divisible by tensor parallel size {t}")
        self.group = mesh.groups["tp"]
        self.gather_output = gather_output
        spec = ShardSpec(0, segments)
        self.weight = nn.Parameter(torch.empty(output_size // t, input_size, device=mesh.device))
        _tag(self.weight, (output_size, input_size), init_fn, spec)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size // t, device=mesh.device))
            _tag(self.bias, (output_size,), zeros_init, spec)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by rows: rank r holds ``A_r`` of shape ``[out, in/t]``,
    computes ``X_r A_r`` and the partial sums are all-reduced (``g``); the bias is added once.

    Forward input ``[..., in/t]`` when ``input_is_parallel`` (else ``[..., in]``, scattered);
    output ``[..., out]`` replicated over TP, or with ``sequence_parallel`` reduce-scattered to
    ``[s/t, b, out]`` (the bias, then applied to this rank's tokens, is marked
    ``sequence_parallel`` so its gradient is summed over TP).
    """

    def __init__(self, input_size: int, output_size: int, mesh: ParallelMesh, *, bias: bool = True,
                 input_is_parallel: bool = True, init_fn: InitFn = normal_init(0.02),
                 sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel and mesh.tp_size > 1
        t = mesh.tp_size
        if input_size % t:
            raise ValueError(f"input size {input_size} not divisible by tensor parallel size {t}")
        self.group = mesh.groups["tp"]
        self.input_is_parallel = input_is_parallel
        self.weight = nn.Parameter(torch.empty(output_size, input_size // t, device=mesh.device))
        _tag(self.weight, (output_size, input_size), init_fn, ShardSpec(1))
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, device=mesh.device))
            _tag(self.bias, (output_size,), zeros_init, None)
            self.bias.sequence_parallel = self.sequence_parallel
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
                 vocab_size: int, init_fn: InitFn = normal_init(0.02)):
        super().__init__()
        t = mesh.tp_size
        if padded_vocab_size % t:
            raise ValueError(f"padded vocab {padded_vocab_size} not divisible by t={t}")
        self.group = mesh.groups["tp"]
        self.vocab_size = vocab_size
        per = padded_vocab_size // t
        self.vocab_start, self.vocab_end = mesh.tp_rank * per, (mesh.tp_rank + 1) * per
        self.weight = nn.Parameter(torch.empty(per, hidden_size, device=mesh.device))
        _tag(self.weight, (padded_vocab_size, hidden_size), vocab_padded_init(init_fn, vocab_size),
             ShardSpec(0))

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
    ``target``: ``[...]`` global token ids; ``vocab_size``: the true V (padded columns are
    excluded from the softmax). Returns the loss per token ``[...]`` (fp32). Forward runs 2
    all-reduces on the TP group (max, then [target logit, sum of exp]); backward none
    (Megatron-LM's ``vocab_parallel_cross_entropy``).
    """
    group = mesh.groups["tp"]
    start = mesh.tp_rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, group, start, vocab_size)
