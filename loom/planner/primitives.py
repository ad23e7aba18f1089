"""Building blocks shared by the time models: the alpha-beta collectives of references.md and
the size-aware GEMM efficiency (fitted constants ``GEMM_EFFICIENCY``, ``GEMM_HALF_DIM``; see
:mod:`loom.planner.timing` for the fit). Split out of ``timing.py`` so that the dense
(:mod:`loom.planner.timing`) and the mixture-of-experts (:mod:`loom.planner.moe`) time models use
the same formulas without importing each other.
"""

from __future__ import annotations

import numpy as np

from loom.planner.hardware import Cluster

# Fitted (with MEM_TRAFFIC in timing.py and HOPPER_GEMM_EFFICIENCY in hardware.py) by one least
# squares of the log error over 37 published numbers (benchmarks.planner_sources.fit.fit_compute; reproduce
# with `python -m benchmarks.planner_fit`): NAR table 1 rows 1.7B-1008B (10, hardware TFLOP/s
# per GPU, at the authors' layouts: validation.NAR_TABLE1_SCRIPT), KOR table 3 rows
# 22B/175B/530B/1T x full / SP+selective (8, iteration s), KOR table 4
# baseline/SP/full/selective/selective+SP x fwd/bwd (10, ms per 22B layer), Megatron-Core
# r0.8.0 H100 weak scaling rows 1.7B-462B (9, model TFLOP/s per GPU; constrains h0 through the
# ridge scaling). Tables: loom/planner/presets.py, benchmarks/planner_sources/validation.py.
GEMM_EFFICIENCY = 0.817
GEMM_HALF_DIM = 105.6
A100_RIDGE = 312e12 / 2.039e12  # FLOP per HBM byte of the GPU GEMM_HALF_DIM was fitted on


# -- collectives: alpha-beta ring formulas (references.md) ---------------------------------------

def all_reduce_time(n, nbytes, bw, alpha):
    """Ring all-reduce of ``nbytes`` over ``n`` ranks: ``2 (n-1)/n M/W + 2 (n-1) alpha`` s."""
    n = np.asarray(n, dtype=np.float64)
    return np.where(n > 1, 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha, 0.0)


def all_gather_time(n, nbytes, bw, alpha):
    """Ring all-gather (or reduce-scatter) of ``nbytes`` total: ``(n-1)/n M/W + (n-1) alpha``."""
    n = np.asarray(n, dtype=np.float64)
    return np.where(n > 1, (n - 1) / n * nbytes / bw + (n - 1) * alpha, 0.0)


reduce_scatter_time = all_gather_time


def link(cross, cluster: Cluster) -> tuple:
    """Bandwidth (bytes/s per GPU) and per-step latency (s) of a group's slowest link: the
    network's where ``cross`` (the group spans nodes; array or bool), else the node's."""
    return (np.where(cross, cluster.inter_bw, cluster.intra_bw),
            np.where(cross, cluster.inter_alpha, cluster.intra_alpha))


def p2p_time(nbytes, bw, alpha):
    """Point-to-point send of ``nbytes``: ``M/W + alpha`` seconds."""
    return nbytes / bw + alpha


def hierarchical_all_reduce_time(n, per_node, nbytes, cluster: Cluster):
    """All-reduce over ``n`` ranks of which ``per_node`` share a node (seconds): ring inside the
    node on NVLink, then across the ``n / per_node`` nodes on ``nbytes / per_node`` per GPU (each
    GPU drives its own NIC), the slowest link the group crosses."""
    k = np.maximum(1.0, np.minimum(n, per_node))
    nodes = n / k
    intra = all_reduce_time(k, nbytes, cluster.intra_bw, cluster.intra_alpha)
    inter = all_reduce_time(nodes, nbytes / k, cluster.inter_bw, 0.0)
    return intra + inter + inter_node_latency(nodes, cluster.inter_alpha)


def inter_node_latency(nodes, alpha):
    """Latency (s) of one all-reduce across ``nodes`` nodes: NCCL's ring pays ``2 (N - 1)``
    hops, its double binary tree ``2 log2 N`` (up and down; Sanders, Speck, Traeff 2009,
    "Two-tree algorithms for full bandwidth broadcast, reduction and scan", the algorithm NCCL
    2.4+ uses across nodes); NCCL picks the faster, so ``2 alpha min(N - 1, log2 N)`` (equal up
    to 2 nodes; at 2048 nodes 11 hops instead of 2047)."""
    nodes = np.asarray(nodes, dtype=np.float64)
    hops = np.minimum(nodes - 1, np.log2(np.maximum(nodes, 1.0)))
    return np.where(nodes > 1, 2 * hops * alpha, 0.0)


def all_reduce_latency(n, per_node, cluster: Cluster):
    """The latency part (s) of :func:`hierarchical_all_reduce_time` (its time at 0 bytes)."""
    k = np.maximum(1.0, np.minimum(n, per_node))
    return (np.where(k > 1, 2 * (k - 1) * cluster.intra_alpha, 0.0)
            + inter_node_latency(n / k, cluster.inter_alpha))


