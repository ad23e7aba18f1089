"""Out-of-sample validation of the planner's cost model (issue 26): leave one published source
out, refit every constant on the rest, predict it (benchmarks.planner_sources.fit.leave_one_source_out).

The bounds are what the protocol measures now (rounded up by about a point), not targets: they
fail when a change makes a held-out source worse. The issue's median targets (pooled <= 8%, every
source <= 10% but BLOOM's and OPT's one row each) are asserted; its worst-row target (<= 20%) is the strict xfail at the end, which
fails loudly once it is met. The in-sample checks
(rows the constants are fitted on) are the ``test_in_sample_fit_*`` tests of
test_planner_published.py and test_planner_validation.py. ~15-30 s (one fixture).
"""

from __future__ import annotations

import math

import pytest

from loom.planner.constants import FIT_SETS, SHIPPED, Constants
from benchmarks.planner_sources.fit import HOLDOUTS, SOURCES, leave_one_source_out, source_points

# held-out set -> (median, worst) absolute relative error bounds, measured 2026 (issue 26;
# MC-H100 strong and Llama 3 re-measured in issue 47: exact per-rank pipeline memory and refit;
# MC-H100 and Llama 3 again with issue 47's scale terms, ring latency per DP bucket; MegaScale new;
# loom H200 new: issue 47 item 5, in no fit set, so every other bound is unchanged)
HELDOUT_BOUNDS = {
    "NAR t1": (0.045, 0.09),
    "NAR t2": (0.06, 0.29),
    "KOR": (0.05, 0.105),
    "SHO": (0.05, 0.16),
    "MC-H100 weak": (0.05, 0.11),
    "MC-H100 strong": (0.03, 0.045),
    "BLOOM": (0.11, 0.11),
    "OPT": (0.20, 0.20),
    "TT": (0.025, 0.04),
    "LF-H100": (0.10, 0.24),
    "LF-A100": (0.045, 0.30),
    "Llama 3": (0.075, 0.29),
    "MegaScale": (0.10, 0.16),
    # loom's own make gpu-check rows (5.8%, 13.0% on 2026-11-28; re-measured 2026-11-30 after
    # the fused loss's change: 6.6%, 12.8%)
    "loom H200": (0.075, 0.14),
    # the same command at two shapes measured after the rows above had been studied
    # (2026-11-30, 13.5%, 22.2%; in no fit set: the planner is 4-22% fast on every row)
    "loom H200 shapes": (0.145, 0.23),
    # NeMo 24.09 / 24.11 on 8-2,304 H100, 2026-11-29 (11.0%, 26.3%; in no fit set): its cuDNN
    # attention rows are 8-26% too slow (benchmarks/planner_sources/dgxc.py)
    "DGX-C": (0.115, 0.27),
    "MC-H100 weak + MC-H100 strong": (0.05, 0.11),
}
# 6.1% over 166 rows with loom's held-out shapes (5.7% over 156 with DGX-C, 5.0% over 121 before)
OVERALL_BOUNDS = (0.065, 0.30)
ISSUE_TARGET = (0.08, 0.20, 0.10)  # pooled median, worst row, every source's own median


@pytest.fixture(scope="module")
def loso():
    return leave_one_source_out()


def test_refit_on_all_rows_reproduces_shipped_constants(loso):
    """The shipped constants are the fit's output (rounded to 3 significant digits)."""
    got = loso["all_sources_fit"]
    for name, shipped in SHIPPED.__dict__.items():
        assert got[name] == pytest.approx(shipped, rel=0.003, abs=0.002), (name, got[name])


def test_held_out_source_is_not_in_its_own_fit(loso):
    for held in HOLDOUTS:
        r = loso["sources"][" + ".join(held)]
        for group, used in r["fitted_on"].items():
            assert used == "prior" or not set(held) & set(used), (held, group, used)
        if r["ever_fitted"]:  # refitting without it moved the constants
            assert r["constants"] != loso["all_sources_fit"], held


def test_every_source_is_held_out_once_and_fit_sets_name_known_sources():
    assert {s for h in HOLDOUTS for s in h} == set(SOURCES)
    assert {s for srcs in FIT_SETS.values() for s in srcs} <= set(SOURCES)


@pytest.mark.parametrize("held", list(HELDOUT_BOUNDS))
def test_held_out_errors_within_measured_bounds(loso, held):
    med, worst = HELDOUT_BOUNDS[held]
    h = loso["sources"][held]["heldout"]
    assert h["n"] >= 1 and all(math.isfinite(v) for v in h["rows"].values()), h
    assert h["median"] <= med, (held, h["median"], h["rows"])
    assert h["worst"] <= worst, (held, h["worst"], h["rows"])


def test_overall_held_out_errors(loso):
    o = loso["overall"]
    assert o["n"] == sum(len(source_points(s)) for s in SOURCES)
    assert o["median"] <= OVERALL_BOUNDS[0] and o["worst"] <= OVERALL_BOUNDS[1], o


