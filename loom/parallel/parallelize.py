"""Build this rank's model chunks: pipeline split -> plain model on the meta device -> the
family's parallel plan -> initialization from the registry -> recomputation -> ``--compile`` ->
(ZeRO-3) FSDP2 sharding over DP x CP (:mod:`loom.parallel.fsdp`).

Every rank of every layout starts from exactly the single-process weights: parameter names
carry the global layer index and each full tensor is drawn from a generator seeded by
``(seed, name)`` before this rank's shard is cut (:func:`loom.parallel.registry.initialize`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from loom.config import LoomConfig, ModelConfig
from loom.config.parallel_cp import cp_comm_types
from loom.parallel.compile import compile_layers
from loom.parallel.fsdp import fsdp_enabled, shard_model_chunks
from loom.parallel.interface import FamilyParts, StageSpec
from loom.parallel.mesh import ParallelMesh
from loom.parallel.pipeline.placement import chunk_layers, v_chunk_layers
from loom.parallel.pipeline.zero_bubble import is_v_shaped
from loom.parallel.plan import PlanContext, apply_plan
from loom.parallel.random import RNGTracker
from loom.parallel.recompute import apply_recompute
from loom.parallel.registry import initialize


class SkipModuleInit(TorchFunctionMode):
    """Skips ``torch.nn.init``'s initializers while a family builds its modules on the meta
    device: the values are never used (:func:`~loom.parallel.plan.apply_plan` materializes
    uninitialized storage and :func:`~loom.parallel.registry.initialize` draws every tensor
    from the registry's initializers), and on meta they only cost time: 8.7 s of the 15 s a
    235B MoE's rank took to build, its 48,506 ``nn.Linear``s each running
    ``kaiming_uniform_`` (``python -m benchmarks.dry_run_time``)."""

    # the initializers that dispatch to a mode, and the in-place kernels the others end in
    SKIP = frozenset([getattr(nn.init, n) for n in (
        "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
        "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
        "orthogonal_", "sparse_")] + [torch.Tensor.uniform_, torch.Tensor.normal_,
                                      torch.Tensor.zero_, torch.Tensor.fill_])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SKIP:  # an initializer returns the tensor it was given
            return args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        return func(*args, **kwargs)


def build_chunk(family: FamilyParts, cfg: ModelConfig, stage: StageSpec, mesh: ParallelMesh,
                tracker: RNGTracker, *, seed: Optional[int] = 1234,
                sequence_parallel: bool = False,
                cp_comm_type: tuple = ("p2p",)) -> nn.Module:
    """One parallelized chunk; its registry is ``chunk.registry``. ``seed`` None leaves the
    parameters uninitialized (e.g. weights loaded right after). ``cp_comm_type``: the CP
    communication of every layer, or of each (``--cp-comm-type``)."""
    if stage.padded_vocab is None and cfg.vocab_size is not None:
        stage = StageSpec(stage.layer_numbers, stage.pre_process, stage.post_process,
                          cfg.padded_vocab(mesh.tp_size))
    with torch.device("meta"), SkipModuleInit():
        chunk = family.build(cfg, stage)
    ctx = PlanContext(mesh, tracker, sequence_parallel, tuple(cp_comm_type))
    chunk.registry = apply_plan(chunk, family.plan(cfg, stage, ctx), ctx, family.init(cfg))
    chunk.mesh = mesh
    if seed is not None:
        initialize(chunk, chunk.registry, seed, mesh.tp_rank, mesh.tp_size,
                   (mesh.etp_rank, mesh.etp_size))
    return chunk


def build_model(family: FamilyParts, cfg: ModelConfig, mesh: ParallelMesh,
                tracker: Optional[RNGTracker] = None, *, seed: Optional[int] = 1234) -> nn.Module:
    """The whole model on this rank (no pipeline split), e.g. for generation or interop."""
    if tracker is None:
        tracker = RNGTracker(mesh.device)
        tracker.seed(0)
    stage = StageSpec(list(range(cfg.num_layers)), True, True)
    return build_chunk(family, cfg, stage, mesh, tracker, seed=seed)


def build_model_chunks(family: FamilyParts, cfg: LoomConfig, mesh: ParallelMesh,
                       tracker: RNGTracker) -> list[nn.Module]:
    """This rank's chunks: chunk k of stage r holds virtual stage ``k p + r`` (one chunk
    without interleaving); under ZB-V (``--pipeline-schedule zbv``) chunk 0 holds virtual stage
    r and chunk 1 virtual stage ``2p - 1 - r`` (:func:`~loom.parallel.pipeline.placement.
    v_chunk_layers`), so stage 0 holds both ends. The first virtual stage holds the embedding,
    the last the output."""
    par, p, r = cfg.parallel, mesh.pp_size, mesh.pp_rank
    v_shape = is_v_shaped(par.pipeline_schedule, p)
    layers: Sequence[list[int]] = v_chunk_layers(cfg.model.num_layers, p, r) if v_shape else \
        chunk_layers(cfg.model.num_layers, p, r, par.num_layers_per_virtual_pipeline_stage,
                     par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers,
                     getattr(par, "pipeline_model_parallel_layout", None))
    v, t = len(layers), cfg.training
    last = 0 if v_shape else p - 1  # the stage holding the last virtual stage
    chunks = []
    for k, numbers in enumerate(layers):
        stage = StageSpec(numbers, pre_process=(k == 0 and r == 0),
                          post_process=(k == v - 1 and r == last))
        chunk = build_chunk(family, cfg.model, stage, mesh, tracker, seed=t.seed,
                            sequence_parallel=par.sequence_parallel,
                            cp_comm_type=cp_comm_types(par, cfg.model.num_layers))
        apply_recompute(chunk, t.recompute_granularity, tracker, t.recompute_method,
                        t.recompute_num_layers)
        if t.compile:
            compile_layers(chunk)
        chunks.append(chunk)
    if fsdp_enabled(t):  # ZeRO-3: fully_shard per layer and per chunk over DP x CP
        shard_model_chunks(chunks, mesh, bf16=t.bf16, fp16=t.fp16)
    return chunks
