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

from benchmarks.planner_sources.megascale import (MEGASCALE_ROWS, ablation_seconds, candidates,
                                                  counterfactuals, fixed_cost, megascale_rows,
                                                  trend)
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


@pytest.mark.xfail(strict=True, reason=(
    "issue 47's 10%: at 256 GPUs (d 4, table 2 + table 3) the published iteration is 0.197 s per "
    "micro-batch + 2.22 s, the model 0.201 s + 0.82 s: 1.40 s per iteration is missing at a "
    "fixed DP size. Priced and excluded (test_megascale_missing_cost_candidates_priced): "
    "no distributed optimizer +0.22..0.26 s, optimizer bytes 0.06 s, warm-up exchanges 0.01 s, "
    "tied embedding 0.02 s (in), A800 NVLink and the straggler grow with m, half the NICs "
    "contradicts sec 3.6, no interleaving (1.38 s) contradicts sec 6.1 (docs/planner.md, Scale)"))
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


def test_megascale_missing_cost_is_per_iteration_at_256_gpus():
    """The two published points at d = 4 (table 2's 256-GPU row, batch 768, m 192; table 3's
    baseline, batch 256, m 64, 47.7%): same GPUs, DP size and per-micro-batch work, so their line
    ``a m + c`` separates per-micro-batch from per-iteration cost with no scale term in it. The
    per-micro-batch part agrees (0.197 vs 0.201 s); the per-iteration part is 2.22 s published,
    0.82 s predicted (bubble 0.23 + DP 0.56 + optimizer 0.01): 1.40 s missing, equal to a bubble
    without interleaving, ``(p - 1) a`` = 1.38 s. MegaScale's own system (table 2 + its LAMB row)
    pays 0.77 s where its interleaved bubble is 0.19 s: the paper's own fixed costs exceed
    ``(p - 1) / v`` in both systems."""
    f = fixed_cost()
    pub, mod = f["published"], f["model"]
    assert pub["per_microbatch_s"] == pytest.approx(mod["per_microbatch_s"], rel=0.03)
    assert pub["fixed_s"] == pytest.approx(2.22, abs=0.01)
    assert 1.3 <= f["gap_s"] <= 1.5
    assert f["gap_s"] == pytest.approx(f["flat_bubble_s"], abs=0.1)
    assert f["interleaved_bubble_s"] == pytest.approx(mod["terms_s"]["pp_bubble"], rel=0.02)
    assert f["megascale_own"]["fixed_s"] > 3 * f["megascale_interleaved_bubble_s"]


def test_megascale_missing_cost_candidates_priced():
    """Each candidate for the missing per-iteration cost, in seconds at d 4 m 192 / d 4 m 64 /
    d 192 m 32 (``python -m benchmarks.planner_sources.megascale --evidence``), against the gap
    there (0.54 / 1.12 / 1.11 s): none that the paper and 285068c8 support is a fixed ~1.1 s."""
    c = candidates()
    at = ("768/256", "256/256", "6144/12288")
    assert [round(c["gap_s"][k], 2) for k in at] == pytest.approx([0.54, 1.12, 1.11], abs=0.02)
    # 285068c8's default DDP (--use-distributed-optimizer is opt-in): fp32 all-reduce + the
    # unsharded optimizer: a fifth of the gap
    assert all(0.2 <= c["no_distributed_optimizer"][k] <= 0.27 for k in at)
    # small fixed costs: every optimizer byte unsharded, the warm-up / cool-down exchanges the
    # max-plus schedule adds beyond the model's, the tied embedding all-reduce (already priced)
    assert c["optimizer_unsharded_all_bytes_s"] < 0.07
    assert c["warmup_exchanges_s"] < 0.02 and c["tied_embedding_allreduce_s"] < 0.02
    # per-micro-batch terms, not a fixed cost: they grow with m at d 4
    for k in ("a800_nvlink", "straggler_sigma_1pct"):
        assert c[k]["768/256"] > 2.5 * c[k]["256/256"]
    # the two that would close it contradict the paper: half the NICs (sec 3.6: eight 200G per
    # server) and no interleaving (sec 6.1: six interleaving stages for the 175B)
    assert all(0.75 <= c["nics_halved"][k] for k in at)
    assert all(0.85 * c["gap_s"][k] <= c["no_interleaving"][k] <= c["gap_s"][k] for k in at[1:])


def test_megascale_counterfactuals_and_the_papers_own_prices():
    """What the two trend-moving changes give over all 8 rows, and table 3's seconds at m 64.
    285068c8's default DDP (no distributed optimizer): trend -9.3% (inside 10%) but rows up to
    +12.0% (outside); no interleaving: trend -0.8%, rows -0.4..+5.5%, against the paper's text.
    Table 3: PP overlap 0.55 s, DP overlap 0.31 s, misc 0.20 s; even wholly per iteration they
    leave 2.22 s - 0.77 s (MegaScale's own) short by 0.35-0.4 s."""
    cf = counterfactuals()
    z0, v1 = cf["no_distributed_optimizer"], cf["no_interleaving"]
    assert -0.10 < z0["trend_error"] < -0.09
    assert 0.11 < max(z0["row_errors"]) < 0.125 and min(z0["row_errors"]) > 0.0
    assert abs(v1["trend_error"]) < 0.01 and max(map(abs, v1["row_errors"])) < 0.06
    t3 = ablation_seconds()
    assert (t3["PP overlap"], t3["DP overlap"], t3["misc (data pipeline, sec 6.3 code)"]) == \
        pytest.approx((0.55, 0.31, 0.20), abs=0.01)
    f = fixed_cost()
    left = f["published"]["fixed_s"] - f["megascale_own"]["fixed_s"] - (
        t3["PP overlap"] + t3["DP overlap"] + t3["misc (data pipeline, sec 6.3 code)"])
    assert 0.3 < left < 0.45
