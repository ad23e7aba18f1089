"""Exact per-rank model-state bytes of a layout, counted on loom's real model without a GPU.

:func:`count_rank_states` builds the chunks one rank of a ``world_size``-rank job would hold
(:func:`loom.parallel.parallelize.build_model_chunks`: its pipeline stage's layers, TP / EP
shards, the embedding on the first stage, the output layer on the last, FSDP2 shards with
``--zero-stage 3``) on the ``meta`` device (no storage) under PyTorch's fake process group
(``torch.testing._internal.distributed.fake_pg.FakeStore``, backend ``"fake"``: every
collective returns at once; what Megatron-LM's ``--fake-process-group`` does), then counts the
rank's parameters element by element. Bytes follow Megatron-style mixed precision (the
planner's convention, :func:`loom.planner.memory.model_state_bytes_per_param`): 2 bytes per
bf16 weight (4 in fp32 runs), ``grad_bytes`` per gradient (the run's gradient buffer:
Megatron's fp32 ``main_grad``, 4, or 2 with ``--grad-reduce-in-bf16`` or ``--fp16``;
:func:`loom.planner.cli_args.gradient_option`),
12 of fp32 master + Adam m, v (SGD: 8 with momentum, 4 without; Muon: 8 on the weights it
manages, ``loom.config.optimizer_muon.muon_managed``, 12 on the rest;
:func:`loom.planner.memory.optimizer_state_bytes`), the last split
over the data-parallel x context-parallel group
by the distributed optimizer (ZeRO-1: ``ceil(N / (d c))`` elements per rank; expert
parameters over the expert-data-parallel group). With FSDP2 the counted local shards already
are the per-rank weights.

The process group is created and destroyed inside the call (refused when one already exists:
the fake group must not replace a real one). Cost: ~1-3 s per rank on CPU for a 405B config (no
storage is allocated: the mesh is a meta one, and the modules' own initializers are skipped,
``loom.parallel.parallelize.SkipModuleInit``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

from loom.config import LoomConfig


def _rank_coords(cfg: LoomConfig, world_size: int) -> dict:
    p = cfg.parallel
    return dict(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                etp=p.expert_tensor_parallel_size)


def forget_fake_meshes() -> None:
    """Clear DTensor's sharding-propagation caches (the Python one and the C++ fast path's).
    They are keyed by the ``DeviceMesh``'s ranks and dimension names, not by its process
    groups, and keep the output specs of every op FSDP2 ran on the fake world's meshes: a later
    run of this process, or a process forked from it, whose mesh has the same ranks would reuse
    those specs and reach the fake world's destroyed groups ("Could not resolve the process
    group registered under the name N"). Found by tests/planner/test_planner_etp.py's ZeRO-3
    count running before a forked 8-rank ZeRO-3 world in one pytest worker."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    _clear_sharding_prop_cache()


