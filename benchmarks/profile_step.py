"""Profile of one 1-rank step of the reference work (1 thread): loom as the trainer runs it and
the native module (``native_parallel.py``). Self CPU time per component (torch.profiler, op
names grouped as in ``CATS``, first match wins), plus the median wall time of 7 steps
interleaved loom / native step by step (first step of each dropped). Prints JSON, then a table.

    OMP_NUM_THREADS=1 python -m benchmarks.profile_step
"""
import json
import statistics
import time

import torch

CATS = [("GEMM (mm/addmm/bmm)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::addmm_")),
        ("attention core (SDPA fwd+bwd)", ("scaled_dot_product",)),
        ("softmax / CE elementwise", ("softmax", "aten::exp", "aten::max", "aten::amax", "aten::sub", "aten::mul",
                                      "aten::div", "aten::scatter", "aten::gather",
                                      "aten::masked_fill", "aten::sum", "_log_softmax",
                                      "aten::log", "aten::reciprocal", "aten::clamp",
                                      "aten::nll_loss")),
        ("LayerNorm fwd+bwd", ("layer_norm",)),
        ("GeLU fwd+bwd", ("gelu",)),
        ("copies (copy_/cat/clone)", ("aten::copy_", "aten::cat", "aten::clone")),
        ("zero fill", ("aten::fill_", "aten::zero_")),
        ("AdamW (fused)", ("_fused_adamw",)),
        ("grad norm (foreach_norm)", ("_foreach_norm", "aten::linalg_vector_norm")),
        ("embedding fwd+bwd", ("embedding",)),
        ("adds (residual, grad accumulation)", ("aten::add",)),
        ]


def categorize(prof):
    out = {c: 0.0 for c, _ in CATS}; out["other"] = 0.0
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3
        for c, keys in CATS:
            if any(k in e.key for k in keys):
                out[c] += ms; break
        else:
            out["other"] += ms
    return out


def main():
    torch.set_num_threads(1)
    from torch.profiler import profile, ProfilerActivity
    from benchmarks.vs_torch_native import reference_config
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    from benchmarks.native_parallel import NativeRunner
    cfg = reference_config(1, 1, 1, False, 8, "1f1b", 10)
    loom = Trainer(cfg, mesh=ParallelMesh.single())
    native = NativeRunner(cfg, 1, 1, 1, False, "none", "1f1b")
    batches = loom.batches(loom.train_ds, 0)

    def loom_step():
        loom.forward_backward(batches)
        loom.optimizer_step()
    steps = {"loom": loom_step, "native": lambda: native.step(batches)}
    walls = {k: [] for k in steps}
    for rep in range(8):  # A B A B, interleaved step by step
        for k, f in steps.items():
            t0 = time.perf_counter()
            f()
            walls[k].append(time.perf_counter() - t0)
    res = {}
    for k, f in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            f()
        res[k] = categorize(prof)
    return {"profile_ms": res,
            "wall_median_s": {k: statistics.median(v[1:]) for k, v in walls.items()}}


if __name__ == "__main__":
    from testkit import run_distributed
    r = run_distributed(1, main, timeout=1200)[0]
    print(json.dumps(r))
    cats = list(r["profile_ms"]["loom"])
    print("| component | loom ms | native ms |\n|---|---|---|")
    for c in cats + ["total"]:
        vals = [sum(r["profile_ms"][k].values()) if c == "total" else r["profile_ms"][k][c]
                for k in ("loom", "native")]
        print(f"| {c} | " + " | ".join(f"{v:.0f}" for v in vals) + " |")
