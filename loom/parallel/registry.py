"""The parameter registry: how every parameter of this rank relates to the unsharded model.

A parallel plan (:mod:`loom.parallel.plan`) records one :class:`ParamMeta` per parameter under
its global, layout-free name (``layers.7.mlp.linear_fc1.weight``): the full shape, the
tensor-parallel dimension and fused segments, the initializer of the full tensor, and the
roles the training step needs (sequence-parallel gradient reduction, pipeline-shared
embeddings). Initialization, checkpoints, Hugging Face interop, the gradient norm and the tests
all read this registry; nothing is stored as attributes on parameters.

:func:`local_shard` is the one place that cuts this rank's shard out of a full tensor, and
:func:`full_from_shards` its inverse.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

InitFn = Callable[[tuple, torch.Generator], torch.Tensor]


@dataclass(frozen=True)
class ShardSpec:
    """How a full tensor is split over the t TP ranks.

    ``dim``: the partitioned dimension. ``segments``: sizes (in the full tensor) of fused blocks
    along ``dim`` that are each split t ways, e.g. ``(a d, g d, g d)`` for a fused QKV weight or
    ``(f, f)`` for SwiGLU's gate and up projections; rank r holds the concatenation of the r-th
    chunk of every segment. None = one segment.
    """

    dim: int
    segments: Optional[tuple[int, ...]] = None

    def to_dict(self) -> dict:
        return {"dim": self.dim, "segments": list(self.segments) if self.segments else None}

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "Optional[ShardSpec]":
        if not d:
            return None
        return cls(d["dim"], tuple(d["segments"]) if d.get("segments") else None)


@dataclass(frozen=True)
class ParamMeta:
    """One parameter as the unsharded model sees it.

    ``full_shape``: shape of the unsharded tensor (vocabulary dimensions padded to Vp).
    ``init``: builds the full tensor from a seeded generator. ``shard``: TP split, None when the
    parameter is replicated over the TP group. ``vocab_dim``: the dimension padded with zero rows
    from V to Vp (Vp depends on t, so only this dimension may differ between layouts).
    ``sequence_parallel``: applied to sequence-split activations ``[s/t, b, h]``, so its gradient
    is summed over TP. ``pipeline_shared``: the same weight lives on the first and the last
    pipeline stage (tied embeddings) and their gradients are summed over the embedding group;
    ``duplicate``: this rank's copy is not the owner (kept out of the gradient norm).
    ``expert_parallel``: a routed expert's weight, on Megatron's expert grid
    (:mod:`loom.parallel.mesh`): held by one rank of the EP group, ``shard`` over the expert-TP
    group (not TP), gradients reduced over the expert-data-parallel group. ``tp_partial_grad``:
    replicated over TP, but each TP rank's gradient is partial (Gemma 3's replicated KV
    projection and QK-norms: its own heads), so it is summed over TP like a sequence-parallel
    parameter's.
    """

    full_shape: tuple[int, ...]
    init: InitFn
    shard: Optional[ShardSpec] = None
    vocab_dim: Optional[int] = None
    sequence_parallel: bool = False
    pipeline_shared: bool = False
    duplicate: bool = False
    expert_parallel: bool = False
    tp_partial_grad: bool = False

    @property
    def embedding_or_output(self) -> bool:
        """Megatron's ``is_embedding_or_output_parameter``: the input word-embedding and
        output-layer weights, here the 2-D parameters with a vocabulary dimension (every stage's
        copy of a tied embedding; not BERT's LM-head bias, not position tables)."""
        return self.vocab_dim is not None and len(self.full_shape) == 2

    @property
    def grad_summed_over_tp(self) -> bool:
        """Whether this rank's gradient is a partial sum to all-reduce over the TP group."""
        return self.sequence_parallel or self.tp_partial_grad

    def counts_for_norm(self, tp_rank: int) -> bool:
        """Whether this rank's gradient enters the global norm: TP shards on every TP rank,
        TP-replicated parameters on TP rank 0, pipeline duplicates never (Megatron's
        ``param_is_not_tensor_parallel_duplicate`` and ``param_is_not_shared``)."""
        if self.duplicate:
            return False
        return self.shard is not None or tp_rank == 0


class ParamRegistry:
    """``name -> ParamMeta`` for the parameters of one model chunk (or several, merged)."""

    def __init__(self, metas: Optional[dict[str, ParamMeta]] = None):
        self._metas: dict[str, ParamMeta] = dict(metas or {})

    def add(self, name: str, meta: ParamMeta) -> None:
        self._metas[name] = meta

    def __getitem__(self, name: str) -> ParamMeta:
        try:
            return self._metas[name]
        except KeyError:
            raise KeyError(f"parameter {name} has no entry in the registry (was the model "
                           f"built through a parallel plan?)") from None

    def __contains__(self, name: str) -> bool:
        return name in self._metas

    def __len__(self) -> int:
        return len(self._metas)

    def items(self) -> Iterator[tuple[str, ParamMeta]]:
        return iter(self._metas.items())

    @classmethod
    def merged(cls, registries: Iterable["ParamRegistry"]) -> "ParamRegistry":
        out = cls()
        for r in registries:
            out._metas.update(r._metas)
        return out


def named_parameters(model_chunks: Sequence[nn.Module]) -> Iterator[tuple[str, nn.Parameter, ParamMeta]]:
    """``(name, parameter, meta)`` of every parameter of this rank's chunks (each chunk carries
    the ``registry`` its plan built)."""
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            yield name, p, chunk.registry[name]


# -- full <-> shard ------------------------------------------------------------------------------

def _shard(full: torch.Tensor, spec: Optional[ShardSpec], rank: int, t: int) -> torch.Tensor:
    if spec is None or t == 1:
        return full
    segs = spec.segments or (full.shape[spec.dim],)
    pieces = [seg.chunk(t, dim=spec.dim)[rank] for seg in full.split(list(segs), dim=spec.dim)]
    return torch.cat(pieces, dim=spec.dim)


def repad_vocab(full: torch.Tensor, meta: ParamMeta, name: str = "tensor") -> torch.Tensor:
    """``full`` with its vocabulary dimension zero-padded or trimmed to ``meta.full_shape``.

    Raises ValueError, naming ``name`` and both shapes, when any other dimension differs (a
    checkpoint of another model shape must never be silently fitted).
    """
    want = tuple(meta.full_shape)
    if tuple(full.shape) == want:
        return full
    others_equal = full.ndim == len(want) and all(
        a == b for i, (a, b) in enumerate(zip(full.shape, want)) if i != meta.vocab_dim)
    if meta.vocab_dim is None or not others_equal:
        raise ValueError(f"{name}: saved shape {tuple(full.shape)} but the model expects {want}")
    out = full.new_zeros(want)
    n = min(full.shape[meta.vocab_dim], want[meta.vocab_dim])
    idx = [slice(None)] * full.ndim
    idx[meta.vocab_dim] = slice(0, n)
    out[tuple(idx)] = full[tuple(idx)]
    return out


def local_shard(full: torch.Tensor, meta: ParamMeta, tp_rank: int, tp_size: int,
                name: str = "tensor") -> torch.Tensor:
    """This TP rank's shard of the full tensor ``full`` (vocabulary padding re-padded to this
    layout's Vp first). Raises ValueError on a shape mismatch other than vocabulary padding."""
    return _shard(repad_vocab(full, meta, name), meta.shard, tp_rank, tp_size)


def full_from_shards(shards: Sequence[torch.Tensor], spec: Optional[ShardSpec]) -> torch.Tensor:
    """Inverse of :func:`local_shard`: the full tensor from the shards of TP ranks 0..t-1."""
    if spec is None or len(shards) == 1:
        return shards[0]
    t = len(shards)
    segs = spec.segments or (shards[0].shape[spec.dim] * t,)
    local = [s // t for s in segs]
    per_rank = [sh.split(local, dim=spec.dim) for sh in shards]
    return torch.cat([torch.cat([per_rank[r][i] for r in range(t)], dim=spec.dim)
                      for i in range(len(segs))], dim=spec.dim)


# -- initialization -----------------------------------------------------------------------------

def param_seed(seed: int, name: str) -> int:
    """Stable per-parameter seed: the same name gets the same weights on every layout."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def initialize(module: nn.Module, registry: ParamRegistry, seed: int, tp_rank: int,
               tp_size: int, expert_tp: Optional[tuple[int, int]] = None) -> None:
    """Fill every parameter from its registered initializer with a generator seeded by its name.

    The full tensor is built (on CPU) and this rank's shard copied in, so the weights do not
    depend on t, on the pipeline stage that holds the parameter, or on recomputation.
    ``expert_tp``: ``(rank, size)`` of the expert-TP group the experts are sharded over
    (default: the TP one).
    """
    for name, p in module.named_parameters():
        meta = registry[name]
        g = torch.Generator().manual_seed(param_seed(seed, name))
        full = meta.init(tuple(meta.full_shape), g)
        rank, size = expert_tp if expert_tp and meta.expert_parallel else (tp_rank, tp_size)
        p.copy_(local_shard(full, meta, rank, size, name).to(p.dtype))
