"""loom's own H200 rows as a planner source (issue 47 item 5; benchmarks/planner_sources/loom_gpu.py):
the committed rows rebuild their configs, the source re-predicts them through the same call
``make gpu-check`` made, and docs/planner.md's section "loom on an H200" is that code's output.
Its held-out bounds are in test_planner_loso.py with every other source's."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.planner_sources import loom_gpu as L
from loom.planner.constants import SHIPPED

DOC = Path(__file__).resolve().parents[2] / "docs" / "planner.md"


@pytest.fixture(scope="module")
def rows():
    return L.load_rows()


def test_rows_rebuild_and_both_prediction_paths_agree(rows):
    assert [r["name"] for r in rows] == ["b16 s2048 none", "b8 s2048 none", "b16 s2048 selective",
                                         "b16 s2048 full", "b8 s4096 none"]
    for r in rows:
        cfg = L.config_of(r)
        assert cfg.training.micro_batch_size == r["layout"]["mbs"] and cfg.training.bf16
        assert r["gpu"] == "H200" and r["world_size"] == 1
        # gpu_check's call (shipped constants) and the protocol's (constants given) are one model
        a = L.predict_row(r)["time_s"]["iteration"]
        assert L.predict_row(r, SHIPPED)["time_s"]["iteration"] == pytest.approx(a, rel=1e-12)
        # and it predicts what make gpu-check recorded, unless the planner changed since: then
        # the docs section below fails first, and says what to regenerate
        assert a == pytest.approx(r["predicted"]["step_time_s"], rel=0.05)


def test_memory_within_the_stated_bound(rows):
    for m in L.memory_rows(rows):
        assert abs(m["allocated_error"]) < 0.05 and abs(m["reserved_error"]) < 0.05, m


def test_docs_section_is_the_code_output(rows):
    """Regenerate with ``OMP_NUM_THREADS=1 python -m benchmarks.planner_sources.loom_gpu``."""
    doc = DOC.read_text()
    for table in (L.markdown(rows), L.terms_markdown(rows)):
        for line in table.splitlines():
            assert line in doc, f"docs/planner.md lacks: {line}"
