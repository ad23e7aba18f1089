"""Where ``make gpu-check``'s planner rows disagree: the step's kernels and the peak's tensors.

``make gpu-check`` found on one H200 (benchmarks/results/gpu_check_h200.json) that the planner
under-predicts loom's step (-7% to -33%) and its peak memory. This script looks inside one step
of the same 1.10B LLaMA-style model (``benchmarks.gpu_check.FULL``):

* ``profile``: ``torch.profiler`` over ``steps`` steps of loom and of the plain PyTorch loop
  (``benchmarks/plain_llama.py``) at micro-batch ``b``: the top operators by device time, the
  device's busy time (the sum of kernel times) against the wall time of the step, and loom's
  own phases (``Trainer.timeline``'s spans where recorded).
* ``memory``: for each given row (``b16-none``, ``b16-full``, ...), the bytes allocated before
  the step (weights, main gradients, optimizer states) and, from
  ``torch.cuda.memory._record_memory_history`` over one step, the tensors alive at the step's
  peak grouped by the innermost ``loom/`` source line that allocated them
  (:func:`live_at_peak`), against the planner's terms (:func:`benchmarks.gpu_check.predict`).

Output: ``gpu_profile_<gpu>.json`` in ``--out`` (default ``$OUT``) and
``benchmarks/results/``; a summary is printed. Without CUDA the profile runs on the CPU at the
tiny size (``--device cpu --sizes tiny``: the CPU test) and the memory part is skipped.

    PYTHONPATH=. python3 -m benchmarks.gpu_profile --rows b16-none,b16-full,b8-none
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import gpu_check as gc_  # noqa: E402


def where(frames: list[dict], marker: str = "/loom/") -> str:
    """``file:line function`` of the innermost frame under ``marker`` (the allocation's loom
    source), else of the innermost frame, else ``?``."""
    for f in frames:
        if marker in f.get("filename", ""):
            name = f["filename"].split(marker, 1)[1]
            return f"loom/{name}:{f.get('line')} {f.get('name')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename')}:{f.get('line')} {f.get('name')}"
    return "?"


def live_at_peak(events: Iterable[dict], top: int = 25) -> dict:
    """Replay an allocator trace (``torch.cuda.memory._snapshot()["device_traces"][i]``: events
    with ``action`` ``alloc`` / ``free_requested`` / ``free_completed``, ``addr``, ``size``
    bytes, ``frames``) and return the peak of the bytes allocated during it, its event index and
    the live allocations at that index grouped by :func:`where` (bytes, count), largest first.
    A block counts from ``alloc`` to ``free_requested`` (the caching allocator's view; the
    block is reusable once its stream is done)."""
    events = list(events)
    live, total, peak, at = {}, 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, at = total, i
        elif e["action"] == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])
    groups: dict = defaultdict(lambda: [0, 0])
    alive: dict = {}
    for e in events[:at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_requested":
            alive.pop(e["addr"], None)
    for e in alive.values():
        g = groups[where(e.get("frames") or [])]
        g[0] += e["size"]
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"peak_bytes_in_step": peak, "peak_event": at,
            "groups": [{"where": k, "bytes": v[0], "count": v[1]} for k, v in ranked[:top]],
            "rest_bytes": sum(v[0] for _, v in ranked[top:])}


SIZES = {**gc_.SIZES,
         # GPT-2 small's shape (125M with V 32000): where the host's per-step work shows first
         "small": dataclasses.replace(gc_.FULL, num_layers=12, hidden_size=768, heads=12, groups=4,
                                      ffn=3072, seq=1024)}

ROWS = {"b16-none": (16, None, 1), "b8-none": (8, None, 1), "b16-selective": (16, "selective", 1),
        "b16-full": (16, "full", 1), "b8-s4096-none": (8, None, 2)}


def _trainer(accel, flags):
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    with gc_.weights_on_device():
        return Trainer(gc_.loom_config(flags), mesh=ParallelMesh.single(accel.device))


def memory_row(accel, sz, name: str, gpu: str) -> dict:
    """One row: allocated before the measured step, the step's peak and what is alive then."""
    b, recompute, seq_mult = ROWS[name]
    flags = gc_.loom_flags(sz, b, sz.seq * seq_mult, recompute, device=accel.device.type)
    accel.free()
    start = torch.cuda.memory_allocated(accel.device)
    tr = _trainer(accel, flags)
    built = torch.cuda.memory_allocated(accel.device)
    tr.train_step()  # the optimizer's states appear at the first step
    accel.sync()
    before = torch.cuda.memory_allocated(accel.device)
    torch.cuda.reset_peak_memory_stats(accel.device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    tr.train_step()
    accel.sync()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated(accel.device)
    dev = accel.device.index or 0
    trace = snap["device_traces"][dev] if len(snap["device_traces"]) > dev else []
    summary = live_at_peak(trace)
    pred = gc_.predict(flags, gpu)
    del tr, snap, trace
    accel.free()
    return {"row": name, "flags": {k: flags[k] for k in ("micro_batch_size", "seq_length")},
            "recompute": recompute, "allocated_at_start_bytes": start,
            "after_build_bytes": built - start, "before_step_bytes": before - start,
            "peak_bytes": peak - start, "step_peak_over_before_bytes": peak - before,
            "trace": summary, "predicted_memory_bytes": pred["memory_bytes"],
            "left_after_drop_bytes": torch.cuda.memory_allocated(accel.device) - start}


def _profile(fn, steps: int, device_type: str) -> dict:
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    fn()  # warm
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        wall = (time.perf_counter() - t0) / steps
    from torch.autograd import DeviceType
    ka = prof.key_averages()
    dev_attr = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    rows = sorted(ka, key=lambda e: -getattr(e, dev_attr, 0))
    # the device's own events (kernels, copies, sets) only: an operator's device time repeats
    # its kernels'
    busy = sum(e.device_time_total for e in prof.events()
               if e.device_type == DeviceType.CUDA) / 1e6 / steps
    top = [{"op": e.key, "device_s_per_step": getattr(e, dev_attr, 0) / 1e6 / steps,
            "cpu_s_per_step": e.cpu_time_total / 1e6 / steps, "calls_per_step": e.count / steps}
           for e in rows[:30]]
    by_cpu = sorted(ka, key=lambda e: -e.cpu_time_total)[:15]
    return {"wall_s_per_step": wall, "device_busy_s_per_step": busy if device_type == "cuda" else None,
            "top_device": top,
            "top_cpu": [{"op": e.key, "cpu_s_per_step": e.cpu_time_total / 1e6 / steps,
                         "calls_per_step": e.count / steps} for e in by_cpu]}


def profile_arms(accel, sz, b: int, steps: int) -> dict:
    flags = gc_.loom_flags(sz, b, sz.seq, device=accel.device.type)
    out = {}
    accel.free()
    tr = _trainer(accel, flags)
    out["loom"] = _profile(lambda: (tr.train_step(), accel.sync()), steps, accel.device.type)
    out["loom"]["timers"] = getattr(tr, "history", [{}])[-1].get("timers") if tr.history else None
    del tr
    accel.free()
    from benchmarks.plain_llama import PlainRunner
    cfg = gc_.loom_config(flags)
    runner = PlainRunner(cfg.model, accel.device)
    data = torch.randint(0, sz.vocab, (b, sz.seq + 1), device=accel.device)
    out["plain"] = _profile(lambda: (runner.step(data[:, :-1], data[:, 1:]), accel.sync()),
                            steps, accel.device.type)
    del runner, data
    accel.free()
    return out


def speed(accel, sz, b: int, steps: int, rounds: int = 2) -> dict:
    """loom and the plain loop at micro-batch ``b``, A B A B (``benchmarks.gpu_check``'s arms,
    no profiler): median step of each arm and loom's tokens/s over the plain loop's."""
    flags = gc_.loom_flags(sz, b, sz.seq, device=accel.device.type)
    times: dict = {"loom": [], "plain": []}
    for _ in range(rounds):
        for arm, run in gc_.ARMS.items():
            times[arm] += run(accel, flags, 3, steps)["step_times_s"]
    med = {arm: statistics.median(t) for arm, t in times.items()}
    return {"mbs": b, "median_step_s": med, "step_times_s": times,
            "loom_over_plain_tokens_per_s": med["plain"] / med["loom"]}


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--sizes", choices=sorted(SIZES), default=None)
    ap.add_argument("--rows", default="b16-none,b16-full,b8-none,b16-selective")
    ap.add_argument("--profile-mbs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--speed", action="store_true",
                    help="also time loom and the plain loop A B A B at --profile-mbs, unprofiled")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sz = SIZES[args.sizes or ("full" if device.type == "cuda" else "tiny")]
    accel = gc_.Accel(device)
    gpu = gc_.planner_gpu(accel.name() if accel.cuda else "")
    res: dict = {"device_name": accel.name(), "gpu": gpu, "torch": torch.__version__,
                 "sizes": dataclasses.asdict(sz), "memory": [],
                 "profile": None}
    b = min(args.profile_mbs, sz.mbs_cap)
    try:
        res["profile"] = profile_arms(accel, sz, b, args.steps)
    except Exception as e:  # noqa: BLE001 - recorded; the memory part still runs
        res["profile"] = {"error": gc_.one_line(e)}
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "top_cpu"}
                      for k, v in (res["profile"] or {}).items() if isinstance(v, dict)},
                     default=str)[:6000])
    if args.speed:
        res["speed"] = speed(accel, sz, b, args.steps)
        print(json.dumps(res["speed"]))
    if accel.cuda:
        for name in [r for r in args.rows.split(",") if r]:
            try:
                row = memory_row(accel, sz, name, gpu)
            except Exception as e:  # noqa: BLE001
                row = {"row": name, "error": gc_.one_line(e)}
            res["memory"].append(row)
            print(json.dumps(row, default=str)[:4000])
    tag = "" if args.sizes in (None, "full" if accel.cuda else "tiny") else f"_{args.sizes}"
    name = f"gpu_profile_{gpu.lower().split('-')[0]}{tag}.json" if accel.cuda else \
        f"gpu_profile_cpu{tag}.json"
    text = json.dumps(res, indent=1, default=str)
    for d in [args.out, str(ROOT / "benchmarks" / "results") if accel.cuda else None]:
        if d:
            Path(d).mkdir(parents=True, exist_ok=True)
            (Path(d) / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
