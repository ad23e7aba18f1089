"""Scale terms of the time model (issue 47 item 3) and the held-out MegaScale source.

* NCCL's ReduceScatter / AllGather are rings: their latency grows as ``N - 1`` network hops,
  where the all-reduce's double binary tree pays ``2 log2 N`` (primitives.py);
* the two-level (NVLink, then one rail per GPU) reduce-scatter moves half an all-reduce's bytes;
* MegaScale's Megatron-LM baseline (NSDI 2024 table 2, 175B on 256-12,288 A100, never fitted):
  every row and the trend with scale, at the layout the paper and Megatron-LM 285068c8 state
  (benchmarks/planner_sources/megascale.py)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.planner_sources.megascale import MEGASCALE_ROWS, megascale_rows, trend
from loom.planner.constants import FIT_SETS
from loom.planner.hardware import make_cluster
from loom.planner.primitives import (NCCL_BASE_LATENCY, all_reduce_latency,
                                     hierarchical_all_reduce_time,
                                     hierarchical_reduce_scatter_time, reduce_scatter_latency)


def test_reduce_scatter_is_a_ring_and_half_an_all_reduce():
    cl = make_cluster("A100-80GB", 12288)
    a_i, a_e = cl.intra_alpha, cl.inter_alpha
    # 192 nodes, one rank each (TP 8 fills the node): 191 ring hops, not the tree's 2 log2 192
    assert float(reduce_scatter_latency(192, 1, cl)) == pytest.approx(
        NCCL_BASE_LATENCY + 191 * a_e)
    assert float(all_reduce_latency(192, 1, cl)) == pytest.approx(2 * np.log2(192) * a_e)
    # 8 per node over 4 nodes: 7 NVLink hops, 3 network hops
    assert float(reduce_scatter_latency(32, 8, cl)) == pytest.approx(
        NCCL_BASE_LATENCY + 7 * a_i + 3 * a_e)
    M = 1e9
    rs = float(hierarchical_reduce_scatter_time(32, 8, M, cl))
    ar = float(hierarchical_all_reduce_time(32, 8, M, cl))
    bw_rs = rs - float(reduce_scatter_latency(32, 8, cl))
    bw_ar = ar - float(all_reduce_latency(32, 8, cl))
    assert bw_rs == pytest.approx(bw_ar / 2)
    assert bw_rs == pytest.approx(7 / 8 * M / cl.intra_bw + 3 / 4 * M / 8 / cl.inter_bw)
    assert float(reduce_scatter_latency(1, 8, cl)) == 0.0


@pytest.fixture(scope="module")
def rows():
    return megascale_rows()


def test_megascale_is_held_out_and_every_row_is_planned(rows):
    assert all("MegaScale" not in srcs for srcs in FIT_SETS.values())
    assert [r["gpus"] for r in rows] == [n for _, n, _, _ in MEGASCALE_ROWS]
    for r in rows:
        lay = r["layout"]
        assert (lay["tp"], lay["pp"], lay["vp"], lay["micro_batch_size"]) == (8, 8, 6, 1)
        assert lay["dp"] == r["gpus"] // 64 and lay["fits"]
        assert lay["time_terms_s"]["dp_comm"] > 0


def test_megascale_rows_and_trend_within_16_percent(rows):
    """Held out: every row's MFU within 16% (measured: +1.5% .. +15.1%) and MFU(256) /
    MFU(12,288) within 15% of the published 1.29 (measured 1.13, -11.9%)."""
    for r in rows:
        assert abs(r["mfu"] / r["published_mfu"] - 1) <= 0.16, r["gpus"]
    assert abs(trend(rows)["error"]) <= 0.15, trend(rows)
    # the direction holds: fewer micro-batches per replica, lower MFU
    assert rows[0]["mfu"] > rows[3]["mfu"] and rows[4]["mfu"] > rows[-1]["mfu"]


@pytest.mark.xfail(strict=True, reason="issue 47's 10%: the model lacks ~1 s per iteration "
                   "that MegaScale's Megatron-LM rows pay at every DP size (4..192): a fixed, "
                   "d-independent cost, not DP, p2p or straggler (docs/planner.md, Scale)")
def test_megascale_trend_within_10_percent(rows):
    assert abs(trend(rows)["error"]) <= 0.10
    for r in rows:
        assert abs(r["mfu"] / r["published_mfu"] - 1) <= 0.10


def test_megatron_2023_blocking_p2p_adds_no_interleaved_bubble():
    """benchmarks/pipeline_lockstep.py: Megatron-LM 285068c8's interleaved schedule with its
    blocking exchanges costs exactly ``p - 1`` chunk steps over ``m v`` (the planner's
    ``(p-1)/v`` bubble) when stages are balanced; an output layer on the last chunk adds its
    share per micro-batch; a transfer time adds per exchange. So the schedule is not MegaScale's
    missing ~1.3 s."""
    from benchmarks.pipeline_lockstep import overhead_steps
    for p, v, m in ((4, 2, 8), (8, 6, 16), (8, 1, 16)):
        assert overhead_steps(p, v, m) == pytest.approx(p - 1)
    # the output layer (0.25 of a chunk's forward) on the last rank's last chunk: the slowest
    # stage's extra once per micro-batch (F + 2F = 0.75 units = 0.25 chunk steps), plus its
    # share of the fill
    extra = overhead_steps(4, 2, 8, extra_last=0.25) - 3
    assert 8 * 0.25 <= extra <= 8 * 0.25 + 1.0
    assert overhead_steps(4, 2, 8, x=0.1) > overhead_steps(4, 2, 8)
