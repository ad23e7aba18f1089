"""calibrate_local's fits: GEMM efficiency curve, mem_traffic from one step, oversubscription.
Synthetic data only (plus one small bandwidth measurement), well under 10 s."""

from __future__ import annotations

import numpy as np
import pytest

from loom.planner.calibrate import (CAL_BATCH, _cal_model_config, fit_gemm_curve,
                                    fit_mem_traffic, measure_memory_bandwidth)
from loom.planner.host_sharing import oversubscribed
from loom.planner.hardware import Cluster
from loom.planner.layout import Options, make_layouts
from loom.planner.timing import gemm_efficiency, time_terms


def test_fit_gemm_curve_recovers_planner_form():
    peak, e, h0 = 100e9, 0.8, 40.0
    cl = Cluster(peak_flops=peak, gemm_efficiency=e, gemm_half_dim=h0)
    pts = []
    for T in (128, 512, 2048):
        for w in (64, 128, 256, 512):
            fl = 3 * 2.0 * T * w * 4 * w
            pts.append((T, w, fl, fl / (peak * float(gemm_efficiency(w, T, cl)))))
    p, ef, h = fit_gemm_curve(pts)
    assert p * ef == pytest.approx(peak * e, rel=1e-6)  # asymptotic rate
    assert h == pytest.approx(h0, rel=1e-6)
    assert ef <= 1.0 and p >= max(f / s for (_, _, f, s) in pts)


def test_fit_mem_traffic_inverts_time_model():
    cl = Cluster(gpu="local-cpu", num_gpus=1, gpus_per_node=1, peak_flops=1e11, hbm_bw=2e10,
                 gemm_efficiency=0.9, gemm_half_dim=10.0, mem_traffic=7.0)
    model = _cal_model_config()
    step = float(time_terms(model, make_layouts(dict(mbs=CAL_BATCH)), CAL_BATCH,
                            model.seq_length, cl, Options(flash_attention=True))["iteration"][0])
    assert fit_mem_traffic(step, cl) == pytest.approx(7.0, rel=1e-6)


def test_oversubscribed_scales_compute_and_bandwidth():
    cl = Cluster(gpu="local-cpu", num_gpus=1, gpus_per_node=1, peak_flops=1e11, hbm_bw=2e10)
    four = oversubscribed(cl, 4, cores=2)
    assert four.peak_flops == pytest.approx(5e10) and four.hbm_bw == pytest.approx(1e10)
    assert four.num_gpus == 4 and four.notes["oversubscription"]["share"] == 0.5
    two = oversubscribed(cl, 2, cores=2)
    assert two.peak_flops == cl.peak_flops and two.intra_bw == cl.intra_bw


def test_memory_bandwidth_is_plausible():
    bw = measure_memory_bandwidth(nbytes=4 << 20, repeats=2)
    assert np.isfinite(bw) and 1e8 < bw < 1e13


def test_shared_cores_pipeline_time_bounds():
    from loom.planner.host_sharing import shared_cores_pipeline_time, shared_cores_time
    # 2 stages, m = 4: the slowest stage 0.1 s per micro-batch, both stages together 0.15 s
    piped = dict(compute=0.4, pp_bubble=0.1, pp_comm=0.01, optimizer=0.01, iteration=0.52)
    flat = dict(compute=0.6, optimizer=0.02, iteration=0.62)
    crit = 0.52 - 0.1 + (0.6 - 0.4) / 4  # the other stage's micro-batch replaces the bubble
    # 2 pipelines on 4 ranks: total work 2 x 0.62 + 4 x 0.01 over 2 cores
    assert shared_cores_pipeline_time(piped, flat, 4, 2, 4, cores=2) == pytest.approx(
        max(crit, (2 * 0.62 + 4 * 0.01) / 2))
    # one core per rank: the critical path
    assert shared_cores_pipeline_time(piped, flat, 2, 2, 4, cores=2) == pytest.approx(crit)
    # equal stages: the fill and drain is the planner's bubble (p - 1) t_mb
    eq = dict(compute=0.4, pp_bubble=0.1, iteration=0.5)
    assert shared_cores_pipeline_time(eq, dict(compute=0.8, iteration=0.8), 2, 2, 4,
                                      cores=8) == pytest.approx(0.5)
    # pp = 1: shared_cores_time
    assert shared_cores_pipeline_time(flat, flat, 4, 1, 4, cores=2) == pytest.approx(
        shared_cores_time(flat, 4, 2)) == pytest.approx(4 * 0.62 / 2)


def test_host_overlap_options():
    from loom.planner.host_sharing import host_overlap_options
    assert host_overlap_options(2, cores=4) == {}
    off = host_overlap_options(4, cores=2)
    assert off == host_overlap_options(2, cores=2)
    o = Options(flash_attention=True, **off)
    assert not o.overlap_tp_comm and not o.overlap_grad_reduce and o.zero3_overlap == 0.0
    assert not o.overlap_cp_comm
