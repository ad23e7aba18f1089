"""MoE dispatchers on this machine: tokens/s and peak memory of a small DeepSeek-style model at
EP=1/2/4 with ``--moe-token-dispatcher-type alltoall`` and ``allgather``, next to the planner's
predicted step time, EP communication and memory (issue 24 item 6).

Model (fp32, dropout 0, mock data): 4 layers, the first dense (``--moe-layer-freq
"([0]*1+[1]*3)"``), h 128, 4 heads, 16 SwiGLU experts of width 64, top-4, sigmoid router with
the aux-loss-free expert bias, 4 groups / 2 per token, scaling 2.5, seq_aux_loss, a shared
expert of width 128, V 4096, s 128, global batch 16 on 4 CPU ranks (gloo, one thread each, so
EP changes only where experts live: DP is 4 throughout). Each (EP, dispatcher) pair runs in
its own spawned world (peak RSS is per process): 1 warm-up + 4 measured steps, the slowest
rank's step time (the trainer max-reduces it), the median; the pairs alternate A B A B over
``--repeats`` rounds and the medians over rounds are quoted, with the allgather/alltoall
ratio (at EP=1 both run the same code: no EP group, so that ratio is the noise). Peak memory:
the growth of each rank's ``VmHWM`` over its RSS just before the Trainer was built (max over
ranks; torch, gloo and the interpreter excluded), next to the planner's memory without its GPU
reserve.

Prediction: the planner on this machine's calibration (``--cluster FILE`` from
``loom.planner.calibrate.calibrate_local``, or calibrated at the start, ~20 s), the
links being the gloo all-reduce fit among 4 ranks and each rank getting ``min(1, C/4)`` of a
core (``calibrate.oversubscribed``), as ``benchmarks/moe_throughput.py`` does; the calibration
is saved next to the results (``*_cluster.json``). A calibration taken while other work loads
the machine can be off by several times: compare the saved ``peak_flops`` between runs.

    OMP_NUM_THREADS=1 python -m benchmarks.moe_dispatch [--cluster FILE] [--repeats 2]
      [--out benchmarks/results/moe_dispatch.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace

from loom.config import LoomConfig, ModelConfig
from testkit import run_distributed

WARMUP, MEASURED, RANKS, GLOBAL_BATCH, SEQ = 1, 4, 4, 16, 128
DISPATCHERS = ("alltoall", "allgather")
EPS = (1, 2, 4)


def make_config(ep: int, dispatcher: str) -> LoomConfig:
    cfg = LoomConfig(model=ModelConfig.llama(
        num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=SEQ, vocab_size=4096,
        ffn_hidden_size=256, hidden_dropout=0.0, attention_dropout=0.0, num_experts=16,
        moe_router_topk=4, moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=128,
        moe_layer_freq="([0]*1+[1]*3)", moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-3, moe_token_dispatcher_type=dispatcher))
    cfg.parallel.expert_model_parallel_size = ep
    t = cfg.training
    t.micro_batch_size, t.global_batch_size = GLOBAL_BATCH // RANKS, GLOBAL_BATCH
    t.train_iters, t.lr = WARMUP + MEASURED, 3e-4
    cfg.data.mock_data = True
    cfg.logging.log_interval, cfg.logging.eval_iters = 10**6, 0
    cfg.logging.no_progress_bar = True
    return cfg.validate(RANKS)


def _status(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, bytes (not ``ru_maxrss``: a spawned child
    inherits the parent's high-water mark)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def measure(ep: int, dispatcher: str) -> dict:
    import torch
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    torch.set_num_threads(1)
    base = _status("VmRSS")
    tr = Trainer(make_config(ep, dispatcher), mesh=ParallelMesh.build(ep=ep))
    history = tr.train()
    grown = torch.tensor([float(_status("VmHWM") - base)], dtype=torch.float64)
    dist.all_reduce(grown, op=dist.ReduceOp.MAX)
    return {"median_step_s": statistics.median(r["step_time_s"] for r in history[WARMUP:]),
            "peak_growth_mib": float(grown) / 2**20, "loss": history[-1]["loss"]}


def predict(cal, ep: int, dispatcher: str) -> dict:
    """The planner's step time, EP communication and memory for the layout (see docstring)."""
    from loom.planner.host_sharing import oversubscribed
    from loom.planner.predict import predict_layout
    ar = cal.notes.get("allreduce", {}).get(str(RANKS))
    if ar:
        cal = replace(cal, intra_alpha=ar["alpha_s"], inter_alpha=ar["alpha_s"],
                      intra_bw=ar["bw_bytes_per_s"], inter_bw=ar["bw_bytes_per_s"])
    cal = oversubscribed(cal, RANKS, os.cpu_count())
    p = predict_layout(make_config(ep, dispatcher), RANKS, cluster=cal)
    return {"predicted_step_s": p["time_s"]["iteration"], "predicted_ep_comm_s":
            p["time_s"]["ep_comm"], "predicted_memory_mib": (  # the GPU reserve left out
                p["memory_bytes"]["total"] - p["memory_bytes"]["reserve"]) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", help="cluster JSON from calibrate_local (default: calibrate now)")
    ap.add_argument("--repeats", type=int, default=2, help="A B A B rounds")
    ap.add_argument("--out", default="benchmarks/results/moe_dispatch.json")
    args = ap.parse_args()
    from loom.planner.calibrate import calibrate_local
    from loom.planner.hardware import Cluster
    cal = Cluster.load(args.cluster) if args.cluster else calibrate_local(None, world=RANKS)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    cal.save(args.out.replace(".json", "_cluster.json"))  # the calibration the prediction used
    runs: dict = {(ep, d): [] for ep in EPS for d in DISPATCHERS}
    for _ in range(args.repeats):
        for ep in EPS:
            for d in DISPATCHERS:  # alternate A B within each EP size, round after round
                load = os.getloadavg()[0]
                res = run_distributed(RANKS, measure, ep, d, timeout=1200)[0]
                res["load_avg_1min"] = load
                runs[(ep, d)].append(res)
    rows = []
    tokens = GLOBAL_BATCH * SEQ
    for ep in EPS:
        for d in DISPATCHERS:
            r = runs[(ep, d)]
            step = statistics.median(x["median_step_s"] for x in r)
            rec = {"ep": ep, "dispatcher": d, "ranks": RANKS, "median_step_s": round(step, 4),
                   "tokens_per_s": round(tokens / step, 1),
                   "peak_growth_mib_max_rank": round(statistics.median(
                       x["peak_growth_mib"] for x in r), 1),
                   "rounds_step_s": [round(x["median_step_s"], 4) for x in r],
                   "load_avg_1min": [round(x["load_avg_1min"], 2) for x in r],
                   "loss": round(r[-1]["loss"], 4)}
            rec.update({k: round(v, 4) for k, v in predict(cal, ep, d).items()})
            rec["prediction_error_pct"] = round(100 * (rec["predicted_step_s"] - step) / step, 1)
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    ratios = {f"ep{ep}": round(next(x["median_step_s"] for x in rows if x["ep"] == ep and
                                    x["dispatcher"] == "allgather") /
                               next(x["median_step_s"] for x in rows if x["ep"] == ep and
                                    x["dispatcher"] == "alltoall"), 3) for ep in EPS}
    print(json.dumps({"allgather_over_alltoall_step_time": ratios}), flush=True)
    with open(args.out, "w") as fh:
        json.dump({"benchmark": "moe_dispatch", "date": time.strftime("%Y-%m-%d"),
                   "cpu_count": os.cpu_count(), "rows": rows,
                   "allgather_over_alltoall_step_time": ratios}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
