"""A training run assembled from parts (Megatron-LM's ``setup_model_and_optimizer`` +
``build_train_valid_test_data_iterators``; torchtitan's ``Trainer.__init__`` made of
``build_*`` functions): each part is a small object with its own interface, built here in a
fixed order (the RNG streams and parameter initialization depend on it), and
:class:`~loom.training.trainer.Trainer` only runs the loop over them.

=================  ==========================================================================
part               object
=================  ==========================================================================
``mesh``           :class:`~loom.parallel.mesh.ParallelMesh` (:func:`build_mesh`)
``model``          :class:`ModelParts`: chunks, registry, RNG tracker, precision forward step
``reducers``       one gradient buffer per chunk (:func:`~loom.training.setup.chunk_reducer`)
``optimizer``      AdamW or loom's distributed optimizer (:mod:`loom.training.optimizer`)
``scheduler``      the LR and weight-decay schedule (:mod:`~loom.training.param_schedule`)
``schedule``       the pipeline schedule (:func:`~loom.parallel.pipeline.schedules.get_schedule`)
``data``           :class:`~loom.training.batches.BatchSource` (datasets, micro-batches)
``checkpointer``   :class:`~loom.training.checkpointer.Checkpointer` (saves, ``--load``)
``faults``         :class:`~loom.training.fault.FaultTolerance` and the save interval
``throughput``     :class:`~loom.training.metrics.Throughput` (FLOPs, peak, prediction)
``debug``          :class:`~loom.training.debug.RunDebug`: timers, profiler, memory snapshots
=================  ==========================================================================
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from loom.config import LoomConfig
from loom.config.batch_ramp import BatchRamp
from loom.config.document_masks import document_plan
from loom.config.parallel_cp import hierarchical_sizes
from loom.data.blended import map_sets
from loom.errors import ConfigError
from loom.models import get_family
from loom.models.family import ModelFamily
from loom.models.moe import enable_layer_loss_log, layer_loss_names
from loom.parallel.expert import moe_layer_losses, update_expert_bias
from loom.parallel.mesh import ParallelMesh, init_distributed
from loom.parallel.parallelize import build_model_chunks
from loom.parallel.pipeline.schedules import get_schedule
from loom.parallel.pipeline.timeline import Timeline
from loom.parallel.random import RNGTracker, seed_everything
from loom.parallel.registry import ParamRegistry, named_parameters
from loom.planner.flops import model_flops_per_iteration
from loom.training.batches import BatchSource
from loom.training.checkpointer import Checkpointer
from loom.training.debug import RunDebug, enable_determinism
from loom.training.fault import CheckpointInterval, FaultTolerance
from loom.training.metrics import Throughput, peak_flops_per_rank
from loom.training import weight_hash
from loom.training.optimizer import build_optimizer, build_scheduler
from loom.training.progress_log import ProgressLog
from loom.training.precision import (cast_parameters, loss_scaler, param_dtype,
                                     precision_forward_step)
from loom.training.rerun import RerunStateMachine, rerun_machine
from loom.training.setup import (checkpoint_interval, chunk_reducer, logged_metrics,
                                 predict_step_time)
from loom.training.step import ParamGroups


def build_mesh(cfg: LoomConfig) -> ParallelMesh:
    """Initialize ``torch.distributed`` from torchrun's environment (``--device``, gloo on CPU,
    else ``--distributed-backend``) and build the mesh of ``cfg``'s TP / PP / CP / EP / ETP
    sizes (DP is what remains)."""
    p = cfg.parallel
    dev = p.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = init_distributed(dev, "gloo" if dev == "cpu" else p.distributed_backend,
                              cfg.fault_tolerance.distributed_timeout_minutes)
    return ParallelMesh.build(tp=p.tensor_model_parallel_size,
                              pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size,
                              device=device, ep=p.expert_model_parallel_size,
                              etp=p.expert_tensor_parallel_size,
                              timeout=datetime.timedelta(
                                  minutes=cfg.fault_tolerance.distributed_timeout_minutes),
                              hierarchical_cp=hierarchical_sizes(p))


@dataclass
class ModelParts:
    """This rank's model: ``chunks`` (one per virtual pipeline stage) of ``family``, their merged
    ``registry``, the RNG ``tracker``, the fp16 loss ``scaler`` (None otherwise), the
    ``forward_step`` that casts to the parameters' precision, and the parameter ``groups``."""
    family: ModelFamily
    tracker: RNGTracker
    chunks: list
    registry: ParamRegistry
    scaler: Any
    forward_step: Callable
    groups: ParamGroups


