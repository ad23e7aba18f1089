"""The planner's predicted MFU and memory per GPU for ``mamba2-1.3b`` on 8 and 64 H100 (80 GB),
per layout: for every (TP, PP, DP) combination the fastest fitting layout (over micro-batch,
recompute, SP, ZeRO, virtual stages), fastest first (issue 11's benchmark, planner half).

    OMP_NUM_THREADS=1 python -m benchmarks.planner_mamba            # tables, ~1 s
    OMP_NUM_THREADS=1 python -m benchmarks.planner_mamba --json out.json

Two models: the published ``mamba2-1.3b`` (G = 1 group, so TP > 1 is refused, as loom train
and Megatron-LM refuse G not divisible by TP) and the same shape with ``G = 8``
(``--mamba-num-groups 8``, 1.52B parameters: not the published model) to show the TP layouts.
Global batch 1024 sequences of 2048 tokens, fused kernels (``Options.flash_attention``: flash
attention, ``mamba_ssm``'s chunk scan), ZeRO up to stage 1 (what loom train runs, the default of
``loom plan``). Predictions of the analytic model, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from loom.planner.hardware import make_cluster
from loom.planner.layout import Options
from loom.planner.presets import get_preset
from loom.planner.search import record, search

GLOBAL_BATCH = 1024
SEQ_LENGTH = 2048


def per_layout(model, num_gpus: int, top: int) -> list[dict]:
    """The fastest fitting layout of each (tp, pp, dp), fastest first (at most ``top``)."""
    res = search(model, make_cluster("H100-80GB", num_gpus), GLOBAL_BATCH, SEQ_LENGTH, None,
                 Options(flash_attention=True, max_zero_stage=1))
    seen, out = set(), []
    for i in res["order"]:
        rec = record(res, int(i))
        key = (rec["tp"], rec["pp"], rec["dp"])
        if key in seen:
            continue
        seen.add(key)
        out.append({k: rec[k] for k in ("tp", "pp", "dp", "vp", "micro_batch_size", "recompute",
                                        "sequence_parallel", "zero", "memory_gb", "mfu",
                                        "tflops_per_gpu", "iteration_time_s", "dominant")})
        if len(out) >= top:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON "
                                                                  "('-' for stdout)")
    ap.add_argument("--top", type=int, default=10, help="layouts per table")
    args = ap.parse_args()
    base = get_preset("mamba2-1.3b")
    models = {"mamba2-1.3b (G=1, published)": base,
              "mamba2-1.3b with G=8 (TP-capable variant)": dataclasses.replace(
                  base, mamba_num_groups=8)}
    result = {}
    for label, model in models.items():
        for n in (8, 64):
            rows = per_layout(model, n, args.top)
            result[f"{label} on {n} x H100-80GB"] = rows
            print(f"\n{label} on {n} x H100-80GB, B={GLOBAL_BATCH}, s={SEQ_LENGTH}\n")
            print("| tp | pp | dp | vp | b | recompute | sp | zero | memory GB | MFU | "
                  "TFLOP/s | iter s |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
            for r in rows:
                print(f"| {r['tp']} | {r['pp']} | {r['dp']} | {r['vp']} | "
                      f"{r['micro_batch_size']} | {r['recompute']} | "
                      f"{'y' if r['sequence_parallel'] else 'n'} | {r['zero']} | "
                      f"{r['memory_gb']:.1f} | {100 * r['mfu']:.1f}% | "
                      f"{r['tflops_per_gpu']:.0f} | {r['iteration_time_s']:.3f} |")
    if args.json == "-":
        print(json.dumps(result, indent=1))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
