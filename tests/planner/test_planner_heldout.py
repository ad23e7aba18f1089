"""Published runs in no source of the fit, through ``loom plan`` as a user runs it
(benchmarks/planner_sources/heldout.py; issue 47: held-out runs "through loom plan the same
way"): Nemotron-4 340B's and 15B's batch-size ramps on 768-6,144 H100 and MT-NLG 530B on
2,240-3,360 A100. Nothing is fitted on them; these tests pin what the shipped planner says."""

from __future__ import annotations

import pytest

from benchmarks.planner_sources.heldout import (MT_NLG_530B, NEMOTRON4_15B, NEMOTRON4_340B,
                                                deepseek_v3_terms, heldout_rows, plan_json,
                                                slowdown)
from loom.planner.constants import FIT_SETS


def test_held_out_sources_are_in_no_fit_set():
    fitted = {s for srcs in FIT_SETS.values() for s in srcs}
    assert not any("Nemotron" in s or "MT-NLG" in s or "DeepSeek" in s for s in fitted)


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


def test_the_nemotron_tables_are_transcribed_self_consistently():
    """Within each table MFU x seconds x GPUs / batch is the model FLOPs per sequence over the
    peak: equal across rows to 1.5% (the published times have two digits); and the 15B's
    equals 6 x 15.7B (its 3.2B embedding and 12.5B other parameters) x s / 989 TFLOP/s."""
    for entry in (NEMOTRON4_340B, NEMOTRON4_15B):
        per = [mfu * t * n / b for n, b, t, mfu in entry["rows"]]
        assert max(per) / min(per) - 1 <= 0.015, (entry["name"], per)
    for n, b, t, mfu in NEMOTRON4_15B["rows"]:
        assert 6 * 15.7e9 * 4096 * b / (t * n * 989e12) == pytest.approx(mfu, abs=0.005)


def test_nemotron4_15b_is_over_predicted_and_its_dp_slowdown_under_predicted():
    """Held out, the 15B's TP 8 + DP ramp: every row 15-21% faster than published (the
    search's pick, micro-batch 4: compute 0.364 s, TP 0.069 s, the DP exposed behind the
    backward 0.014-0.043 s; published 0.57-0.64 s), as DGX Cloud's Nemotron-4 15B rows are
    over-predicted (docs/planner.md); and the slowdown with the DP size at a fixed 4 sequences
    per replica, 1.123 published, 1.060 predicted: the DP collectives at 96-288 nodes cost
    more than the overlap model leaves exposed (with `--dp-overlap off` every row is 0.76 s:
    the truth is between)."""
    rows = heldout_rows(NEMOTRON4_15B)
    for r in rows:
        assert (r["layout"]["tp"], r["layout"]["dp"]) == (8, r["gpus"] // 8)
        assert -0.25 <= r["error"] <= -0.10, r
    s = slowdown(rows)
    assert s["published"] == pytest.approx(1.123, abs=0.001)
    assert -0.08 <= s["error"] <= -0.03, s


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


def test_readme_quotes_the_held_out_errors():
    """README's sentence on the held-out runs states the largest error of Nemotron-4 340B and
    the ranges of Nemotron-4 15B and MT-NLG, in whole percent (one decimal for the first)."""
    import re
    from pathlib import Path
    text = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    worst = max(abs(r["error"]) for r in heldout_rows(NEMOTRON4_340B))
    assert f"Nemotron-4 340B on 1,536-6,144 H100 within {100 * worst:.1f}%" in text
    for name, entry in (("Nemotron-4 15B", NEMOTRON4_15B), ("MT-NLG 530B", MT_NLG_530B)):
        errs = sorted(-100 * r["error"] for r in heldout_rows(entry))
        m = re.search(re.escape(name) + r" (\d+)-(\d+)%", text)
        assert m and (int(m.group(1)), int(m.group(2))) == (int(errs[0]), round(errs[-1])), (
            name, errs)


def test_deepseek_v3_disagrees_by_the_terms_its_report_names():
    """DeepSeek-V3 at its stated layout (PP 16, EP 64, no TP, no CP, 2,048 H800, batch 15,360)
    is predicted 58.5 s against the 19.9 s its GPU hours give (+194%), and the planner names
    why: the EP all-to-all is its largest term and equals the computation, as the report's
    "computation-to-communication ratio is approximately 1:1" says; the published time lies
    between the prediction without the exchanges DualPipe hides (32.4 s) and the prediction
    with every stated difference taken out (FP8 GEMMs, no recomputation, half the bubble:
    15.5 s)."""
    ds = deepseek_v3_terms()
    lay, t = ds["layout"], ds["terms"]
    assert (lay["tp"], lay["pp"], lay["ep"], lay["cp"], lay["dp"]) == (1, 16, 64, 1, 128)
    assert lay["fits"] and lay["moe_token_dispatcher_type"] == "alltoall"
    assert ds["published_s"] == pytest.approx(19.9, abs=0.05)
    assert 2.5 <= ds["predicted_s"] / ds["published_s"] <= 3.5, ds["predicted_s"]
    assert max(t, key=t.get) == "ep_comm"
    assert 0.8 <= t["ep_comm"] / (t["compute"] + t["recompute"] + t["elementwise"]) <= 1.25
    assert ds["stated_removed_s"] < ds["published_s"] < ds["comm_hidden_s"]
