"""Pieces of the trainer's set-up: gradient reducers per chunk
(dense and expert parameters), the parameter count, the MoE metrics that are logged, the
checkpoint interval, the planner's step-time prediction."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from loom.parallel.grad_buffer import GradBuffer
from loom.parallel.expert import ReducerGroup, expert_grad_scale
from loom.parallel.fsdp import FSDPGradients, is_fully_sharded, local_tensor
from loom.parallel.mesh import ParallelMesh
from loom.parallel.registry import named_parameters
from loom.planner.predict import predict_layout
from loom.training.distributed_optimizer import buffer_mode
from loom.training.fault import CheckpointInterval

MOE_LOGGED = ("moe aux loss", "moe z loss", "moe load min", "moe load max",
              "moe load imbalance", "moe dropped")  # loss_fn metrics of MoE models, logged


def logged_metrics(model, family) -> tuple[str, ...]:
    """The ``loss_fn`` metrics a training record carries for ``model`` (a ModelConfig): MoE's,
    then the family's own (``family.logged_metrics``: e.g. BERT's masked-LM and sentence-order
    losses), else none."""
    return (MOE_LOGGED if model.num_experts else ()) + tuple(family.logged_metrics(model))


def chunk_reducer(chunk: nn.Module, mesh: ParallelMesh, cfg):
    """Gradient reduction of one chunk: over DP x CP; when the experts have a grid of their own
    (EP > 1 or expert TP != t) their gradients over the expert-data-parallel group ``edp``
    instead, scaled by :func:`~loom.parallel.expert.expert_grad_scale`
    (:mod:`loom.parallel.expert`). ``cfg`` (a LoomConfig) gives ``--ddp-bucket-size``, ``--overlap-grad-reduce``, the
    distributed optimizer's buffer mode (:func:`~loom.training.distributed_optimizer.buffer_mode`:
    reduce-scatter into shards; ZeRO-2 keeps them) and the gradient
    dtype (fp32 main gradients, or the 16-bit parameters' dtype without
    ``--accumulate-allreduce-grads-in-fp32``). The pipeline-shared embedding gets a bucket of
    its own (so its shard ranges agree on the first and last stage). A ``fully_shard``-ed
    chunk (ZeRO-3) reduce-scatters its own gradients in backward (:mod:`loom.parallel.fsdp`)."""
    if is_fully_sharded(chunk):
        return FSDPGradients(chunk)
    t = cfg.training
    dtype = next(chunk.parameters()).dtype
    kw = dict(bucket_size=cfg.parallel.ddp_bucket_size, overlap=cfg.parallel.overlap_grad_reduce,
              grad_dtype=torch.float32 if t.accumulate_allreduce_grads_in_fp32 else dtype,
              own_bucket=[p for n, p in chunk.named_parameters()
                          if chunk.registry[n].pipeline_shared],
              **buffer_mode(t))  # the distributed optimizer's: reduce-scatter, ZeRO-2 shards
    if not mesh.experts_apart:
        return GradBuffer(chunk.parameters(), mesh.groups["dp_cp"], **kw)
    named = [(p, chunk.registry[n].expert_parallel) for n, p in chunk.named_parameters()]
    experts = [p for p, is_expert in named if is_expert]
    return ReducerGroup([GradBuffer([p for p, e in named if not e], mesh.groups["dp_cp"], **kw),
                         GradBuffer(experts, mesh.groups["edp"], scale=expert_grad_scale(mesh),
                                    **kw)], experts, 1.0)


def owned_parameters(model_chunks, mesh: ParallelMesh) -> int:
    """Parameters this rank owns, so that the sum over all ranks counts each parameter of the
    model once: TP shards on each TP rank, replicated ones on TP rank 0, the first DP x CP
    replica; experts on the first expert-DP replica (their shards on each expert-TP rank);
    pipeline duplicates never."""
    first = {"dense": mesh.coords["cp"] == 0 and mesh.coords["dp"] == 0,
             "experts": mesh.expert_coords["edp"] == 0}
    return sum(p.numel() for _, p, meta in named_parameters(model_chunks)
               if mesh.counts_for_norm(meta)
               and first["experts" if meta.expert_parallel else "dense"])


def held_numel(params) -> int:
    """Elements of ``params`` held by this rank (ZeRO-3: its shards of the DTensors)."""
    return sum(local_tensor(p).numel() for p in params)


def checkpoint_interval(cfg, world_size: int, params) -> CheckpointInterval:
    """``--save-interval`` (N, or auto from the job's MTBF: ``--mtbf-hours``, or
    ``--mtbf-hours-per-node`` / nodes with ``LOCAL_WORLD_SIZE`` ranks per node). The save-time
    estimate before the first save uses 12 bytes per parameter on this rank (fp32 weights and
    Adam's two moments)."""
    ck = cfg.checkpoint
    nodes = world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    mtbf_s = (ck.mtbf_hours or (ck.mtbf_hours_per_node or 0) / max(nodes, 1)) * 3600 or None
    return CheckpointInterval(ck.save_interval, mtbf_s, 12 * held_numel(params))


def predict_step_time(cfg, world_size: int) -> Optional[float]:
    """The planner's iteration time for this exact layout (seconds), only when asked with
    ``--planner-cluster`` (a cluster file from ``loom plan --calibrate`` or a GPU name such as
    H100-80GB): building a trainer does not run the cost model otherwise. A prediction that
    fails is said in one warning line (the run goes on without it)."""
    cluster = cfg.logging.planner_cluster
    if cluster is None:
        return None
    try:
        return predict_layout(cfg, world_size, cluster=cluster)["time_s"]["iteration"]
    except Exception as e:  # noqa: BLE001 - a prediction must never stop training
        import warnings
        warnings.warn(f"--planner-cluster {cluster}: no step-time prediction "
                      f"({type(e).__name__}: {e})", RuntimeWarning, stacklevel=2)
        return None
