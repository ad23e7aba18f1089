"""docs/planner.md's in-sample tables are the output of ``python -m benchmarks.planner_published``
with the shipped constants: every data row that command prints for NAR table 1, NAR table 2,
Megatron-Core H100 and SHO is a line of the doc (a refit or a model change that moves a number
fails here until the doc is regenerated). The leave-one-source-out table is checked in
test_planner_loso.py, against the protocol's own output."""

from __future__ import annotations

from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "planner.md"
TABLES = ("| NAR table 1 |", "| NAR table 2 |", "| Megatron-Core H100 |", "| SHO weak scaling |")


def _table_rows(text: str, header: str) -> list[str]:
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


@pytest.fixture(scope="module")
def printed():
    import contextlib
    import io

    from benchmarks.planner_published import tables

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        tables()
    return buf.getvalue()


@pytest.mark.parametrize("header", TABLES)
def test_doc_table_rows_are_the_benchmark_output(printed, header):
    doc = set(DOC.read_text().splitlines())
    rows = _table_rows(printed, header)
    assert len(rows) >= 4, header
    missing = [r for r in rows if r not in doc]
    assert not missing, (f"docs/planner.md is stale for {header}: regenerate with "
                         f"`python -m benchmarks.planner_published`", missing)
