"""Refit the planner's constants from the published tables and print them next to the shipped
values, as JSON (the fit: benchmarks/planner_sources/fit.py; the rows: loom/planner/constants.py).

    OMP_NUM_THREADS=1 python -m benchmarks.planner_fit          # ~5 s
    OMP_NUM_THREADS=1 python -m benchmarks.planner_fit --exclude "NAR t1"
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from loom.planner.constants import FIT_SETS, SHIPPED
from benchmarks.planner_sources.fit import SOURCES, fit


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--exclude", action="append", default=[], choices=SOURCES,
                    help="leave this source out of the fit (repeatable)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    c, prov = fit(exclude=args.exclude)
    out = dict(excluded=args.exclude, fit_sets=dict(FIT_SETS), fitted_on=prov,
               refit=asdict(c), shipped=asdict(SHIPPED),
               relative_difference={k: v / getattr(SHIPPED, k) - 1 for k, v in asdict(c).items()},
               seconds=round(time.perf_counter() - t0, 1))
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
