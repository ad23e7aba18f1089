"""Memory and speed of the data-parallel variants on the reference work (CPU, gloo).

Reference work: ``vs_torch_native.reference_config`` (4 layers, h 256, FFN 1024, V 8192, s 256,
global batch 8, AdamW, no clipping). Per variant, a fresh spawned world of ``--dp`` ranks runs
``--warmup`` + ``--steps`` steps; a step's time is the slowest rank's, the variant's the median.
Variants: plain all-reduce after backward, overlapped buckets (``--overlap-grad-reduce``), the
distributed optimizer (+ ``--overlap-param-gather``), ZeRO-2, ZeRO-3 (FSDP2), each in fp32 and
bf16. Reported
per rank: tensor bytes by kind (parameters, gradient buffers, fp32 master copies, Adam states)
per parameter, peak RSS (``ru_maxrss``, the process's whole life), and the gradient
communication backward did not hide: the seconds a step waits in ``finish_grad_sync`` (slowest
rank, median). Without ``--overlap-grad-reduce`` every reduction runs there, so "hidden" = 1 -
exposed / exposed(all-reduce) of the same precision. One JSON line per
variant, then a markdown table. On a CPU without bf16 arithmetic (AVX2) a bf16 GEMM is ~100x
slower than fp32 (measured: 512x256 @ 256x8192 takes 0.11 s in fp32, 11.6 s in bf16, the same
under autocast), so the bf16 rows there are for memory, not speed (``--precisions bf16
--steps 1 --warmup 0``).

    OMP_NUM_THREADS=1 python -m benchmarks.zero_memory [--dp 4] [--steps 3] [--precisions fp32]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

from testkit import run_distributed

PA = {"use_precision_aware_optimizer": True}
VARIANTS = {  # name: (overlap grad reduce, zero stage, overlap param gather, training flags)
    "all-reduce": (False, 0, False, {}), "overlap": (True, 0, False, {}),
    "dist-opt": (True, 1, True, {}), "zero2": (True, 2, False, {}), "zero3": (False, 3, False, {}),
    # Megatron's precision-aware optimizer (remainder masters; bf16 moments) and its CPU offload
    "dist-opt-pa": (True, 1, True, PA),
    "dist-opt-pa-bf16": (True, 1, True, {**PA, "exp_avg_dtype": "bf16",
                                          "exp_avg_sq_dtype": "bf16"}),
    "dist-opt-pa-offload": (True, 1, True, {**PA, "optimizer_cpu_offload": True})}


def tensor_bytes(tr) -> dict:
    """Bytes by kind on this rank."""
    from loom.parallel.grad_buffer import flat_buffers
    from loom.training.distributed_optimizer import DistributedOptimizer, param_bytes
    if isinstance(tr.optimizer, DistributedOptimizer):
        return param_bytes(tr.optimizer)
    if tr.cfg.training.zero_stage == 3:  # FSDP2: local shards; gradient shards (fp32) as held
        from loom.parallel.fsdp import local_tensor, model_state_bytes  # during the step
        b = model_state_bytes(tr.params, tr.optimizer)
        return {"params": b["params"], "main_grads": sum(local_tensor(p).numel() * 4
                                                          for p in tr.params),
                "master": 0, "optimizer": b["optimizer"]}
    grads = sum(r.grad_bytes() for r in flat_buffers(tr.reducers)) or \
        sum(p.numel() * 4 for p in tr.params)
    states = sum(v.numel() * v.element_size() for st in tr.optimizer.state.values()
                 for k, v in st.items() if k in ("exp_avg", "exp_avg_sq"))
    return {"params": sum(p.numel() * p.element_size() for p in tr.params),
            "main_grads": grads, "master": 0, "optimizer": states}


def run(variant: str, bf16: bool, steps: int, warmup: int) -> dict:
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    from benchmarks.vs_torch_native import reference_config
    dp = dist.get_world_size()
    og, zero, opg, flags = VARIANTS[variant]
    cfg = reference_config(1, 1, dp, False, 8 // dp, "1f1b", warmup + steps)
    cfg.parallel.overlap_grad_reduce = og
    cfg.training.zero_stage = zero
    cfg.training.overlap_param_gather = opg
    cfg.training.bf16 = bf16
    for name, value in flags.items():
        setattr(cfg.training, name, value)
    tr = Trainer(cfg.validate(dp), mesh=ParallelMesh.build())
    waits = [0.0]  # seconds this step spent in finish_grad_sync: gradient communication that
    for r in tr.reducers:  # backward did not hide (all of it without --overlap-grad-reduce)
        def timed(fn=r.finish_grad_sync):
            t = time.perf_counter()
            fn()
            waits[0] += time.perf_counter() - t
        r.finish_grad_sync = timed
    times, exposed = [], []
    for i in range(warmup + steps):
        dist.barrier()
        waits[0] = 0.0
        t0 = time.perf_counter()
        rec = tr.train_step()
        times.append(time.perf_counter() - t0)
        exposed.append(waits[0])
    kinds = tensor_bytes(tr)
    n = sum(p.numel() for p in tr.params)
    return {"times": times[warmup:], "exposed": exposed[warmup:], "loss": rec["loss"],
            "bytes": kinds, "params": n,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    args = ap.parse_args()
    rows = []
    for bf16 in [p == "bf16" for p in args.precisions]:
        for v in args.variants:
            res = run_distributed(args.dp, run, v, bf16, args.steps, args.warmup, timeout=1800)
            step = statistics.median(max(r["times"][i] for r in res)
                                     for i in range(args.steps))
            b = res[0]["bytes"]
            row = {"variant": v, "precision": "bf16" if bf16 else "fp32", "dp": args.dp,
                   "s_per_step": round(step, 4), "tokens_per_s": round(8 * 256 / step),
                   "bytes_per_param": {k: round(x / res[0]["params"], 3) for k, x in b.items()},
                   "total_bytes_per_param": round(sum(b.values()) / res[0]["params"], 3),
                   "peak_rss_mib": round(max(r["rss_mib"] for r in res)),
                   "exposed_comm_s": round(statistics.median(
                       max(r["exposed"][i] for r in res) for i in range(args.steps)), 4),
                   "loss": round(res[0]["loss"], 4)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = {r["precision"]: r["exposed_comm_s"] for r in rows if r["variant"] == "all-reduce"}
    print("\n| variant | precision | s/step | tokens/s | bytes/param (w + g + master + adam) "
          "| peak RSS MiB | exposed grad comm s | hidden |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        k = r["bytes_per_param"]
        b = base.get(r["precision"])
        hidden = f"{1 - r['exposed_comm_s'] / b:.0%}" if b else "n/a"
        if r["variant"] == "zero3":  # FSDP2 reduce-scatters inside backward: not seen here
            hidden = "n/a (FSDP2 reduces inside backward)"
        host = f" (+ {k['host']} on the host)" if k.get("host") else ""
        device = round(r["total_bytes_per_param"] - k.get("host", 0), 3)
        print(f"| {r['variant']} | {r['precision']} | {r['s_per_step']} | {r['tokens_per_s']} | "
              f"{device} = {k['params']} + {k['main_grads']} + "
              f"{k['master']} + {k['optimizer']}{host} | {r['peak_rss_mib']} | "
              f"{r['exposed_comm_s']} | {hidden} |")


if __name__ == "__main__":
    main()
