"""Communication terms of planner v2 against hand-computed values: the bucket schedule of the
overlapped DP gradient reduction and the flat-ring ZeRO-3 model."""

from __future__ import annotations

import numpy as np
import pytest

from loom.planner.hardware import make_cluster
from loom.planner.layout import Options, make_layouts
from loom.planner.memory import stage_params
from loom.planner.presets import gpt
from loom.planner.dp_overlap import exposed_grad_sync
from loom.planner.timing import ZERO3_OVERLAP, all_gather_time, layer_times, time_terms


def test_bucket_schedule_by_hand():
    o = Options(ddp_bucket_elems=40e6)
    # 2 buckets; reduction (1 s) faster than backward (2 s): only the last bucket is exposed
    assert float(exposed_grad_sync(1.0, 2.0, 80e6, o)) == pytest.approx(0.5)
    # reduction (3 s) slower than backward (2 s): 3 - 2 x (1 - 1/2) = 2 s exposed
    assert float(exposed_grad_sync(3.0, 2.0, 80e6, o)) == pytest.approx(2.0)
    # one bucket: nothing hidden; no overlap: nothing hidden
    assert float(exposed_grad_sync(1.0, 5.0, 10e6, o)) == pytest.approx(1.0)
    assert float(exposed_grad_sync(1.0, 5.0, 80e6, Options(overlap_grad_reduce=False))) == 1.0
    # 100 buckets, 1 s of reduction behind 10 s of backward: 10 ms exposed
    assert float(exposed_grad_sync(1.0, 10.0, 4e9, o)) == pytest.approx(0.01)


def test_zero3_flat_ring_by_hand():
    """ZeRO-3 over 16 GPUs on 2 nodes: per micro-batch two all-gathers of the bf16 weights and a
    reduce-scatter of the fp32 gradients, each a flat ring at the NIC bandwidth, minus
    ZERO3_OVERLAP x the micro-batch's compute."""
    m = gpt(24, 2304, 24)
    cl = make_cluster("A100-80GB", 16)
    opts = Options(grad_bytes=4)
    L = make_layouts(dict(tp=1, pp=1, dp=16, mbs=1, zero=3, recompute="none"))
    B = 32  # m = 2 micro-batches per GPU
    tt = time_terms(m, L, B, 2048, cl, opts)
    P = float(stage_params(m, L, 2048)["first"][0])
    ag = float(all_gather_time(16, 2 * P, cl.inter_bw, cl.inter_alpha))
    rs = float(all_gather_time(16, 4 * P, cl.inter_bw, cl.inter_alpha))
    lt = layer_times(m, 2048, L, cl, opts)
    comp = 24 * float(3 * (lt["gemm"][0] + lt["attn"][0]) + 3 * lt["elem"][0])
    want = 2 * max(0.0, 2 * ag + rs - ZERO3_OVERLAP * comp)
    assert want > 0
    assert float(tt["dp_comm"][0]) == pytest.approx(want)
    assert float(tt["dp_comm_total"][0]) == pytest.approx(2 * (2 * ag + rs))


def test_gemm_half_dim_follows_the_ridge_point():
    """h0 = GEMM_HALF_DIM x (peak / hbm_bw) / (A100's 312e12 / 2.039e12): A100-80GB keeps the
    fitted 103.4, H100 SXM (989e12 / 3.35e12) gets 103.4 x 295.2 / 153.0 = 199.5."""
    from loom.planner.timing import GEMM_EFFICIENCY, GEMM_HALF_DIM, gemm_efficiency
    a100, h100 = make_cluster("A100-80GB"), make_cluster("H100-80GB")
    e = a100.gemm_efficiency or GEMM_EFFICIENCY
    assert float(gemm_efficiency(1024, 4096, a100)) == pytest.approx(
        e / (1 + GEMM_HALF_DIM / 1024 + GEMM_HALF_DIM / 4096))
    h0 = GEMM_HALF_DIM * (989e12 / 3.35e12) / (312e12 / 2.039e12)
    assert h0 == pytest.approx(203.7, abs=0.1)
    assert float(gemm_efficiency(1024, 4096, h100)) == pytest.approx(
        h100.gemm_efficiency / (1 + h0 / 1024 + h0 / 4096))
    assert h100.gemm_efficiency == 0.746 and h100.tdp_w == 700 and a100.tdp_w == 400


def test_straggler_allowance_by_hand():
    """The user's node jitter adds ``jitter sqrt(2 ln nodes)`` of the busy time; the hardware's
    per-GPU speed spread (``speed_sigma``) adds ``sigma sqrt(2 ln GPUs)`` of the GPU-bound
    terms, and a cluster with ``speed_sigma`` 0 has neither."""
    from dataclasses import replace

    from loom.planner.hardware import GPU_SPEED_SIGMA
    from loom.planner.timing import straggler_factor
    assert float(straggler_factor(1, 0.02)) == 0.0
    assert float(straggler_factor(1024, 0.02)) == pytest.approx(0.02 * (2 * np.log(1024)) ** 0.5)
    m = gpt(24, 2304, 24)
    quiet = make_cluster("A100-80GB", 64)  # 8 nodes
    assert quiet.speed_sigma == 0.0 and GPU_SPEED_SIGMA == 0.01  # off by default (hardware.py)
    cl = replace(quiet, speed_sigma=GPU_SPEED_SIGMA)
    L = make_layouts(dict(tp=8, pp=1, dp=8, mbs=1))
    base = time_terms(m, L, 64, 2048, quiet, Options())
    slow = time_terms(m, L, 64, 2048, quiet, Options(straggler_jitter=0.05))
    assert float(base["straggler"][0]) == 0.0
    busy = float(base["iteration"][0])
    assert float(slow["straggler"][0]) == pytest.approx(busy * 0.05 * (2 * np.log(8)) ** 0.5)
    assert float(slow["iteration"][0]) == pytest.approx(busy + float(slow["straggler"][0]))
    hw = time_terms(m, L, 64, 2048, cl, Options())
    gpu_bound = sum(float(base[k][0]) for k in ("compute", "recompute", "elementwise",
                                                 "pp_bubble", "optimizer"))
    assert float(hw["straggler"][0]) == pytest.approx(gpu_bound * 0.01 * (2 * np.log(64)) ** 0.5)
