"""Pipeline bubble benchmark: tokens/s and measured bubble fraction per schedule.

For p in {2, 4}, m in {p, 4p} and each schedule (gpipe, 1f1b, interleaved with v = 2), trains a
small GPT on p spawned gloo ranks (CPU) and prints one JSON line per configuration:

- ``tokens_per_s``: global batch tokens / step time (slowest rank), median of the timed steps
- ``bubble_measured``: idle (receive-wait) time / flush time, averaged over the stages
- ``bubble_theory``: the same ratio for an ideal pipeline, (p-1) / (v m + p - 1)
- ``bubble_over_compute`` and ``bubble_paper``: idle / busy time, beside Narayanan et al.'s
  (p-1)/m, or (p-1)/(v m) when interleaved

Usage: ``OMP_NUM_THREADS=1 python -m benchmarks.pipeline_bubble [--hidden 256 --layers 8 ...]``.
On a machine with fewer cores than ranks the ranks share cores, so stages are not independent
and the measured bubble includes time a rank waits for a core; compare schedules, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from loom.config import LoomConfig, ModelConfig, ParallelConfig, TrainingConfig
from testkit import run_distributed


def make_cfg(args, p: int, m: int, schedule: str) -> LoomConfig:
    lpv = args.layers // (2 * p) if schedule == "interleaved" else None
    model = ModelConfig.gpt2(num_layers=args.layers, hidden_size=args.hidden,
                             num_attention_heads=args.heads, seq_length=args.seq,
                             vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0)
    par = ParallelConfig(pipeline_model_parallel_size=p, pipeline_schedule=schedule,
                         num_layers_per_virtual_pipeline_stage=lpv)
    train = TrainingConfig(micro_batch_size=args.micro_batch, global_batch_size=args.micro_batch * m,
                           train_iters=args.warmup + args.steps, lr=1e-4,
                           adam_beta2=0.95, lr_decay_style="cosine")  # loom's old defaults
    cfg = LoomConfig(model=model, parallel=par, training=train)
    cfg.data.mock_data = True
    cfg.logging.no_progress_bar = True
    return cfg


def _worker(args, p: int, cases: list) -> list:
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    mesh = ParallelMesh.build(pp=p)
    out = []
    for m, schedule in cases:
        cfg = make_cfg(args, p, m, schedule).validate(dist.get_world_size())
        tr = Trainer(cfg, mesh=mesh)
        recs = [tr.train_step() for _ in range(args.warmup + args.steps)][args.warmup:]
        st = tr.last_stats
        out.append({"m": m, "schedule": schedule, "v": len(tr.model_chunks),
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs),
                    "bubble_measured": statistics.mean(r["bubble_fraction"] for r in recs),
                    "idle_s": st.idle_s, "flush_s": st.flush_s})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    print(json.dumps({"cpu_cores": os.cpu_count(), "args": vars(args)}), flush=True)
    for p in args.pp:
        cases = [(m, s) for m in (p, 4 * p) for s in ("gpipe", "1f1b", "interleaved")]
        t0 = time.time()
        results = run_distributed(p, _worker, args, p, cases, timeout=3600)
        for i, (m, s) in enumerate(cases):
            r0 = results[0][i]
            v = r0["v"]
            # stage-averaged bubble (each rank's train_step already averages over ranks)
            meas = r0["bubble_measured"]
            print(json.dumps({
                "p": p, "m": m, "schedule": s, "v": v,
                "tokens_per_s": round(r0["tokens_per_s"], 1),
                "bubble_measured": round(meas, 3),
                "bubble_theory": round((p - 1) / (v * m + p - 1), 3),
                "bubble_over_compute": round(meas / (1 - meas), 3) if meas < 1 else None,
                "bubble_paper": round((p - 1) / (v * m), 3),
                "oversubscribed": p > (os.cpu_count() or 1)}), flush=True)
        print(json.dumps({"p": p, "wall_s": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