def count_rank_states(cfg: LoomConfig, world_size: int, rank: int = 0,
                      grad_bytes: int | None = None) -> dict:
    """Parameters and model-state bytes of global rank ``rank`` of a ``world_size``-rank run
    of ``cfg`` (a validated :class:`~loom.config.LoomConfig`), counted on the meta device.

    Returns ``params`` (elements held by this rank), ``expert_params`` (of which expert-parallel),
    ``pp_rank``, ``tp_rank``, ``dp`` (d x c: the distributed optimizer's group), ``edp``
    (expert-data-parallel size), ``zero`` (0, 1 = distributed optimizer, 3 = FSDP2), and
    ``weights_bytes``, ``gradients_bytes``, ``optimizer_bytes`` (see the module docstring;
    ``grad_bytes`` None: the config's own).
    Raises RuntimeError when a process group is already initialized."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model_chunks
    from loom.parallel.random import RNGTracker
    from loom.parallel.registry import named_parameters
    from loom.config.optimizer_muon import muon_managed
    from loom.planner.cli_args import gradient_option, optimizer_option
    from loom.planner.muon import MUON_STATE_BYTES

    if dist.is_initialized():
        raise RuntimeError("count_rank_states: a process group already exists; the fake one "
                           "would replace it (call it before init_process_group)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        c = _rank_coords(cfg, world_size)
        mesh = ParallelMesh.build(tp=c["tp"], pp=c["pp"], cp=c["cp"], ep=c["ep"], etp=c["etp"],
                                  device=torch.device("meta"))  # the parallel layers' shards too
        family = get_family(cfg.model.model_type)
        unseeded = copy.copy(cfg)  # seed None: no initialization (meta tensors hold no data)
        unseeded.training = replace(cfg.training, seed=None)
        with torch.device("meta"):
            chunks = build_model_chunks(family, unseeded, mesh, RNGTracker(torch.device("cpu")))
        n = nx = muon = muon_x = 0
        for name, prm, meta in named_parameters(chunks):
            local = prm.to_local() if hasattr(prm, "to_local") else prm
            n += local.numel()
            expert = getattr(meta, "expert_parallel", False)
            if expert:
                nx += local.numel()
            if muon_managed(name, local.ndim, meta.embedding_or_output):
                muon += local.numel() * (not expert)
                muon_x += local.numel() * expert
        dp = mesh.dp_size * mesh.sizes["cp"]
        edp = len(mesh.ranks["edp"])  # Megatron's expert-DP group (may span TP and CP ranks)
        coords = dict(pp_rank=mesh.pp_rank, tp_rank=mesh.tp_rank)
    finally:
        dist.destroy_process_group()
        forget_fake_meshes()
    t = cfg.training
    zero = 3 if (getattr(t, "use_torch_fsdp2", False) or (t.zero_stage or 0) >= 3) else \
        (1 if t.use_distributed_optimizer or (t.zero_stage or 0) >= 1 else 0)
    wb = 2 if (t.bf16 or t.fp16) else 4
    if grad_bytes is None:
        grad_bytes = gradient_option(t)["grad_bytes"]
    dense = n - nx
    priced = optimizer_option(t)  # every optimizer loom train accepts is priced
    state = priced["optimizer_state_bytes"]
    # 16-bit runs keep a master copy (fp32, or 2 bytes with the precision-aware optimizer);
    # fp32 runs' weights are the master copy
    opt_per = priced.get("master_bytes", 4.0) + state if wb == 2 else state
    # FSDP2: the local shards above; ZeRO-1: ceil shares of the dense and expert elements
    opt_elems = n if zero != 1 else math.ceil(dense / dp) + math.ceil(nx / edp)
    # Muon: its weights keep one momentum instead of AdamW's two moments (the same shares)
    saved = 0 if not priced.get("muon_ns_steps") else (MUON_STATE_BYTES - state) * (
        muon + muon_x if zero != 1 else muon / dp + muon_x / edp)
    return dict(params=n, expert_params=nx, dp=dp, edp=edp, zero=zero, **coords,
                weights_bytes=wb * n, gradients_bytes=grad_bytes * n,
                optimizer_bytes=(opt_per * opt_elems + saved) * (
                    1.0 - priced.get("optimizer_offload_fraction", 0.0)))


def representative_ranks(cfg: LoomConfig, world_size: int) -> list[int]:
    """Global ranks to count: the first rank and the last one (first and last pipeline stage
    under loom's rank order, PP outermost), once when equal."""
    return sorted({0, world_size - 1})


def planner_stage_params(cfg: LoomConfig, world_size: int) -> dict:
    """The planner's formula for the same layout (:func:`loom.planner.memory.stage_params`):
    parameters per GPU of the ``first`` and ``last`` pipeline stage (and ``middle``)."""
    from loom.planner.layout import make_layouts
    from loom.planner.memory import stage_params
    from loom.planner.predict import layout_of

    L = make_layouts(layout_of(cfg, world_size))
    P = stage_params(cfg.model, L, cfg.model.seq_length)
    return {k: float(v[0]) for k, v in P.items()}


def format_counts(cfg: LoomConfig, world_size: int) -> str:
    """Lines for ``loom train --dry-run``: the exact counts of :func:`representative_ranks`
    next to the planner's formula, GB = 1e9 bytes."""
    GB = 1e9
    formula = planner_stage_params(cfg, world_size)
    lines = [f"exact model states (meta device, fake process group of {world_size} ranks):"]
    for r in representative_ranks(cfg, world_size):
        c = count_rank_states(cfg, world_size, r)
        stage = "first" if c["pp_rank"] == 0 else "last"
        if cfg.parallel.pipeline_model_parallel_size == 1:
            stage = "first"
        f = formula[stage]
        lines.append(
            f"  rank {r} (pp stage {c['pp_rank']}, tp rank {c['tp_rank']}): {c['params']:,} params "
            f"(planner formula {f:,.0f}, {100 * (f / max(c['params'], 1) - 1):+.2f}%); weights "
            f"{c['weights_bytes'] / GB:.3f}, grads {c['gradients_bytes'] / GB:.3f}"
            + f", optimizer {c['optimizer_bytes'] / GB:.3f} GB")
    return "\n".join(lines)
