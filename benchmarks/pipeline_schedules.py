"""Pipeline schedules on the same work: 1F1B, interleaved 1F1B (v = 2), ZB-H1
(``--pipeline-schedule zero-bubble``) and ZB-V (``zbv``, two chunks per stage in a V) at p = 2
and 4, with each schedule's bubble formula.

Every (p, schedule) trains the same small GPT with the same global batch (m micro-batches) on
p spawned gloo ranks (CPU), one fresh world per run so that the peak resident memory is that
run's; rounds alternate the schedules (A B C A B C) and medians are reported. Per run:

- ``bubble_timeline``: 1 - busy / flush per stage from the ``--timeline`` spans of each step
  (busy = forward, backward (B) and weight-gradient (W) spans; flush = first span start to last
  span end of the step's schedule), averaged over stages;
- ``bubble_wait``: the schedule's own receive-wait time / flush (``PipelineStats``);
- ``bubble_formula``: the schedule's bubble (:mod:`loom.parallel.pipeline.bubble`) as a
  fraction of the step, with T_F = T_B = T_W (the paper's model) and with the F, B, W times
  measured in this run (1F1B and interleaved: the fused backward split as ZB-H1's B : W);
- ``step_s`` (slowest rank), ``peak_rss_mib`` per stage (``ru_maxrss``; the process's peak,
  parameters and the runtime included) and ``peak_in_flight`` (micro-batches between F and the
  end of their backward, stage 0).

Usage: ``OMP_NUM_THREADS=1 python -m benchmarks.pipeline_schedules [--rounds 2 --json PATH]``
(default output ``benchmarks/results/pipeline_schedules.json``). With fewer cores than ranks the
stages share cores: a waiting stage lends its core, so compare schedules, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.pipeline_bubble import make_cfg as bubble_cfg
from loom.config import LoomConfig
from loom.parallel.pipeline import bubble
from testkit import run_distributed

SCHEDULES = ("1f1b", "interleaved", "zero-bubble", "zbv")
SPLIT = ("zero-bubble", "zbv")  # schedules whose backward runs as B and W
COMPUTE = ("forward", "backward", "backward_weight")


def make_cfg(args, p: int, schedule: str) -> LoomConfig:
    """pipeline_bubble's model and layout (interleaved: v = 2) at m = m_per_stage x p, with the
    timeline recorder on."""
    cfg = bubble_cfg(args, p, args.m_per_stage * p, schedule)
    cfg.logging.timeline = os.path.join(args.tmp, "unused.json")  # enables the recorder
    return cfg


def _step_spans(events: list) -> dict:
    """Busy time, flush time and mean F / B / W span durations (seconds) of one step."""
    spans = [e for e in events if e["cat"] != "optimizer"]
    start = min(e["ts"] for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans)
    out = {"busy": sum(e["dur"] for e in spans if e["cat"] in COMPUTE) / 1e6,
           "flush": (end - start) / 1e6}
    for cat, key in zip(COMPUTE, "FBW"):
        d = [e["dur"] / 1e6 for e in spans if e["cat"] == cat]
        out[key] = statistics.mean(d) if d else 0.0
    return out


def _worker(args, p: int, schedule: str) -> dict:
    import resource

    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    cfg = make_cfg(args, p, schedule).validate(dist.get_world_size())
    tr = Trainer(cfg, mesh=ParallelMesh.build(pp=p))
    steps = []
    for i in range(args.warmup + args.steps):
        tr.timeline.events.clear()
        rec = tr.train_step()
        if i >= args.warmup:
            steps.append({**_step_spans(tr.timeline.events),
                          "wait": tr.last_stats.bubble_fraction,
                          "tokens_per_s": rec.get("tokens_per_s")})
    med = {k: statistics.median(s[k] for s in steps) for k in ("busy", "flush", "F", "B", "W",
                                                               "wait")}
    return {**med, "tokens_per_s": statistics.median(s["tokens_per_s"] for s in steps),
            "peak_in_flight": tr.last_stats.peak_in_flight, "ops": tr.last_stats.op_counts,
            "v": len(tr.model_chunks), "m": tr.last_stats.num_microbatches,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def summarize(p: int, schedule: str, runs: list, zb_ratio) -> dict:
    """Medians over the rounds of the per-stage results ``runs`` (one list of stages each)."""
    def med(f):
        return statistics.median(f(stages) for stages in runs)
    first = runs[0][0]
    v, m = first["v"], first["m"]
    tf = med(lambda st: statistics.mean(s["F"] for s in st)) * v
    tb = med(lambda st: statistics.mean(s["B"] for s in st)) * v
    tw = med(lambda st: statistics.mean(s["W"] for s in st)) * v
    if schedule not in SPLIT and zb_ratio is not None:  # fused backward = B + W
        tb, tw = tb * zb_ratio, tb * (1 - zb_ratio)
    unit = bubble.bubble_fraction(bubble.schedule_bubble(schedule, p, m, v), m)
    meas = bubble.bubble_fraction(bubble.schedule_bubble(schedule, p, m, v, tf, tb, tw), m,
                                  tf, tb, tw) if tw > 0 else None
    return {"p": p, "schedule": schedule, "m": m, "v": v,
            "formula": bubble.FORMULAS[schedule],
            "bubble_timeline": round(med(lambda st: statistics.mean(
                1 - s["busy"] / s["flush"] for s in st)), 3),
            "bubble_wait": round(med(lambda st: statistics.mean(s["wait"] for s in st)), 3),
            "bubble_formula_unit": round(unit, 3),
            "bubble_formula_measured": round(meas, 3) if meas is not None else None,
            "step_s": round(med(lambda st: max(s["flush"] for s in st)), 4),
            "tokens_per_s": round(med(lambda st: st[0]["tokens_per_s"]), 1),
            "peak_rss_mib": [round(statistics.median(st[r]["peak_rss_mib"] for st in runs))
                             for r in range(p)],
            "peak_in_flight_stage0": first["peak_in_flight"], "ops_stage0": first["ops"],
            "F_B_W_ms": [round(1e3 * x / v, 2) for x in (tf, tb, tw)], "rounds": len(runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sizes = {"hidden": 256, "heads": 8, "layers": 8, "seq": 256, "vocab": 1024,
             "micro-batch": 2, "m-per-stage": 2, "warmup": 1, "steps": 3, "rounds": 2}
    for name, default in sizes.items():  # m = m-per-stage x p; rounds alternate A B C
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--json", default="benchmarks/results/pipeline_schedules.json")
    args = ap.parse_args()
    args.tmp = "/tmp"
    meta = {"cpu_cores": os.cpu_count(), "args": vars(args),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(meta), flush=True)
    rows = []
    for p in args.pp:
        runs = {s: [] for s in args.schedules}
        for _ in range(args.rounds):
            for s in args.schedules:  # alternated: 1f1b, interleaved, zero-bubble, zbv, 1f1b...
                runs[s].append(run_distributed(p, _worker, args, p, s, timeout=3600))
        zb = [st for s in SPLIT if s in runs for st in runs[s]]
        ratio = statistics.median(statistics.mean(s["B"] / (s["B"] + s["W"]) for s in st)
                                  for st in zb) if zb else None
        for s in args.schedules:
            rows.append(summarize(p, s, runs[s], ratio))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n| p | schedule | m | formula | bubble (timeline) | bubble (formula, F=B=W) | "
          f"bubble (formula, measured F,B,W) | step s | peak RSS MiB per stage |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['p']} | {r['schedule']} | {r['m']} | {r['formula']} | "
              f"{r['bubble_timeline']} | {r['bubble_formula_unit']} | "
              f"{r['bubble_formula_measured']} | {r['step_s']} | "
              f"{', '.join(str(x) for x in r['peak_rss_mib'])} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({**meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
