"""How fast could data parallelism be here with no communication at all?

For DP = d on the reference work (``vs_torch_native.py``), three worlds of d ranks alternate
(A B C A B C ...): loom DP = d, native DDP, and d independent single-process loom trainers
side by side, each on its 8/d samples ("alone": the same per-rank work on the same shared
cores, no gradient reduction, no synchronisation but a barrier before each step). "alone" is an
upper bound on what any gradient-reduction scheme can reach on this machine: its ratio to
DDP says whether a DP ratio goal is reachable by changing loom's communication. Median of
``--repeats`` runs of the slowest rank's median step. Prints JSON lines.

    OMP_NUM_THREADS=1 python -m benchmarks.dp_bound [--dp 2 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks import vs_torch_native as bench
from testkit import run_distributed


def run_alone(dp: int, steps: int) -> dict:
    """One rank of d: a single-process loom trainer on 8/d samples per step."""
    import torch
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    torch.set_num_threads(1)
    cfg = bench.reference_config(1, 1, 1, False, 8 // dp, "1f1b", steps)
    cfg.training.global_batch_size = 8 // dp
    tr = Trainer(cfg, mesh=ParallelMesh.single())
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples))
        tr.optimizer_step()
        times.append(time.perf_counter() - t0)
        tr.consumed_samples += tr.global_batch
    return {"times": times}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    for d in args.dp:
        layout = bench.LAYOUTS[f"dp{d}"]
        impls = {"loom": (bench.run_loom, (layout,)), "native": (bench.run_native, (layout,)),
                 "alone": (run_alone, (d,))}
        runs = {k: [] for k in impls}
        for _ in range(args.repeats):
            for name, (fn, pre) in impls.items():
                res = run_distributed(d, fn, *pre, args.warmup + args.steps, timeout=1800)
                per_step = [max(r["times"][i] for r in res)
                            for i in range(args.warmup, args.warmup + args.steps)]
                runs[name].append(statistics.median(per_step))
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(json.dumps({"dp": d, **{f"{k}_s_per_step": round(v, 4) for k, v in med.items()},
                          "loom_over_native": round(med["loom"] / med["native"], 3),
                          "alone_over_native": round(med["alone"] / med["native"], 3),
                          "runs": {k: [round(x, 4) for x in v] for k, v in runs.items()}}),
              flush=True)


if __name__ == "__main__":
    main()
