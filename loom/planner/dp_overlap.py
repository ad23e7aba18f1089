"""How much of the data-parallel communication a step hides, and what hiding it costs: the
bucket schedule of the overlapped gradient reduction and parameter all-gather
(:func:`exposed_grad_sync`, :func:`bucket_elems`), PyTorch FSDP's per-layer prefetch
(:func:`fsdp_exposed`), the SMs a hidden NCCL collective takes from the compute it overlaps
(:func:`overlap_interference`) and the network the DP collectives see (:func:`dp_network`).
Used by :func:`loom.planner.timing.time_terms`; pure functions of arrays and
:class:`~loom.planner.layout.Options` (docs/planner.md, "Data-parallel overlap")."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from loom.planner.hardware import Cluster, sm_count
from loom.planner.layout import Options

# Not fitted: SMs a data-parallel NCCL collective occupies while it runs. NCCL launches one CTA
# per channel and a CTA holds its SM exclusively ("NCCL CTAs won't share an SM with compute
# kernels"); on a DGX with 8 NICs NCCL "would use 16 SMs" (S. Jeaugey, NCCL maintainer,
# NVIDIA/nccl#689); a 3-node H100 run logs 16 ring channels (NVIDIA/nccl#1453). Of the same
# order: DeepSeek-V3 (technical report sec 3.2.2) gives 20 of 132 SMs to its all-to-all.
NCCL_CHANNELS = 16


def bucket_elems(n_dp, opts: Options, params=None):
    """Elements per DP bucket: ``max(ddp_bucket_elems, ddp_bucket_per_rank x n_dp)`` (Megatron-
    Core's ``max(40M, 1M d)``, :class:`loom.planner.layout.Options`); with
    ``opts.ddp_bucket_count`` ``n`` and the stage's ``params``, loom train's default
    ``max(ddp_bucket_per_rank x n_dp, min(ddp_bucket_elems, ceil(params / n)))``
    (``loom.parallel.grad_buffer.default_bucket_size``: ``clamp(ceil(P / 4), 250k d, 40M)``)."""
    if opts.ddp_bucket_count and params is not None:
        return np.maximum(opts.ddp_bucket_per_rank * n_dp,
                          np.minimum(opts.ddp_bucket_elems,
                                     np.ceil(params / opts.ddp_bucket_count)))
    return np.maximum(opts.ddp_bucket_elems, opts.ddp_bucket_per_rank * n_dp)


def exposed_grad_sync(sync_s, backward_s, params, opts: Options, n_dp=1.0, overlap=None):
    """Exposed time (s) of the DP gradient reduction ``sync_s`` (s) behind the last micro-batch's
    backward ``backward_s`` (s) under the bucket schedule: ``K = ceil(params / bucket)`` equal
    buckets become ready uniformly during backward and are reduced one after another, so the
    last one (``sync/K``) is always exposed and the rest only when reduction is slower than
    backward: ``max(sync/K, sync - backward (1 - 1/K))`` (PyTorch DDP / Megatron-Core
    ``--overlap-grad-reduce``, bucket ``opts.ddp_bucket_elems`` elements). The same schedule
    mirrored serves the weight all-gather behind the next forward (``backward_s`` = that
    forward; the first bucket is waited for before the first layer runs). ``overlap``: whether
    it is overlapped (None: ``opts.overlap_grad_reduce``); without overlap: ``sync_s``."""
    if not (opts.overlap_grad_reduce if overlap is None else overlap):
        return np.asarray(sync_s, dtype=np.float64)
    K = np.maximum(1.0, np.ceil(params / bucket_elems(n_dp, opts, params)))
    return np.maximum(sync_s / K, sync_s - backward_s * (1 - 1 / K))


def nccl_sm_fraction(cluster: Cluster) -> float:
    """Fraction of the GPU's SMs that a running NCCL collective takes from the compute it
    overlaps: :data:`NCCL_CHANNELS` / the SM count of ``cluster.gpu`` (:data:`SM_COUNTS`; A100
    0.148, H100 0.121; :func:`loom.planner.hardware.sm_count`). 0 for a GPU of unknown SM
    count."""
    sms = sm_count(cluster.gpu)
    return NCCL_CHANNELS / sms if sms else 0.0


def overlap_interference(total_s, exposed_s, cluster: Cluster, on: bool = True):
    """Time (s) a hidden collective adds to the compute it overlaps: the hidden part
    ``max(0, total_s - exposed_s)`` runs on :func:`nccl_sm_fraction` of the SMs, which that
    compute loses for as long (``Options.overlap_interference``; 0 when ``on`` is false). E.g.
    2.0 s of DP collectives of which 0.5 s exposed on an A100: 1.5 x 16 / 108 = 0.222 s."""
    frac = nccl_sm_fraction(cluster) if on else 0.0
    return np.maximum(0.0, np.asarray(total_s, dtype=np.float64) - exposed_s) * frac


def fsdp_exposed(ag_s, rs_s, fwd_s, bwd_s, n_layers):
    """Exposed ZeRO-3 time (s) of one micro-batch under PyTorch FSDP's per-layer prefetch
    (``Options.zero3_prefetch``; FSDP/FSDP2 ``forward_prefetch`` / ``backward_prefetch``: the next
    layer's all-gather is issued while this layer computes). ``n_layers`` equal layers; ``ag_s``
    one all-gather of all of them, ``rs_s`` one reduce-scatter, ``fwd_s`` / ``bwd_s`` the
    micro-batch's forward / backward compute. Forward: the first layer's all-gather is waited
    for, each later one hides behind a layer's forward, ``ag/n + (1 - 1/n) max(0, ag - fwd)``;
    backward: the layer all-gathers again and its gradients are reduce-scattered behind the
    next layer's backward, the last one exposed, ``rs/n + (1 - 1/n) max(0, ag + rs - bwd)``."""
    k = 1.0 - 1.0 / n_layers
    return (ag_s / n_layers + k * np.maximum(0.0, ag_s - fwd_s)
            + rs_s / n_layers + k * np.maximum(0.0, ag_s + rs_s - bwd_s))


def dp_network(cluster: Cluster) -> Cluster:
    """The cluster as the data-parallel collectives see it: ``inter_bw`` x
    ``cluster.dp_net_efficiency`` (the achieved fraction of the inter-node bandwidth, fitted by
    ``--calibrate-from``; 1.0 shipped), everything else (intra-node bandwidth, alphas) as is."""
    eff = getattr(cluster, "dp_net_efficiency", 1.0)
    return cluster if eff == 1.0 else replace(cluster, inter_bw=cluster.inter_bw * eff)
