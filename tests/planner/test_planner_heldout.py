"""Published runs in no source of the fit, through ``loom plan`` as a user runs it
(benchmarks/planner_sources/heldout.py; issue 47: held-out runs "through loom plan the same
way"): Nemotron-4 340B's batch-size ramp on 1,536-6,144 H100 and MT-NLG 530B on 2,240-3,360
A100. Nothing is fitted on them; these tests pin what the shipped planner says."""

from __future__ import annotations

import pytest

from benchmarks.planner_sources.heldout import (MT_NLG_530B, NEMOTRON4_340B, heldout_rows,
                                                plan_json, slowdown)
from loom.planner.constants import FIT_SETS


def test_held_out_sources_are_in_no_fit_set():
    fitted = {s for srcs in FIT_SETS.values() for s in srcs}
    assert not any("Nemotron" in s or "MT-NLG" in s for s in fitted)


def test_nemotron4_340b_ramp_within_8_percent_and_its_trend():
    """Each row's seconds per iteration within 8% (measured -5.3 / -4.8 / -5.1%) at the
    published TP 8 PP 12, the search's own pick fitting 80 GB; the slowdown per sample per GPU
    from 1,536 to 6,144 GPUs within 2% of the published 1.036 (measured 1.037); the report's
    interleaved schedule, named, within 8% too (measured -4.2 / -3.7 / -4.5%, v 8)."""
    rows = heldout_rows(NEMOTRON4_340B)
    for r in rows:
        lay = r["layout"]
        assert (lay["tp"], lay["pp"], lay["dp"]) == (8, 12, r["gpus"] // 96), lay
        assert lay["fits"] and lay["memory_gb"] <= 80
        assert abs(r["error"]) <= 0.08, r
    s = slowdown(rows)
    assert s["published"] == pytest.approx(1.036, abs=0.001)
    assert abs(s["error"]) <= 0.02, s
    inter = heldout_rows(NEMOTRON4_340B, ("--pipeline-schedule", "interleaved"))
    for r in inter:
        # the interleaved 1F1B: loom names it 1f1b with v > 1 chunks a stage
        assert r["layout"]["pipeline_schedule"] == "1f1b" and r["layout"]["vp"] > 1
        assert abs(r["error"]) <= 0.08, r


def test_mt_nlg_is_megatron_s_own_530b_slowed_by_its_pipeline_engine():
    """MT-NLG's published seconds are 26-29% above the prediction, and the prediction is what
    Megatron-LM itself ran: the same model and TP 8 PP 35 on the same machine, NAR table 1's
    530B row (2,520 GPUs, batch 2,520, 163 hardware TFLOP/s per GPU), is predicted within 10%
    (174). The slowdown with scale (280 -> 420 nodes) is within 5% (published 1.108, predicted
    1.067)."""
    rows = heldout_rows(MT_NLG_530B)
    for r in rows:
        assert r["layout"]["recompute"] == "full" and r["layout"]["pipeline_schedule"] == "1f1b"
        assert -0.32 <= r["error"] <= -0.20, r
    assert abs(slowdown(rows)["error"]) <= 0.05
    nar = plan_json([*MT_NLG_530B["flags"], "--num-gpus", "2520", "--global-batch-size",
                     "2520", "--top", "1"])["layouts"][0]
    assert abs(nar["hw_tflops_per_gpu"] / 163.0 - 1) <= 0.10, nar["hw_tflops_per_gpu"]
    # MT-NLG's own rate, 126 at 2,240 GPUs, is 0.77 of it
    assert rows[0]["published_rate"] / 163.0 == pytest.approx(0.773, abs=0.001)


def test_a_refused_plan_raises_with_its_message():
    with pytest.raises(RuntimeError, match="--gpu"):
        plan_json(["--gpu", "no-such-gpu", "--num-gpus", "8", "llama3-8b"])
