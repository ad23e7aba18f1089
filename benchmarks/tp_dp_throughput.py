"""Tokens/s of the reference work at 1 rank, TP=2, DP=2 and TP=2 x DP=2 (CPU, gloo, fp32).

Model: 4 layers, h 256, 4 heads, FFN 1024, V 8192, s 256; global batch 8 sequences; AdamW.
Each layout runs 3 warm-up + 8 measured steps; a step's time is the slowest rank's (the trainer
max-reduces it); we report the median. Prints one JSON line per layout.

    OMP_NUM_THREADS=1 python -m benchmarks.tp_dp_throughput
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from loom.config import LoomConfig, ModelConfig
from testkit import run_distributed

WARMUP, MEASURED = 3, 8


def reference_config(tp: int, dp: int, micro_batch: int) -> LoomConfig:
    cfg = LoomConfig(model=ModelConfig.gpt2(num_layers=4, hidden_size=256, num_attention_heads=4,
                                            ffn_hidden_size=1024, seq_length=256, vocab_size=8192,
                                            hidden_dropout=0.0, attention_dropout=0.0))
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.parallel.overlap_grad_reduce = True  # docs/benchmarks.md's table was measured with overlap
    cfg.training.micro_batch_size = micro_batch
    cfg.training.global_batch_size = 8
    cfg.training.train_iters = WARMUP + MEASURED
    cfg.training.lr, cfg.training.adam_beta2 = 3e-4, 0.95  # loom's defaults before issue 21
    cfg.training.lr_decay_style, cfg.logging.eval_iters = "cosine", 10  # (comparable numbers)
    cfg.data.mock_data = True
    cfg.logging.log_interval = 10**6
    cfg.logging.no_progress_bar = True
    return cfg.validate(tp * dp)


def measure(tp: int, dp: int, micro_batch: int, threads: int) -> dict:
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    torch.set_num_threads(threads)
    cfg = reference_config(tp, dp, micro_batch)
    mesh = ParallelMesh.build(tp=tp, dp=dp) if dist.is_initialized() and tp * dp > 1 \
        else ParallelMesh.single()
    history = Trainer(cfg, mesh=mesh).train()
    times = [r["step_time_s"] for r in history[WARMUP:]]
    return {"median_step_s": statistics.median(times), "loss": history[-1]["loss"]}


LAYOUTS = [  # name, tp, dp, ranks, threads per rank
    ("1 rank (2 threads)", 1, 1, 1, 2),
    ("TP=2", 2, 1, 2, 1),
    ("DP=2", 1, 2, 2, 1),
    ("TP=2 x DP=2", 2, 2, 4, 1),
]


def main() -> None:
    tokens = 8 * 256
    for name, tp, dp, ranks, threads in LAYOUTS:
        micro = 8 // dp  # one micro-batch per DP rank
        res = run_distributed(ranks, measure, tp, dp, micro, threads, timeout=900)[0]
        print(json.dumps({"layout": name, "tp": tp, "dp": dp, "ranks": ranks,
                          "threads_per_rank": threads, "median_step_s": round(res["median_step_s"], 4),
                          "tokens_per_s": round(tokens / res["median_step_s"], 1),
                          "loss": round(res["loss"], 4)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
