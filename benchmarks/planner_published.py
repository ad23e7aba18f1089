"""Print the planner's tables against published runs (markdown), with the shipped constants.

    OMP_NUM_THREADS=1 python -m benchmarks.planner_published          # tables, ~10 s

Rows in a fit set (loom/planner/constants.py) are in-sample here. The fit itself:
``python -m benchmarks.planner_fit``; the out-of-sample (leave-one-source-out) errors:
``python -m benchmarks.planner_validation``.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.planner_sources.validation import validation_points
from benchmarks.planner_sources.validation import (bloom_176b, mcore_h100, nar_table2, opt_175b,
                                     sho_weak_scaling)


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def tables() -> None:
    pts = validation_points()
    print("In-sample (fitted) unless marked: NAR table 1, KOR, the ZeRO-3 rows of NAR table 2 and\n"
          "Megatron-Core H100 weak scaling are in the fit.\n")
    print("| NAR table 1 | published hw TFLOP/s | predicted | error |\n|---|---|---|---|")
    errs = []
    for name, pred, pub in pts:
        if name.startswith("NAR"):
            errs.append(abs(pred / pub - 1))
            print(f"| {name.split()[1]} | {pub:g} | {pred:.1f} | {_pct(pred / pub - 1)} |")
    print(f"\nmedian |error| {100 * statistics.median(errs):.1f}%, max {100 * max(errs):.1f}%\n")
    print("| KOR | published | predicted | error |\n|---|---|---|---|")
    for name, pred, pub in pts:
        if name.startswith("KOR"):
            print(f"| {name[4:]} | {pub:g} | {pred:.2f} | {_pct(pred / pub - 1)} |")
    print("\n| NAR table 2 | params | GPUs | b | TFLOP/s pub | pred | days pub | pred | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in nar_table2():
        print(f"| {r['scheme']} | {r['params_b']}B | {r['gpus']} | {r['b']} | "
              f"{r['published_tflops']} | {r['tflops']:.0f} | {r['published_days']} | "
              f"{r['days']:.1f} | {_pct(r['days'] / r['published_days'] - 1)} |")
    print("\n| Megatron-Core H100 | GPUs | TFLOP/s pub | pred | error | b | v | recompute |")
    print("|---|---|---|---|---|---|---|---|")
    errs = []
    for r in mcore_h100():
        lay = r["layout"]
        errs.append(abs(r["tflops"] / r["published_tflops"] - 1))
        print(f"| {r['params_b']}B | {r['gpus']} | {r['published_tflops']} | {r['tflops']:.1f} | "
              f"{_pct(r['tflops'] / r['published_tflops'] - 1)} | {lay['micro_batch_size']} | "
              f"{lay['vp']} | {lay['recompute']} |")
    print(f"\nmedian |error| {100 * statistics.median(errs):.1f}%, max {100 * max(errs):.1f}%\n")
    print("| SHO weak scaling | MP | MP pub | pred | MP x 64 DP pub | pred |")
    print("|---|---|---|---|---|---|")
    for r in sho_weak_scaling():
        print(f"| {r['params_b']}B | {r['mp']} | {100 * r['published_mp']:.0f}% | "
              f"{100 * r['pred_mp']:.1f}% | {100 * r['published_mp_dp']:.0f}% | "
              f"{100 * r['pred_mp_dp']:.1f}% |")
    b = bloom_176b()
    print(f"\nBLOOM 176B: published about {b['published_tflops']:g} hw TFLOP/s, predicted "
          f"{b['hw_tflops']:.1f} ({_pct(b['hw_tflops'] / b['published_tflops'] - 1)}), split "
          f"{b['layout']['pipeline_split']}")
    o = opt_175b()
    print(f"OPT-175B: published up to {o['published_tflops']:g} hw TFLOP/s, predicted "
          f"{o['hw_tflops']:.1f} ({_pct(o['hw_tflops'] / o['published_tflops'] - 1)}), "
          f"{o['layout']['memory_gb']:.1f} GB")
    published_tables()


def published_tables() -> None:
    """torchtitan, llm-foundry and Llama 3 rows (never fitted) and every published layout."""
    from benchmarks.planner_sources import published as P
    for title, pts in (("torchtitan (tokens/s/GPU)", P.torchtitan_points()),
                       ("llm-foundry H100 (tokens/s/GPU)", P.llm_foundry_points("H100")),
                       ("llm-foundry A100 (tokens/s/GPU)", P.llm_foundry_points("A100")),
                       ("Llama 3 405B (model TFLOP/s/GPU)", P.llama3_points())):
        print(f"\n| {title} | published | predicted | error |\n|---|---|---|---|")
        for name, pred, pub in pts:
            print(f"| {name} | {pub:g} | {pred:.0f} | {_pct(pred / pub - 1)} |")
    print("\n| published layout | split | v | schedule | recompute | fits | GB | s/iter |")
    print("|---|---|---|---|---|---|---|---|")
    for e in P.PUBLISHED_LAYOUTS:
        r = P.plan_published(e)
        print(f"| {e[0]} | {r['pipeline_split']} | {r['vp']} | {r['pipeline_schedule']} | "
              f"{r['recompute']} | {r['fits']} | {r['memory_gb']:.1f} | "
              f"{r['iteration_time_s']:.3g} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.parse_args()
    tables()
