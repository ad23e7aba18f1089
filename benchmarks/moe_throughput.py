"""Tokens/s and per-rank memory of a small Mixtral-style model on 4 CPU ranks (gloo, fp32):
EP=1 (DP=4, every rank holds all experts), EP=2, EP=4, and EP=2 x TP=2 (DP=2); plus the
planner's predicted step time for the same layouts on this machine's calibration when one is
given (``--cluster FILE``, from ``loom.planner.calibrate.calibrate_local``) or calibrated at the
start (~20 s): the planner's prediction for R ranks on C cores uses the all-reduce fit among R
ranks for the links and ``min(1, C/R)`` of a core per rank (``host_sharing.oversubscribed``), as
``benchmarks/planner_vs_measured.py`` does; its error is printed next to the measurement.

Model: 4 layers, h 256, 8 heads (4 KV groups), 8 SwiGLU experts of width 512, top-2, V 8192,
s 256, global batch 16. Each layout: 2 warm-up + 5 measured steps; a step's time is the slowest
rank's (the trainer max-reduces it); the median is reported. Prints one JSON line per layout.

    OMP_NUM_THREADS=1 python -m benchmarks.moe_throughput [--cluster FILE] [--no-predict]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

from loom.config import LoomConfig, ModelConfig
from testkit import run_distributed

WARMUP, MEASURED = 2, 5


def moe_config(tp: int, ep: int, world: int = 4) -> LoomConfig:
    cfg = LoomConfig(model=ModelConfig.mixtral(
        num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
        ffn_hidden_size=512, seq_length=256, vocab_size=8192, hidden_dropout=0.0,
        attention_dropout=0.0))
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.parallel.expert_model_parallel_size = ep
    cfg.training.micro_batch_size = 16 // (world // tp)
    cfg.training.global_batch_size = 16
    cfg.training.train_iters = WARMUP + MEASURED
    cfg.training.lr, cfg.training.adam_beta2 = 3e-4, 0.95  # loom's defaults before issue 21
    cfg.training.lr_decay_style, cfg.logging.eval_iters = "cosine", 10  # (comparable numbers)
    cfg.data.mock_data = True
    cfg.logging.log_interval = 10**6
    cfg.logging.no_progress_bar = True
    return cfg.validate(world)


def measure(tp: int, ep: int) -> dict:
    import torch
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    torch.set_num_threads(1)
    tr = Trainer(moe_config(tp, ep), mesh=ParallelMesh.build(tp=tp, ep=ep))
    history = tr.train()
    mem = torch.tensor([history[-1]["peak_memory_bytes"]], dtype=torch.float64)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    total, local = tr.count_parameters()
    return {"median_step_s": statistics.median(r["step_time_s"] for r in history[WARMUP:]),
            "loss": history[-1]["loss"], "peak_rss_mib": float(mem) / 2**20,
            "params_total": total, "params_rank0": local}


LAYOUTS = [("EP=1 (DP=4)", 1, 1), ("EP=2 (DP=4)", 1, 2), ("EP=4 (DP=4)", 1, 4),
           ("EP=2 x TP=2 (DP=2)", 2, 2)]


def predicted_step_s(cal, tp: int, ep: int, ranks: int = 4) -> float:
    """The planner's iteration time (s) for the layout on the calibrated machine, R ranks
    sharing its cores (see the module docstring)."""
    from loom.planner.host_sharing import oversubscribed
    from loom.planner.predict import predict_layout

    ar = cal.notes.get("allreduce", {}).get(str(ranks))
    if ar:
        cal = replace(cal, intra_alpha=ar["alpha_s"], inter_alpha=ar["alpha_s"],
                      intra_bw=ar["bw_bytes_per_s"], inter_bw=ar["bw_bytes_per_s"])
    cal = oversubscribed(cal, ranks, os.cpu_count())
    return predict_layout(moe_config(tp, ep, ranks), ranks, cluster=cal)["time_s"]["iteration"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", help="cluster JSON from calibrate_local (default: calibrate now)")
    ap.add_argument("--no-predict", action="store_true", help="measure only")
    args = ap.parse_args()
    cal = None
    if not args.no_predict:
        from loom.planner.calibrate import calibrate_local
        from loom.planner.hardware import Cluster
        cal = Cluster.load(args.cluster) if args.cluster else calibrate_local(None, world=4)
    tokens = 16 * 256
    for name, tp, ep in LAYOUTS:
        res = run_distributed(4, measure, tp, ep, timeout=1200)[0]
        rec = {"layout": name, "tp": tp, "ep": ep, "ranks": 4,
               "median_step_s": round(res["median_step_s"], 4),
               "tokens_per_s": round(tokens / res["median_step_s"], 1),
               "peak_rss_mib_max_rank": round(res["peak_rss_mib"], 1),
               "params_total": res["params_total"],
               "params_rank0": res["params_rank0"], "loss": round(res["loss"], 4)}
        if cal is not None:
            pred = predicted_step_s(cal, tp, ep)
            rec["predicted_step_s"] = round(pred, 4)
            rec["prediction_error_pct"] = round(100 * (pred - res["median_step_s"])
                                                / res["median_step_s"], 1)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    sys.exit(main())