def build_model(cfg: LoomConfig, mesh: ParallelMesh, family: ModelFamily) -> ModelParts:
    """Seed the generators (``--seed``, per PP and TP rank), build and parallelize the chunks
    (:func:`~loom.parallel.parallelize.build_model_chunks`), cast them to ``--bf16`` /
    ``--fp16``, and sort the parameters by role (norm, expert norm, sequence-parallel)."""
    t = cfg.training
    tracker = RNGTracker(mesh.device)
    seed_everything(t.seed, mesh.pp_rank, mesh.tp_rank, tracker)
    chunks = build_model_chunks(family, cfg, mesh, tracker)
    registry = ParamRegistry.merged(c.registry for c in chunks)
    scaler = loss_scaler(t)  # --fp16; 16-bit parameters: loom.training.precision
    step = family.forward_step
    if t.export_kd_teacher_load:  # knowledge distillation: a frozen teacher's logits
        from loom.training.distill import build_teacher, distillation_step, read_kd_cfg
        step = distillation_step(build_teacher(cfg, mesh, family, tracker, param_dtype(t)),
                                 read_kd_cfg(t.export_kd_cfg))
    forward_step = precision_forward_step(step, cast_parameters(chunks, param_dtype(t)), scaler,
                                          cfg.model.fp32_residual_connection)
    named = list(named_parameters(chunks))
    apart = mesh.experts_apart  # experts on a grid of their own: their norm summed apart
    groups = ParamGroups(
        params=[p for _, p, _ in named],
        norm_params=[p for _, p, m in named if mesh.counts_for_norm(m)
                     and not (apart and m.expert_parallel)],
        expert_norm_params=[p for _, p, m in named if apart and m.expert_parallel
                            and mesh.counts_for_norm(m)],
        sp_params=[p for _, p, m in named if m.grad_summed_over_tp])
    return ModelParts(family, tracker, chunks, registry, scaler, forward_step, groups)


@dataclass
class TrainingParts:
    """Everything one rank's training loop runs over (see the module)."""
    cfg: LoomConfig
    mesh: ParallelMesh
    world_size: int
    global_rank: int
    model: ModelParts
    reducers: list
    optimizer: Any
    scheduler: Any
    schedule: Callable
    timeline: Timeline
    data: BatchSource
    checkpointer: Checkpointer
    faults: FaultTolerance
    save_interval: CheckpointInterval
    throughput: Throughput
    after_step: Callable[[], None] = lambda: None
    """Run after every optimizer step: the aux-loss-free expert-bias update from the
    step's global expert load (:func:`loom.parallel.expert.update_expert_bias`) for MoE models."""
    debug: Optional[RunDebug] = None
    """Timers, ``--profile``, ``--record-memory-history`` (:mod:`loom.training.debug`)."""
    layer_metrics: Callable[[], dict] = dict
    """Per-layer values for the step's record (a collective on every rank):
    ``--moe-per-layer-logging``'s losses (:func:`loom.parallel.expert.moe_layer_losses`)."""
    rerun: Optional[RerunStateMachine] = None
    """Megatron's rerun state machine (``--rerun-mode``, :mod:`loom.training.rerun`)."""
    qk_clip: Optional[Callable[[], float]] = None
    """After each optimizer step: QK-clip and this rank's largest attention logit
    (``--qk-clip`` / ``--log-max-attention-logit``, :func:`loom.training.qk_clip.step_clip`)."""
    skips: frozenset = frozenset()
    """``--iterations-to-skip``: iterations that consume their batch and take no step."""
    phases: tuple = ()
    """``--phase-transition-iterations``: the iterations a data phase ends at (sorted)."""


