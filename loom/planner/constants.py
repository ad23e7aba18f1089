"""The fitted constants of the planner's time model, in one value object, and the rows each one
is fitted on.

The shipped values live next to the code that uses them (each with a comment naming its rows):

* ``GEMM_EFFICIENCY``, ``GEMM_HALF_DIM`` (:mod:`loom.planner.primitives`), ``MEM_TRAFFIC``
  (:mod:`loom.planner.timing`) and ``HOPPER_GEMM_EFFICIENCY`` (:mod:`loom.planner.hardware`):
  one least-squares fit of the squared log error over NAR table 1 (10 rows, hardware TFLOP/s
  per GPU), KOR table 3 (4 models x 2 modes, iteration seconds), KOR table 4 (5 modes x
  forward/backward, ms of one 22B layer) and the 9 rows of Megatron-Core r0.8.0's H100
  weak-scaling table (model TFLOP/s per GPU): 37 numbers.
* ``ZERO3_OVERLAP`` (:mod:`loom.planner.timing`): minimax of the log error of the days for 300B
  tokens over the 6 ZeRO-3 rows of NAR table 2.

:data:`FIT_SETS` is the machine-readable form of that list (what :mod:`benchmarks.planner_sources.fit` refits);
:data:`PRIORS` is what a constant falls back to when every row it is fitted on is held out (the
leave-one-source-out protocol of :func:`benchmarks.planner_sources.fit.leave_one_source_out`). Not fitted:
``ZERO3_LINK_EFFICIENCY`` (1.0), link bandwidths and latencies (``hardware.py``: nccl-tests-style
achievable figures), ``MOE_LOAD_IMBALANCE`` (``moe.py``), the optimizer's 30 bytes/param.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from loom.planner.hardware import HOPPER_GEMM_EFFICIENCY, lookup_gpu, make_cluster
from loom.planner.primitives import A100_RIDGE, GEMM_EFFICIENCY, GEMM_HALF_DIM
from loom.planner.timing import MEM_TRAFFIC, ZERO3_OVERLAP


@dataclass(frozen=True)
class Constants:
    """The fitted constants: ``gemm_efficiency`` (A100 and non-Hopper large-GEMM fraction of
    peak), ``gemm_half_dim`` (GEMM dimension at which efficiency halves, on the A100's ridge
    point; scaled by ``peak / hbm_bw`` on other GPUs), ``mem_traffic`` (HBM bytes moved per
    activation byte), ``hopper_gemm_efficiency`` (H100/H200/GH200 large-GEMM fraction of peak),
    ``zero3_overlap`` (fraction of a micro-batch's compute hiding ZeRO-3 communication),
    ``dp_net_efficiency`` (:attr:`loom.planner.hardware.Cluster.dp_net_efficiency`: the data-
    parallel collectives' share of the inter-node bandwidth; fitted to no published table, 1.0:
    only the 3-shot protocol calibrates it, as ``--calibrate-from`` does).
    Defaults: the shipped values."""

    gemm_efficiency: float = GEMM_EFFICIENCY
    gemm_half_dim: float = GEMM_HALF_DIM
    mem_traffic: float = MEM_TRAFFIC
    hopper_gemm_efficiency: float = HOPPER_GEMM_EFFICIENCY
    zero3_overlap: float = ZERO3_OVERLAP
    dp_net_efficiency: float = 1.0


SHIPPED = Constants()

# Which published sources (benchmarks.planner_sources.fit.SOURCES) each group of constants is fitted on.
# "NAR t2" contributes its ZeRO-3 rows only; "KOR" is KOR tables 3 and 4.
FIT_SETS = MappingProxyType({
    # gemm_efficiency, gemm_half_dim, mem_traffic, hopper_gemm_efficiency: one joint fit
    "compute": ("NAR t1", "KOR", "MC-H100 weak"),
    "zero3": ("NAR t2",),  # zero3_overlap
})

# Refit of the Hopper constant alone when every H100 source of the compute fit is held out
# (leave-one-source-out of MC-H100): the other H100 throughput sources, bf16 (torchtitan,
# llm-foundry, Llama 3), mean squared log error given the A100 constants of that fit.
# Added in issue 26 after the prior below had given MC-H100 weak 14.4% / 25.7% held out.
FALLBACK_SETS = MappingProxyType({"hopper_gemm_efficiency": ("TT", "LF-H100", "Llama 3")})

# Fallbacks when a group's every source is held out, chosen before any held-out error was seen:
# Hopper without Hopper rows gets the A100 gemm_efficiency of the same fit (what the device
# table does for any GPU without its own constant); ZeRO-3 without ZeRO-3 rows gets full
# overlap, 1.0 (DeepSpeed's prefetching design goal: communication hidden behind compute).
PRIORS = MappingProxyType({"hopper_gemm_efficiency": "gemm_efficiency", "zero3_overlap": 1.0})


def fitted_cluster(gpu: str, num_gpus: int, constants: Constants | None = None,
                   gpus_per_node: int | None = None, **overrides):
    """:func:`loom.planner.hardware.make_cluster` with the compute constants of ``constants``
    (None: the shipped ones, i.e. plain ``make_cluster``): Hopper entries get
    ``hopper_gemm_efficiency``, the others ``gemm_efficiency``; ``gemm_half_dim`` is scaled by
    the GPU's ridge point ``peak / hbm_bw`` over the A100's, as
    :func:`loom.planner.primitives.gemm_efficiency` does for the shipped value."""
    cl = make_cluster(gpu, num_gpus, gpus_per_node, **overrides)
    if constants is None:
        return cl
    from dataclasses import replace

    hopper = lookup_gpu(gpu).gemm_efficiency > 0  # only the Hopper entries carry their own
    e = constants.hopper_gemm_efficiency if hopper else constants.gemm_efficiency
    h0 = constants.gemm_half_dim * (cl.peak_flops / cl.hbm_bw) / A100_RIDGE
    return replace(cl, gemm_efficiency=e, gemm_half_dim=h0, mem_traffic=constants.mem_traffic,
                   dp_net_efficiency=constants.dp_net_efficiency)
