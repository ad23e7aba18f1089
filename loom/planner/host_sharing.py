"""Ranks sharing a CPU host's cores: how the planner's one-device-per-rank terms become the
step time of ``R`` single-threaded processes on ``C`` cores (the calibration,
:mod:`loom.planner.calibrate`, measures one rank alone on one core).

* :func:`oversubscribed`: compute and memory bandwidth scaled by ``min(1, C/R)``;
* :func:`shared_cores_time` and :func:`shared_cores_pipeline_time`: Graham's bounds (total work
  over ``C``, the critical path with a core per rank) for a step without and with pipeline
  stages;
* :func:`host_overlap_options`: the planner's GPU overlaps switched off when no core is free to
  progress a gloo transfer.

``benchmarks/planner_vs_measured.py`` uses them for loom's own runs on this machine.
"""

from __future__ import annotations

import os

from loom.planner.hardware import Cluster


def oversubscribed(cluster: Cluster, ranks: int, cores: int | None = None) -> Cluster:
    """The cluster as one of ``ranks`` processes sharing ``cores`` CPU cores sees it: compute
    and memory bandwidth scaled by ``min(1, cores / ranks)`` (the planner assumes one device
    per rank; the calibration measures one rank alone on one core)."""
    from dataclasses import replace

    cores = cores or os.cpu_count() or 1
    share = min(1.0, cores / max(1, ranks))
    notes = dict(cluster.notes, oversubscription=dict(ranks=ranks, cores=cores, share=share))
    return replace(cluster, num_gpus=ranks, gpus_per_node=max(ranks, 1),
                   peak_flops=cluster.peak_flops * share, hbm_bw=cluster.hbm_bw * share,
                   notes=notes)


def shared_cores_time(time_terms_s: dict, ranks: int, cores: int | None = None) -> float:
    """Step time (s) of ``ranks`` processes on ``cores`` CPU cores from the planner's terms for
    one core per rank (``time_terms_s``: :func:`loom.planner.predict.predict_layout`'s
    ``time_s``): at least the critical path ``T_1`` (the iteration with a core each) and at
    least the busy time of all ranks shared by the cores, ``R (T_1 - bubble) / C`` (a rank
    idle in a pipeline bubble yields its core; Graham's bound for ``R`` jobs on ``C``
    processors, Graham 1969, "Bounds on multiprocessing timing anomalies"). With ``C >= R``
    this is ``T_1``; without PP it is ``T_1 R / C``, the fair-share slowdown."""
    cores = cores or os.cpu_count() or 1
    t1 = float(time_terms_s["iteration"])
    busy = t1 - float(time_terms_s.get("pp_bubble", 0.0))
    return max(t1, ranks * busy / cores)


def host_overlap_options(ranks: int, cores: int | None = None) -> dict:
    """:class:`loom.planner.layout.Options` overrides for ``ranks`` single-threaded processes
    on ``cores`` CPU cores. The planner hides communication under compute where a GPU runs
    them side by side (NCCL kernels on their own SMs, a copy engine); on a CPU host a gloo
    transfer needs a core too, and with ``ranks >= cores`` every core is already running a
    rank's compute, so nothing is hidden: ``overlap_tp_comm`` off (loom's TP collectives are
    synchronous anyway, loom/parallel/mappings.py), ``overlap_grad_reduce`` off,
    ``overlap_cp_comm`` off (the ring's ``isend``/``irecv`` of the next K/V block,
    loom/parallel/context/ring.py, progress on gloo's thread) and ``zero3_overlap`` 0
    (FSDP2's prefetched all-gathers run on gloo's thread, which has no free core). With more
    cores than ranks: no override (the planner's GPU overlap model)."""
    cores = cores or os.cpu_count() or 1
    if ranks < cores:
        return {}
    return dict(overlap_tp_comm=False, overlap_grad_reduce=False, overlap_cp_comm=False,
                zero3_overlap=0.0)


# the planner's per-micro-batch work terms (m x one stage's micro-batch; time_terms' docstring)
STAGE_WORK_TERMS = ("compute", "recompute", "elementwise", "tp_comm", "cp_comm", "ep_comm")


def shared_cores_pipeline_time(pipelined_s: dict, unpipelined_s: dict, ranks: int, pp: int,
                               microbatches: int, cores: int | None = None) -> float:
    """Step time (s) of a ``pp``-stage pipeline of ``ranks`` processes on ``cores`` CPU cores.

    ``pipelined_s``: the planner's terms of the layout with one core per rank (they describe
    its *slowest* stage: ``m`` x that stage's micro-batch, plus the bubble
    ``(p - 1) x`` that stage's micro-batch); ``unpipelined_s``: the terms of the same layout
    with ``pp = 1`` (the same ``tp``, ``cp``, ``dp``, micro-batch and ``m``: one rank runs every
    stage, so its work terms are ``m`` x the *sum* of the stages' micro-batch times).

    A rank waiting in a pipeline receive or a gloo collective sleeps, so the ``C`` cores serve
    only the busy ranks, and the step is bounded below by (Graham 1969, "Bounds on
    multiprocessing timing anomalies", the same bound as :func:`shared_cores_time`):

    * the machine's total CPU work over ``C``: ``ranks / pp`` copies of the unpipelined
      iteration (the pipelines' stages together do what one unpipelined rank does) plus every
      rank's point-to-point copies (``pp_comm``);
    * the critical path with a core per rank: the slowest stage's ``m`` micro-batches, its
      ``pp_comm``, DP and optimizer terms, plus fill and drain, which is one micro-batch through
      every *other* stage (forward to reach it, backward to return), i.e.
      ``(sum of the stages - slowest) / m``. With equal stages that is the planner's bubble
      ``(p - 1) t_mb`` (NAR sec 2.2); loom's stages are not equal (the last one also runs the
      output layer and the cross-entropy, ~2.3 layers of this benchmark's model), and the
      planner's bubble prices every stage at the slowest one's speed.

    Returns ``max(critical path, total work / C)``. ``pp = 1``: :func:`shared_cores_time`."""
    cores = cores or os.cpu_count() or 1
    if pp <= 1:
        return shared_cores_time(pipelined_s, ranks, cores)
    m = max(1, int(microbatches))
    stage = sum(float(pipelined_s.get(k, 0.0)) for k in STAGE_WORK_TERMS)
    whole = sum(float(unpipelined_s.get(k, 0.0)) for k in STAGE_WORK_TERMS)
    t1 = float(pipelined_s["iteration"])
    fill_drain = max(0.0, whole - stage) / m
    critical = t1 - float(pipelined_s.get("pp_bubble", 0.0)) + fill_drain
    work = ranks / pp * float(unpipelined_s["iteration"]) + ranks * float(
        pipelined_s.get("pp_comm", 0.0))
    return max(critical, work / cores)
