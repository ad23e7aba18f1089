"""Long-context benchmark of the context-parallel comm types on this CPU (issue 25 item 5).

For each CP size c and sequence length s, one world of c gloo ranks (forked) runs:

* **layer**: one attention core (LLaMA-style GQA, a = 4 heads, g = 2 groups, d = 32, b = 1,
  fp32) wrapped in ``ContextParallelAttention`` for each comm type (``a2a+p2p`` at c = 4 as
  2 x 2), forward + backward on this rank's ``s/c`` tokens. Types alternate A B C D A B C D
  over ``--reps`` rounds after one warm-up round; a step's time is the slowest rank's; the
  median over rounds is quoted with its ratio to ``allgather``.
* **model**: a small LLaMA (2 layers, h = 128, a = 4, g = 2) through the Trainer, one
  micro-batch of one sequence, forward + backward + optimizer step, alternated the same way
  (``--model-seq`` lengths only: a whole model at 16K+ is minutes per step on 2 cores).

Peak memory: per (type, c, s) a fresh forked world runs one step; the figure is the growth of
the peak resident set (``ru_maxrss``) over what the rank held before the step, the largest over
ranks, in MiB (activations, K/V buffers and the attention's temporaries; allocator slack
included). Next to it ``kv_MiB``: the K/V a rank holds for attention by the cost model
(:func:`loom.parallel.context.cost.kv_elements`).

    OMP_NUM_THREADS=1 python -m benchmarks.long_context [--seq 8192 16384] [--cp 2 4]
        [--model-seq 8192] [--reps 2] [--out benchmarks/results/long_context.json]

On a 2-core machine c = 4 runs four ranks on two cores: times at c = 4 are slower than at
c = 2 for that reason alone; compare types at the same c.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch

from testkit import run_distributed

TYPES = ("allgather", "p2p", "a2a", "a2a+p2p")
A, G, D = 4, 2, 32


def _types(c: int) -> list[str]:
    return [t for t in TYPES if t != "a2a+p2p" or c == 4]


def _hier(c: int):
    return (2, c // 2) if c == 4 else None


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _layer(kind: str, s: int, mesh):
    from loom.models.attention import DotProductAttention
    from loom.parallel.context.attention import ContextParallelAttention
    from loom.parallel.context.split import local_positions
    c, r = mesh.size("cp"), mesh.coords["cp"]
    gen = torch.Generator().manual_seed(r)
    q = torch.randn(1, A, s // c, D, generator=gen, requires_grad=True)
    k = torch.randn(1, G, s // c, D, generator=gen, requires_grad=True)
    v = torch.randn(1, G, s // c, D, generator=gen, requires_grad=True)
    attn = ContextParallelAttention(DotProductAttention(0.0), mesh.groups["cp"], kind,
                                    mesh.groups.get("cp_a2a"), mesh.groups.get("cp_p2p"))
    pos = local_positions(s, r, c)

    def step():
        attn(q, k, v, pos).sum().backward()
    return step


def _model(kind: str, s: int, mesh):
    from loom.config import LoomConfig, ModelConfig
    from loom.training.trainer import Trainer
    c = mesh.size("cp")
    cfg = LoomConfig(model=ModelConfig.llama(
        num_layers=2, hidden_size=128, num_attention_heads=A, num_query_groups=G,
        ffn_hidden_size=256, seq_length=s, vocab_size=1000, hidden_dropout=0.0,
        attention_dropout=0.0))
    p, t = cfg.parallel, cfg.training
    p.context_parallel_size, p.cp_comm_type = c, kind
    if _hier(c):
        p.hierarchical_context_parallel_sizes = "%d %d" % _hier(c)
    t.micro_batch_size, t.global_batch_size, t.lr, t.train_iters = 1, 1, 1e-4, 100
    cfg.logging.log_interval = 10**9
    tr = Trainer(cfg.validate(c), mesh=mesh)

    def step():
        tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples))
        tr.optimizer_step()
        tr.consumed_samples += tr.global_batch
    return step


def _mesh(c: int):
    from loom.parallel.mesh import ParallelMesh
    return ParallelMesh.build(cp=c, hierarchical_cp=_hier(c))


def _timed(step) -> float:
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    step()
    took = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def time_world(what: str, c: int, s: int, reps: int) -> dict:
    """Alternated timing of every type (one world)."""
    torch.set_num_threads(1)
    mesh = _mesh(c)
    build = _layer if what == "layer" else _model
    steps = {kind: build(kind, s, mesh) for kind in _types(c)}
    times: dict = {kind: [] for kind in steps}
    for rnd in range(reps + 1):
        for kind, step in steps.items():
            took = _timed(step)
            if rnd:
                times[kind].append(took)
    return times


def memory_world(what: str, kind: str, c: int, s: int) -> float:
    """Peak-RSS growth of one step in a fresh world (MiB, this rank)."""
    torch.set_num_threads(1)
    mesh = _mesh(c)
    step = (_layer if what == "layer" else _model)(kind, s, mesh)
    before = _rss_mib()
    _timed(step)
    return _rss_mib() - before


def main() -> None:
    from loom.parallel.context.cost import AttentionShape, cp_cost
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="*", default=[8192, 16384])
    ap.add_argument("--model-seq", type=int, nargs="*", default=[8192])
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/long_context.json")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": "OMP_NUM_THREADS=1 python -m benchmarks.long_context "
                       + " ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v))}"
                                  if isinstance(v, list) else f"--{k} {v}"
                                  for k, v in vars(args).items() if k != "out"),
            "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "cpu_threads_per_rank": 1, "layer": dict(a=A, g=G, d=D, b=1, dtype="fp32"),
            "model": "llama L=2 h=128 a=4 g=2 ffn=256 V=1000, b=1, fp32"}
    rows: list = []
    jobs = [("layer", s) for s in args.seq] + [("model", s) for s in args.model_seq]
    for what, s in jobs:
        for c in args.cp:
            times = run_distributed(c, time_world, what, c, s, args.reps,
                                    start_method="fork", timeout=3600)[0]
            base = statistics.median(times["allgather"])
            for kind in _types(c):
                mem = max(run_distributed(c, memory_world, what, kind, c, s,
                                          start_method="fork", timeout=3600))
                cost = cp_cost(AttentionShape(s=s, b=1, a=A, g=G, d_qk=D, d_v=D), c, kind,
                               _hier(c), bytes_per_element=4)
                med = statistics.median(times[kind])
                row = {"what": what, "s": s, "c": c, "type": kind, "step_s": round(med, 3),
                       "vs_allgather": round(med / base, 2),
                       "times_s": [round(x, 3) for x in times[kind]],
                       "peak_rss_growth_MiB": round(mem, 1),
                       "kv_MiB": round(cost.kv_elements * 4 / 2**20, 2),
                       "sent_fwd_MiB": round(cost.bytes_fwd / 2**20, 2)}
                print(json.dumps(row), flush=True)
                rows.append(row)
                meta["load_average"] = os.getloadavg()[0]
                out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print("\n| what | s | c | type | step (s) | vs allgather | peak RSS growth (MiB) | "
          "K/V held (MiB) | sent fwd (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['s'] // 1024}K | {r['c']} | {r['type']} | {r['step_s']} | "
              f"{r['vs_allgather']} | {r['peak_rss_growth_MiB']} | {r['kv_MiB']} | "
              f"{r['sent_fwd_MiB']} |")


if __name__ == "__main__":
    main()