def test_issue_26_median_targets(loso):
    """The pooled held-out median meets the issue's 8% and every source's own held-out median
    its 10% (LF-H100 is the closest, 9.4%; MegaScale 9.1%) except the single rows of BLOOM (10.4%) and OPT-175B
    (19.4%), in the strict xfail below with the worst-row target, and DGX-C (11.0%) and loom's
    held-out shapes on an H200 (13.5%), each in its own strict xfail."""
    assert loso["overall"]["median"] <= ISSUE_TARGET[0], loso["overall"]
    for held, r in loso["sources"].items():
        if held not in ("BLOOM", "OPT", "DGX-C", "loom H200 shapes"):
            assert r["heldout"]["median"] <= ISSUE_TARGET[2], (held, r["heldout"]["median"])


@pytest.mark.xfail(strict=True, reason="issue 26's per-source 10% median is missed on DGX-C "
                   "(11.0%): NeMo's cuDNN attention skips the causal half, which the planner "
                   "does not price (tests/planner/test_planner_dgxc.py, docs/planner.md)")
def test_dgxc_median_within_the_per_source_target(loso):
    assert loso["sources"]["DGX-C"]["heldout"]["median"] <= ISSUE_TARGET[2]


@pytest.mark.xfail(strict=True, reason="issue 26's per-source 10% median is missed on loom's "
                   "held-out H200 shapes (13.5%): the step is under-predicted on all 10 rows, "
                   "the elementwise and per-step terms the b8 profile shows short "
                   "(docs/planner.md, 'loom on an H200')")
def test_loom_h200_shapes_median_within_the_per_source_target(loso):
    assert loso["sources"]["loom H200 shapes"]["heldout"]["median"] <= ISSUE_TARGET[2]


def test_mc_h100_held_out_uses_the_other_h100_sources(loso):
    """Holding the Megatron-Core H100 tables out refits the Hopper constant on torchtitan,
    llm-foundry and Llama 3 (constants.FALLBACK_SETS), never on MC-H100 itself."""
    r = loso["sources"]["MC-H100 weak + MC-H100 strong"]
    assert tuple(r["fitted_on"]["hopper"]) == ("TT", "LF-H100", "Llama 3")
    assert r["constants"]["hopper_gemm_efficiency"] < r["constants"]["gemm_efficiency"]


def test_held_out_is_worse_than_in_sample_for_fitted_sources(loso):
    """Sanity of the protocol: holding a fitted source out cannot fit it better (least squares
    on its rows is what the all-sources fit did)."""
    for held, r in loso["sources"].items():
        if r["ever_fitted"]:
            assert r["heldout"]["median"] >= r["in_sample"]["median"] - 0.005, held


def test_shipped_constants_object_matches_the_default_prediction_path():
    """``constants=SHIPPED`` (explicit Cluster overrides, h0 scaled by the ridge point) predicts
    what the plain shipped path predicts, for every source: the refits change only what they
    fit."""
    for s in SOURCES:
        for (n0, p0, _), (n1, p1, _) in zip(source_points(s), source_points(s, SHIPPED)):
            assert n0 == n1 and p1 == pytest.approx(p0, rel=1e-9), (s, n0, p0, p1)


def test_constants_change_predictions():
    """The plumbing is live: a lower GEMM efficiency slows every A100 and H100 prediction."""
    slow = Constants(gemm_efficiency=0.5, hopper_gemm_efficiency=0.5)
    base = dict((n, p) for n, p, _ in source_points("NAR t1") + source_points("MC-H100 weak"))
    for n, p, _ in source_points("NAR t1", slow) + source_points("MC-H100 weak", slow):
        assert p < base[n], n
    # the FSDP sources take the refit's ZeRO-3 overlap, not the shipped one (published.py)
    from dataclasses import replace

    hidden = dict((n, p) for n, p, _ in source_points("LF-H100",
                                                      replace(SHIPPED, zero3_overlap=1.0)))
    moved = [n for n, p, _ in source_points("LF-H100") if p != pytest.approx(hidden[n])]
    assert any("7b" in n for n in moved) and not any(" 1b " in n for n in moved), moved


@pytest.mark.xfail(strict=True, reason="issue 26 target (worst held-out row <= 20%) not met: "
                   "NAR t2's ZeRO-3 b = 4 rows, llm-foundry's 1B-7B H100 and 30B s = 8192 A100 "
                   "rows, Llama 3's 128K row; the one rows of BLOOM (10.7%) and OPT (19.5%) "
                   "(median <= 10%); see docs/planner.md, leave-one-source-out")
def test_issue_26_target_worst_row_and_bloom(loso):
    for held, r in loso["sources"].items():
        assert r["heldout"]["worst"] <= ISSUE_TARGET[1], held
    assert loso["sources"]["BLOOM"]["heldout"]["median"] <= ISSUE_TARGET[2]
    assert loso["sources"]["OPT"]["heldout"]["median"] <= ISSUE_TARGET[2]


def test_docs_and_readme_quote_the_protocol(loso):
    """docs/planner.md's leave-one-source-out table is ``python -m benchmarks.planner_validation
    --markdown`` line for line, and README.md quotes its pooled median and worst row."""
    from pathlib import Path

    from benchmarks.planner_validation import markdown

    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "planner.md").read_text().splitlines()
    want = markdown(loso).splitlines()
    i = doc.index(want[0])
    assert doc[i:i + len(want)] == want, "regenerate the table: planner_validation --markdown"
    o = loso["overall"]
    readme = " ".join((root / "README.md").read_text().split())
    assert (f"the error is median {100 * o['median']:.1f}%, worst {100 * o['worst']:.1f}% over "
            f"{o['n']} held-out rows") in readme
