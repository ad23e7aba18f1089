"""Leave-one-source-out validation of the planner's cost model against published runs: for each
source, refit every constant without it and predict it (benchmarks.planner_sources.fit.leave_one_source_out).
Prints JSON, or with --markdown the table of docs/planner.md.

    OMP_NUM_THREADS=1 python -m benchmarks.planner_validation             # ~20-30 s
    OMP_NUM_THREADS=1 python -m benchmarks.planner_validation --markdown
"""

from __future__ import annotations

import argparse
import json

from benchmarks.planner_sources.fit import leave_one_source_out


def markdown(res: dict) -> str:
    lines = ["| source | rows | held-out median | held-out worst | in-sample median | "
             "in-sample worst | fitted on when held out |", "|---|---|---|---|---|---|---|"]
    for s, r in res["sources"].items():
        h, i = r["heldout"], r["in_sample"]
        ins = (f"{100 * i['median']:.1f}% | {100 * i['worst']:.1f}%" if r["ever_fitted"]
               else "(never fitted) | ")
        prov = "; ".join(f"{g}: {', '.join(v) if isinstance(v, (list, tuple)) else v}"
                         for g, v in r["fitted_on"].items())
        lines.append(f"| {s} | {h['n']} | {100 * h['median']:.1f}% | {100 * h['worst']:.1f}% | "
                     f"{ins} | {prov} |")
    o = res["overall"]
    lines.append(f"| all held-out rows | {o['n']} | {100 * o['median']:.1f}% | "
                 f"{100 * o['worst']:.1f}% | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--markdown", action="store_true", help="print the docs table instead")
    args = ap.parse_args()
    res = leave_one_source_out()
    print(markdown(res) if args.markdown else json.dumps(res, indent=2))
