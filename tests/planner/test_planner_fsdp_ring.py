"""ZeRO-3's collectives against a published table the planner has never seen (llm-foundry's 8-64
H100 FSDP rows, ``benchmarks/planner_fsdp_ring.py``): what the shipped flat ring gets wrong, what
NCCL's ring model fixes, and what it does not (docs/planner.md, LF-H100)."""

from __future__ import annotations

import pytest

from benchmarks import planner_fsdp_ring as bench


def _rows(variant):
    return {r["row"]: r for r in bench.predict(variant)}


def test_the_table_is_the_readme_s_and_in_no_fit():
    """52 rows, all FULL_SHARD on 8-64 GPUs; none of them is a row of a fitted or LOSO source
    (LF-H100 is the >= 128 GPU table)."""
    from benchmarks.planner_sources.published import LF_ROWS
    assert len(bench.ROWS) == 52 and {r[0] for r in bench.ROWS} == {"H100"}
    assert {r[7] for r in bench.ROWS} == {3}
    assert {n for _, _, _, n, *_ in bench.ROWS} == {8, 16, 32, 64}
    lf_h100 = {(m, s, n) for g, m, s, n, *_ in LF_ROWS if g == "H100"}
    assert len(lf_h100) == 18 and not {(m, s, n) for _, m, s, n, *_ in bench.ROWS} & lf_h100


def test_flat_ring_breaks_at_the_node_boundary_nccl_ring_does_not():
    """The 13B at s = 2048, micro-batch 2, no recompute: published 4792 / 4767 / 4811 / 4800
    tokens/s/GPU on 8 / 16 / 32 / 64 GPUs, flat across the node boundary. The shipped flat ring
    (every byte over the GPU's own 45 GB/s link) predicts the multi-node rows 2.7x too slow while
    the 8-GPU row is 36% too fast; NCCL's ring (the node's 8 links, ncclTopoTuneModel) keeps the
    four rows within 3 points of each other, all ~+38%: the error left is not the ring's."""
    keys = [f"LF H100 13b s2048 {n} GPUs b2 tok/s/GPU" for n in (8, 16, 32, 64)]
    pub = [r[6] for r in bench.ROWS if r[1:5] in [("13b", 2048, n, 2) for n in (8, 16, 32, 64)]]
    assert len(pub) == 4
    assert max(pub) / min(pub) - 1 < 0.01
    shipped, nccl = _rows("shipped"), _rows("nccl_ring")
    assert shipped[keys[0]]["error"] == pytest.approx(nccl[keys[0]]["error"], abs=1e-9)  # 1 node
    assert shipped[keys[0]]["error"] > 0.3
    assert all(shipped[k]["error"] < -0.6 for k in keys[1:])
    errs = [nccl[k]["error"] for k in keys]
    assert max(errs) - min(errs) < 0.03 and min(errs) > 0.3


def test_what_each_variant_scores():
    """Median / worst |error| over the 52 rows: shipped 8.9% / 64.8%, NCCL ring 9.4% / 41.1%,
    NCCL ring with the communication exposed 4.0% / 19.3% (not shipped: docs/planner.md).
    Re-recorded after issue 47's scale terms (ring latency per bucket; refit e 0.817, h0 105.6,
    k 2.49, Hopper 0.746)."""
    got = {v: bench.summary(bench.predict(v)) for v in bench.VARIANTS}
    want = {"shipped": (0.089, 0.648), "nccl_ring": (0.094, 0.411),
            "nccl_ring_exposed": (0.040, 0.193)}
    for v, (med, worst) in want.items():
        assert got[v]["median"] == pytest.approx(med, abs=0.003), (v, got[v])
        assert got[v]["worst"] == pytest.approx(worst, abs=0.003), (v, got[v])


def test_on_the_loso_fsdp_sources_the_nccl_ring_alone_is_worse():
    """Why the NCCL ring is not shipped: on the held-out FSDP sources (in no fit) it moves
    LF-H100 from 9.4% / 21.3% to 14.2% / 30.5% (the 7B without recompute turns 19-29% too fast),
    and only exposing all communication recovers it (4.4%), at LF-A100's median (2.9% -> 5.0%)
    and TT's (1.4% -> 6.0%). Re-recorded after issue 47's refit and scale terms."""
    got = {v: {k: bench.summary(r) for k, r in bench.llm_foundry_and_torchtitan(v).items()}
           for v in bench.VARIANTS}
    want = {("shipped", "LF-H100"): (0.094, 0.213), ("shipped", "LF-A100"): (0.029, 0.297),
            ("shipped", "TT"): (0.014, 0.0175), ("nccl_ring", "LF-H100"): (0.142, 0.305),
            ("nccl_ring_exposed", "LF-H100"): (0.0435, 0.213),
            ("nccl_ring_exposed", "LF-A100"): (0.050, 0.201),
            ("nccl_ring_exposed", "TT"): (0.060, 0.069)}
    for (v, src), (med, worst) in want.items():
        assert got[v][src]["median"] == pytest.approx(med, abs=0.003), (v, src, got[v][src])
        assert got[v][src]["worst"] == pytest.approx(worst, abs=0.003), (v, src, got[v][src])
