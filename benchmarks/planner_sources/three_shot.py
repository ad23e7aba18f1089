"""The 3-shot calibration protocol (issue 47 item 4): how well the planner predicts a cluster
after a user calibrates it on 3 of their own runs (``loom plan --calibrate-from``).

For each published source with at least 4 rows: start from the constants fitted *without* that
source (:func:`benchmarks.planner_sources.fit.fit` with it excluded, the leave-one-source-out
starting point: the planner has never seen this cluster), calibrate on 3 of its rows (the first,
the middle and the last, in the table's order) the parameters ``--calibrate-from`` fits, the
GEMM efficiency of the source's GPU generation (``gemm_efficiency`` on A100/V100,
``hopper_gemm_efficiency`` on H100) and the element-wise traffic ``mem_traffic``, by least
squares of the log error (:func:`loom.planner.calibrate_runs.least_squares`), then predict the
other rows. Reported per source: median and worst ``|pred / pub - 1|`` of the predicted rows,
next to the same rows without calibration (held-out constants).

    OMP_NUM_THREADS=1 python -m benchmarks.planner_sources.three_shot [--markdown]   # ~1-2 min
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import replace

import numpy as np

from loom.planner.calibrate_runs import least_squares
from benchmarks.planner_sources.fit import SOURCES, fit, source_points

H100 = ("MC-H100 weak", "MC-H100 strong", "TT", "LF-H100", "Llama 3")
SHOTS = 3
PARAMS_EXTRA: tuple = ()  # ("mem_traffic",): also k (overfits 3 rows: KOR 29%, LF-A100 24% worst)


def shot_rows(n: int) -> tuple[int, ...]:
    """The calibration rows of an ``n``-row table: first, middle, last."""
    return (0, n // 2, n - 1)


def _errors(rows) -> dict:
    a = [abs(pred / pub - 1) for _, pred, pub in rows]
    return dict(n=len(a), median=statistics.median(a), worst=max(a))


def calibrate_source(source: str, start, cache: dict | None = None) -> dict:
    """The 3-shot protocol on one source from the constants ``start``: ``params`` (name ->
    (start, fitted)), ``shots`` (the calibration rows' names), ``before`` / ``after`` (errors
    of the other rows with ``start`` / the calibrated constants)."""
    pts = source_points(source, start)
    idx = shot_rows(len(pts))
    shots = {pts[i][0] for i in idx}
    e_name = "hopper_gemm_efficiency" if source in H100 else "gemm_efficiency"
    names = (e_name,) + PARAMS_EXTRA

    def const(x):
        return replace(start, **dict(zip(names, map(float, np.exp(x)))))

    def res(x):
        return np.array([math.log(p / q) for n, p, q in source_points(source, const(x))
                         if n in shots and p == p])
    x = least_squares(res, np.log([getattr(start, k) for k in names]), iters=20)
    c = const(x)
    others = [p for p in pts if p[0] not in shots]
    after = [p for p in source_points(source, c) if p[0] not in shots]
    return dict(params={k: (getattr(start, k), getattr(c, k)) for k in names},
                shots=sorted(shots), before=_errors(others), after=_errors(after))


def three_shot(sources=SOURCES) -> dict:
    """:func:`calibrate_source` for every source with more than ``SHOTS`` rows, from its
    held-out constants; ``skipped``: the others (too few rows to hold any out)."""
    cache: dict = {}
    out, skipped = {}, []
    for s in sources:
        start, _ = fit(exclude=(s,), _cache=cache)
        if len(source_points(s, start)) <= SHOTS:
            skipped.append(s)
            continue
        out[s] = calibrate_source(s, start)
    return dict(sources=out, skipped=skipped)


def markdown(res: dict) -> str:
    lines = ["| source | predicted rows | held-out constants: median / worst | 3-shot: median / "
             "worst | fitted |", "|---|---|---|---|---|"]
    for s, r in res["sources"].items():
        b, a = r["before"], r["after"]
        fitted = ", ".join(f"{k} {v0:.3g} -> {v1:.3g}" for k, (v0, v1) in r["params"].items())
        lines.append(f"| {s} | {a['n']} | {100 * b['median']:.1f}% / {100 * b['worst']:.1f}% | "
                     f"{100 * a['median']:.1f}% / {100 * a['worst']:.1f}% | {fitted} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    res = three_shot()
    print(markdown(res) if ap.parse_args().markdown else json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