def build_training(cfg: LoomConfig, mesh: Optional[ParallelMesh] = None,
                   family: Optional[ModelFamily] = None) -> TrainingParts:
    """The parts of ``cfg``'s training on this rank. ``mesh`` None initializes
    ``torch.distributed`` (:func:`build_mesh`); ``family`` None is ``--model-type``'s."""
    derived = cfg.require_derived()  # a config cfg.validate(world_size) returned
    started = time.time()  # the job's start, for --log-progress's job throughput
    if cfg.training.deterministic_mode:  # before any cuBLAS handle or NCCL communicator
        enable_determinism(os.environ)
    mesh = mesh if mesh is not None else build_mesh(cfg)
    family = family or get_family(cfg.model.model_type)
    world_size = math.prod(mesh.sizes.values())
    if derived.world_size != world_size:
        raise ConfigError(f"the config was resolved for {derived.world_size} ranks but the mesh "
                          f"{mesh.sizes} has {world_size}: validate it for {world_size}")
    global_rank = dist.get_rank() if dist.is_initialized() else 0
    t = cfg.training
    debug = RunDebug(cfg, global_rank, world_size, mesh.device)  # memory history: from here
    model = build_model(cfg, mesh, family)
    if debug.straggler is not None:  # --log-straggler times each micro-batch's forward
        model = replace(model, forward_step=debug.straggler.wrap(model.forward_step))
    reducers = [chunk_reducer(c, mesh, cfg) for c in model.chunks]
    optimizer = build_optimizer(torch.nn.ModuleList(model.chunks), t, mesh, reducers,
                                debug.timers, model_cfg=cfg.model)
    ramp = BatchRamp.from_training(t, cfg.model.seq_length)  # --rampup-batch-size, ...
    scheduler = build_scheduler(optimizer, t, derived.global_batch_size, ramp,
                                derived.running_global_batch_size)
    schedule = get_schedule(derived.pipeline_schedule, mesh.pp_size,
                            cfg.parallel.microbatch_group_size_per_virtual_pipeline_stage)
    timeline = Timeline(global_rank, enabled=bool(cfg.logging.timeline))
    ft = cfg.fault_tolerance
    faults = FaultTolerance(global_rank, ft.inject_fault, ft.hang_timeout_s, world_size,
                            ft.exit_signal_handler,
                            functools.partial(weight_hash.check, model.chunks, mesh, optimizer),
                            ft.check_weight_hash_across_dp_replicas_interval,
                            exit_signal=ft.exit_signal)
    save_interval = checkpoint_interval(cfg, world_size, model.groups.params)
    checkpointer = Checkpointer(cfg, mesh, world_size, model.chunks, optimizer, scheduler,
                                model.tracker, family)
    if cfg.data.sft:  # conversations, loss on the assistant turns (loom.data.sft)
        from loom.data.sft import sft_datasets
        datasets = sft_datasets(cfg.data, cfg.model.seq_length)
    else:
        datasets = family.datasets(cfg)
    checkpointer.saver.opened()  # the data's identity as opened, recorded by every save
    if cfg.data.eod_mask_loss:  # Megatron's loss mask at end-of-document input tokens
        from loom.data.loss_mask import EodLossMask, end_of_document_id
        eod = end_of_document_id(cfg.data, cfg.model.vocab_size)
        datasets = map_sets(lambda ds: EodLossMask(ds, eod), datasets)
    plan = document_plan(cfg, family.takes_documents)
    if plan.active:  # Megatron's document masks (loom.data.document_masks)
        from loom.data.document_masks import DocumentResets
        from loom.data.loss_mask import end_of_document_id
        eod = None if plan.own_documents else end_of_document_id(
            cfg.data, cfg.model.vocab_size,
            "--reset-attention-mask" if plan.attention else "--reset-position-ids")
        datasets = map_sets(lambda ds: DocumentResets(
            ds, eod, plan.positions, plan.attention, plan.own_documents), datasets)
    data = BatchSource.from_config(cfg, mesh, datasets, ramp)
    throughput = Throughput(
        data.global_batch * cfg.model.seq_length,
        model_flops_per_iteration(cfg.model, data.global_batch, cfg.model.seq_length),
        world_size, peak_flops_per_rank(mesh.device, cfg.logging.peak_tflops),
        predict_step_time(cfg, world_size), logged_metrics(cfg.model, family)
        + (("kd loss",) if t.export_kd_teacher_load else ()), batch=data.global_batch)
    if debug.straggler is not None:
        debug.straggler.flops_per_iter = throughput.flops_per_iter
    if cfg.logging.log_progress:  # progress.txt in --save (loom.training.progress_log)
        checkpointer.progress = ProgressLog(
            cfg.checkpoint.save, world_size, throughput.flops_per_iter / data.global_batch,
            cfg.model.seq_length, enabled=global_rank == 0, started=started)
    after_step = functools.partial(update_expert_bias, model.chunks, mesh.groups["dp_cp"],
                                   cfg.model.moe_router_bias_update_rate) \
        if cfg.model.num_experts else (lambda: None)
    layer_metrics = dict
    if cfg.logging.moe_per_layer_logging:
        enable_layer_loss_log(model.chunks)
        layer_metrics = functools.partial(
            moe_layer_losses, model.chunks, layer_loss_names(cfg.model),
            cfg.model.num_layers + (cfg.model.mtp_num_layers or 0), mesh)
    rerun = rerun_machine(cfg, mesh.pp_rank, global_rank, model.chunks, model.tracker, reducers)
    from loom.config.evaluation import PHASES_FLAG, parse_iterations
    from loom.training.qk_clip import step_clip
    return TrainingParts(cfg, mesh, world_size, global_rank, model, reducers, optimizer,
                         scheduler, schedule, timeline, data, checkpointer, faults,
                         save_interval, throughput, after_step, debug, layer_metrics, rerun,
                         step_clip(cfg, model.chunks, optimizer, mesh),
                         frozenset(parse_iterations(t.iterations_to_skip)),
                         parse_iterations(cfg.data.phase_transition_iterations, PHASES_FLAG))