def hierarchical_reduce_scatter_time(n, per_node, nbytes, cluster: Cluster):
    """Reduce-scatter (or all-gather: the same steps reversed) of ``nbytes`` over ``n`` ranks of
    which ``per_node`` share a node (seconds), on the rail-optimized two-level network of a DGX
    cluster (one NIC per GPU, NIC ``i`` of every node on rail switch ``i``: NVIDIA DGX SuperPOD
    reference architecture; MegaScale sec 3.6 "eight 200G NICs ... multi-rail"):

    * bandwidth: ``(k - 1)/k M / intra_bw`` inside the node, then every GPU moves its ``1/k``
      share across the ``N = n/k`` nodes on its own rail, ``(N - 1)/N (M/k) / inter_bw`` (half
      of :func:`hierarchical_all_reduce_time`'s bandwidth terms: a ring all-reduce is a
      reduce-scatter followed by an all-gather, Patarasuk and Yuan 2009);
    * latency: :func:`reduce_scatter_latency`, ring hops only: NCCL runs ReduceScatter and
      AllGather as rings (its double binary tree serves AllReduce; NVLS and CollNet need
      NVSwitch/SHARP hardware; the PAT algorithm for one GPU per node came with NCCL 2.23,
      after the runs modelled here), so the latency grows as ``N - 1`` hops, not ``log2 N``:
      at 192 nodes 191 hops of ~10 us, 1.9 ms per collective and per bucket."""
    k = np.maximum(1.0, np.minimum(n, per_node))
    nodes = n / k
    intra = all_gather_time(k, nbytes, cluster.intra_bw, 0.0)
    inter = all_gather_time(nodes, nbytes / k, cluster.inter_bw, 0.0)
    return intra + inter + reduce_scatter_latency(n, per_node, cluster)


def reduce_scatter_latency(n, per_node, cluster: Cluster):
    """Latency (s) of one ring reduce-scatter / all-gather over ``n`` ranks, ``per_node`` to a
    node: ``NCCL_BASE_LATENCY + (k - 1) intra_alpha + (N - 1) inter_alpha``. The per-hop
    latencies are the cluster's alphas (NCCL's own tuning model, ``src/graph/tuning.cc``, uses
    5.7 us per NVLink hop and 6.6 us per network hop for Ring/Simple, plus ``NCCL_BASE_LATENCY``
    per collective)."""
    k = np.maximum(1.0, np.minimum(n, per_node))
    nodes = n / k
    return np.where(n > 1, NCCL_BASE_LATENCY + (k - 1) * cluster.intra_alpha
                    + np.maximum(nodes - 1, 0.0) * cluster.inter_alpha, 0.0)


# NCCL's fixed cost of one collective (launch and protocol set-up), Ring/Simple: ``baseLat`` of
# NCCL's tuning model (src/graph/tuning.cc, NCCL 2.4-2.18: 8.4 us).
NCCL_BASE_LATENCY = 8.4e-6


# -- compute --------------------------------------------------------------------------------------

def gemm_efficiency(width, tokens, cluster: Cluster | None = None):
    """Achievable fraction of peak FLOP/s of a GEMM whose per-GPU width is ``width`` and whose
    token dimension is ``tokens``: ``e / (1 + h0/width + h0/tokens)``.

    Roofline origin: a ``[T, w] x [w, n]`` GEMM moves ``2 (T w + w n + T n)`` bytes for
    ``2 T w n`` FLOPs, so memory adds ``(peak / hbm_bw) (1/T + 1/w + 1/n)`` to the time per FLOP
    at peak; ``h0`` is therefore proportional to the GPU's ridge point ``peak / hbm_bw``:
    ``h0 = GEMM_HALF_DIM x ridge / ridge(A100-80GB)`` (A100: 153 FLOP/byte, h0 = 108; H100 SXM:
    295 FLOP/byte, h0 = 208). ``e``: the GPU generation's large-GEMM efficiency
    (``cluster.gemm_efficiency``, else ``GEMM_EFFICIENCY``). Both fitted, see the module
    docstring; a cluster file's ``gemm_half_dim`` overrides h0."""
    e = (cluster.gemm_efficiency if cluster and cluster.gemm_efficiency else GEMM_EFFICIENCY)
    if cluster and cluster.gemm_half_dim:
        h0 = cluster.gemm_half_dim
    elif cluster:
        h0 = GEMM_HALF_DIM * (cluster.peak_flops / cluster.hbm_bw) / A100_RIDGE
    else:
        h0 = GEMM_HALF_DIM
    return e / (1 + h0 / np.asarray(width, dtype=np.float64) + h0 / np.asarray(tokens, dtype=np.float64))


# Rows of Q one thread block of the fused (flash) attention kernel holds on chip: FlashAttention-2's
# ``kBlockM`` for every head dim up to 256 on A100/H100 (Dao 2023, "FlashAttention-2", sec. 3.3;
# flash-attn's ``flash_fwd_launch_template.h``), the Triton kernel's ``BLOCK`` of 128.
FLASH_Q_TILE = 128


def attention_efficiency(head_dim, kv_tokens, fused: bool, cluster: Cluster | None = None):
    """Achievable fraction of peak FLOP/s of the attention scores' batched GEMMs
    (``Q K^T`` and ``P V``) of one head of width ``head_dim`` over ``kv_tokens`` keys.

    Unfused (``fused`` False): :func:`gemm_efficiency` ``(d, kv_tokens)``: the ``[s, s]`` scores
    round-trip HBM, so the bytes per FLOP grow as ``1/d``. Fused (flash attention): the scores
    stay on chip and a thread block of ``FLASH_Q_TILE`` query rows streams K and V once, so the
    FLOP per HBM byte is set by the tile (``2 Br s d`` FLOPs per ``2 s d`` bytes of K or V), not by
    ``d`` (Dao 2023, sec. 3.1): :func:`gemm_efficiency` ``(FLASH_Q_TILE, kv_tokens)``. Equal to
    the unfused value at ``d = 128``."""
    width = FLASH_Q_TILE if fused else head_dim
    return gemm_efficiency(width, kv_tokens, cluster)
