"""The 3-shot calibration protocol (issue 47 item 4): how well the planner predicts a cluster
after a user calibrates it on 3 of their own runs (``loom plan --calibrate-from``).

For each published source with at least 4 rows: start from the constants fitted *without* that
source (:func:`benchmarks.planner_sources.fit.fit` with it excluded, the leave-one-source-out
starting point: the planner has never seen this cluster), calibrate on 3 of its rows, predict
the other rows. The calibration is ``--calibrate-from``'s own rule,
:func:`loom.planner.calibrate_runs.select_fit`: the GEMM efficiency of the source's GPU
generation (``gemm_efficiency`` on A100/V100, ``hopper_gemm_efficiency`` on H100), then the
element-wise traffic ``mem_traffic``, fitted by least squares of the log error, how many of them
(0, 1 or 2) chosen by the smallest leave-one-out error over the 3 rows. ``--network``: the same
with each set also without and with the network's ``dp_net_efficiency`` (the data-parallel
collectives' share of the inter-node bandwidth; candidates none, e, net, e+k, e+net), as
``calibrate(..., free=NETWORK)`` does: tried, not the default (docs/planner.md).

Reported per source (:func:`three_shot`, :func:`markdown`), error = ``|pred / pub - 1|``:

* ``before``: the predicted rows with the held-out constants (no calibration);
* ``old``: the rule before issue 47's robustness pass (always fit the GEMM efficiency alone,
  ``select_fit(..., sizes=(1,))``) on the first, middle and last rows of the table;
* ``after``: the rule on the same first/middle/last rows;
* ``robust`` / ``robust_old``: the rule / the old rule on every choice of 3 rows (a fixed-seed
  sample of :data:`SAMPLE` of them where there are more): the median over the choices of their
  median error, the worst choice's median, and how many choices end worse than no calibration on
  the same predicted rows.

    OMP_NUM_THREADS=1 python -m benchmarks.planner_sources.three_shot [--markdown] [--sample 0]
        [--network]
    # ~12 min on 2 shared cores (--network: ~18 min); --sample 0 (no robustness columns): ~1 min
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
from dataclasses import replace

import numpy as np

from loom.planner.calibrate_runs import BOUNDS, FREE, NETWORK, select_fit
from benchmarks.planner_sources.fit import SOURCES, fit, source_points

H100 = ("MC-H100 weak", "MC-H100 strong", "TT", "LF-H100", "Llama 3", "loom H200",
        "loom H200 shapes", "DGX-C")  # Hopper
SHOTS = 3
SAMPLE = 20  # choices of 3 rows per source in the robustness column (all of them when fewer)
SEED = 0
ITERS = 20  # Levenberg-Marquardt steps per fit


def shot_rows(n: int) -> tuple[int, ...]:
    """The calibration rows of an ``n``-row table: first, middle, last."""
    return (0, n // 2, n - 1)


def shot_choices(n: int, sample: int = SAMPLE, seed: int = SEED) -> list[tuple[int, ...]]:
    """Every choice of :data:`SHOTS` rows of ``n`` (sorted), or a ``random.Random(seed)``
    sample of ``sample`` of them when there are more."""
    every = list(itertools.combinations(range(n), SHOTS))
    return every if len(every) <= sample else sorted(random.Random(seed).sample(every, sample))


def _errors(rows) -> dict:
    a = [abs(pred / pub - 1) for _, pred, pub in rows]
    return dict(n=len(a), median=statistics.median(a), worst=max(a))


def order_of(source: str) -> tuple[str, ...]:
    """The compute chain ``--calibrate-from`` fits (:data:`loom.planner.calibrate_runs.PARAMS`),
    named as :class:`loom.planner.constants.Constants` names them for ``source``'s GPU (the
    network parameter, :data:`loom.planner.calibrate_runs.NETWORK`, has one name on every
    GPU)."""
    return ("hopper_gemm_efficiency" if source in H100 else "gemm_efficiency", "mem_traffic")


def calibrate_source(source: str, start, shots=None, old: bool = False, free=FREE) -> dict:
    """The 3-shot protocol on one source from the constants ``start``, calibrating on the rows
    ``shots`` (indices; default :func:`shot_rows`) with ``--calibrate-from``'s rule
    (:func:`loom.planner.calibrate_runs.select_fit`; ``old``: the rule before, the GEMM
    efficiency alone, always; ``free``: :func:`select_fit`'s, e.g.
    :data:`loom.planner.calibrate_runs.NETWORK`): ``params`` (name -> (start, fitted), the
    chosen ones), ``loo``
    (candidate label, e.g. ``"none"``, ``"dp_net_efficiency"`` -> leave-one-out score), ``shots`` (the calibration rows' names),
    ``before`` / ``after`` (errors of the other rows with ``start`` / the calibrated
    constants)."""
    pts = source_points(source, start)
    idx = shot_rows(len(pts)) if shots is None else tuple(shots)
    shot_names = [pts[i][0] for i in idx]
    order = order_of(source)

    def log_errors(values):
        got = {n: (p, q) for n, p, q in source_points(source, replace(start, **values))}
        return np.array([math.log(got[n][0] / got[n][1]) if got[n][0] == got[n][0] else math.nan
                         for n in shot_names])
    free = () if old else tuple(free)
    bounds = {k: BOUNDS["gemm_efficiency" if k == "hopper_gemm_efficiency" else k]
              for k in order + free}
    sel = select_fit(log_errors, {k: getattr(start, k) for k in order + free}, order, ITERS,
                     sizes=(1,) if old else None, bounds=bounds, free=free)
    c = replace(start, **sel["values"])
    held = set(shot_names)
    others = [p for p in pts if p[0] not in held]
    after = [p for p in source_points(source, c) if p[0] not in held]
    return dict(params={k: (getattr(start, k), getattr(c, k)) for k in sel["names"]},
                loo=sel["loo"], shots=sorted(held), before=_errors(others),
                after=_errors(after))


def robustness(source: str, start, sample: int = SAMPLE, old: bool = False,
               free=FREE) -> dict:
    """:func:`calibrate_source` (``old``) on each of :func:`shot_choices`: ``n`` choices,
    ``median``
    (over the choices, of each one's median error), ``worst`` (the largest such median),
    ``worse`` (choices whose median exceeds the uncalibrated median of the same rows)."""
    meds, worse = [], 0
    for shots in shot_choices(len(source_points(source, start)), sample):
        r = calibrate_source(source, start, shots, old, free)
        meds.append(r["after"]["median"])
        worse += r["after"]["median"] > r["before"]["median"]
    return dict(n=len(meds), median=statistics.median(meds), worst=max(meds), worse=worse)


def three_shot(sources=SOURCES, sample: int = SAMPLE, free=FREE) -> dict:
    """Per source with more than ``SHOTS`` rows, from its held-out constants: the rule on the
    first/middle/last rows (:func:`calibrate_source`), the old rule (``old``) on the same rows,
    and :func:`robustness` of both (``robust``, ``robust_old``; ``sample`` 0: skipped);
    ``free``: the rule's extra candidates (:func:`calibrate_source`);
    ``skipped``: the sources with too few rows to hold any out."""
    cache: dict = {}
    out, skipped = {}, []
    for s in sources:
        start, _ = fit(exclude=(s,), _cache=cache)
        if len(source_points(s, start)) <= SHOTS:
            skipped.append(s)
            continue
        r = calibrate_source(s, start, free=free)
        r["old"] = calibrate_source(s, start, old=True)["after"]
        if sample:
            r["robust"] = robustness(s, start, sample, free=free)
            r["robust_old"] = robustness(s, start, sample, old=True)
        out[s] = r
    return dict(sources=out, skipped=skipped)


def markdown(res: dict) -> str:
    lines = ["| source | predicted rows | uncalibrated: median / worst | old 3-shot (e alone, "
             "least squares): median / worst | 3-shot (LOO rule): median / worst | fitted | "
             "any 3 rows, old: median of medians / worst / worse than uncalibrated | any 3 rows, "
             "LOO rule: same |", "|---|---|---|---|---|---|---|---|"]

    def rob(r):
        return (f"{100 * r['median']:.1f}% / {100 * r['worst']:.1f}% / {r['worse']} of {r['n']}"
                if r else "")
    for s, r in res["sources"].items():
        b, o, a = r["before"], r["old"], r["after"]
        fitted = ", ".join(f"{k} {v0:.3g} -> {v1:.3g}" for k, (v0, v1) in r["params"].items())
        lines.append(f"| {s} | {a['n']} | {100 * b['median']:.1f}% / {100 * b['worst']:.1f}% | "
                     f"{100 * o['median']:.1f}% / {100 * o['worst']:.1f}% | "
                     f"{100 * a['median']:.1f}% / {100 * a['worst']:.1f}% | "
                     f"{fitted or 'none (shipped)'} | "
                     f"{rob(r.get('robust_old'))} | {rob(r.get('robust'))} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--sample", type=int, default=SAMPLE,
                    help="choices of 3 rows per source for the robustness column (0: skip it)")
    ap.add_argument("--network", action="store_true",
                    help="the rule with the DP network fraction among its candidates "
                         "(calibrate_runs.NETWORK; not the default)")
    args = ap.parse_args()
    res = three_shot(sample=args.sample, free=NETWORK if args.network else FREE)
    print(markdown(res) if args.markdown else json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
