"""``loom plan --calibrate-from RUNS.jsonl`` (issue 47 item 4): a user's own measured steps fit a
small, named set of the planner's parameters, which then predict every other layout.

A run is one JSON line: ``{"layout": {...}, "step_time_s": T, "peak_memory_gb": M}`` with the
layout in :data:`loom.planner.layout.KEYS` names (``tp``, ``pp``, ``dp``, ``cp``, ``vp``, ``mbs``,
``recompute`` none/selective/full, ``sp``, ``zero``, ``ep``, ...; missing keys take
:func:`~loom.planner.layout.make_layouts`' defaults, ``dp`` is required) and optionally its own
``global_batch_size``, ``seq_length`` and ``num_gpus`` (default: the plan's). ``peak_memory_gb``
(``torch.cuda.max_memory_reserved``, GB = 1e9 bytes) may be left out.

Fitted, each by name (:func:`calibrate`):

* ``gemm_efficiency`` (``e`` of :func:`loom.planner.primitives.gemm_efficiency`: the large-GEMM
  fraction of peak on this cluster) and, from :data:`K_FROM_RUNS` runs on, ``mem_traffic`` (``k`` of
  :mod:`loom.planner.timing`: element-wise HBM traffic per activation byte): least squares of
  ``log(predicted / measured)`` step time (Gauss-Newton on the logs, Levenberg damping).
* ``reserve_bytes`` (:class:`loom.planner.layout.Options`: context, workspaces and allocator
  fragmentation beyond the counted tensors): the median over the runs of measured peak minus the
  counted terms (``(1 + reserve_fraction)`` x weights, gradients, optimizer, activations), >= 0.

Everything else (links, overlap, the layout arithmetic) stays the shipped model.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace

import numpy as np

from loom.config import ConfigError, ModelConfig
from loom.planner.hardware import GB, Cluster
from loom.planner.layout import KEYS, Options, make_layouts
from loom.planner.primitives import GEMM_EFFICIENCY
from loom.planner.timing import MEM_TRAFFIC

PARAMS = ("gemm_efficiency", "mem_traffic")
# k is fitted from this many runs on: with 3 it overfits (the 3-shot protocol on published
# tables, benchmarks/planner_sources/three_shot.py: KOR worst 8% -> 29%, LF-A100 22% -> 24%)
K_FROM_RUNS = 5


def read_runs(path: str) -> list[dict]:
    """The runs of a JSONL file (module docstring); ConfigError naming the line of a bad one."""
    runs = []
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        raise ConfigError(f"--calibrate-from {path}: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--calibrate-from {path}:{n}"
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg})") from None
        lay = r.get("layout") if isinstance(r, dict) else None
        if not isinstance(lay, dict) or "dp" not in lay:
            raise ConfigError(f"{where}: needs \"layout\": {{\"tp\": .., \"pp\": .., \"dp\": .., "
                              f"...}} (dp required)")
        bad = sorted(set(lay) - set(KEYS))
        if bad:
            raise ConfigError(f"{where}: unknown layout key(s) {bad}; known: {', '.join(KEYS)}")
        t = r.get("step_time_s")
        if not isinstance(t, (int, float)) or t <= 0:
            raise ConfigError(f"{where}: needs \"step_time_s\" > 0 (seconds per iteration)")
        runs.append(r)
    if not runs:
        raise ConfigError(f"--calibrate-from {path}: no runs (one JSON line per measured run)")
    return runs


def least_squares(res, x: np.ndarray, iters: int = 40, lam: float = 1e-2,
                  tol: float = 1e-5) -> np.ndarray:
    """``x`` minimizing ``|res(x)|^2`` (``res``: residual vector of the parameters ``x``):
    Levenberg-Marquardt with a forward-difference Jacobian (step 1e-4), the damping divided by 4
    after a step that lowers the loss and multiplied by 4 until one does; stops after ``iters``
    steps, a step below ``tol`` or a damping of 1e8. Shared with the published-table fit
    (benchmarks/planner_sources/fit.py)."""
    r = res(x)
    loss, eye = float(r @ r), np.eye(len(x))
    for _ in range(iters):
        J = np.stack([(res(x + dx) - r) / 1e-4 for dx in eye * 1e-4], axis=1)
        A, g = J.T @ J, J.T @ r
        while lam < 1e8:
            step = -np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), g)
            r2 = res(x + step)
            if float(r2 @ r2) < loss:
                x, r, loss, lam = x + step, r2, float(r2 @ r2), max(lam / 4, 1e-6)
                break
            lam *= 4
        else:
            break
        if np.max(np.abs(step)) < tol:
            break
    return x


def _predict(model: ModelConfig, cluster: Cluster, runs: list[dict], B: int, s: int,
             opts: Options) -> list[dict]:
    """The planner's evaluation of every run (one row each)."""
    from loom.planner.search import evaluate
    out = []
    for r in runs:
        n = int(r.get("num_gpus") or cluster.num_gpus)
        lay = dict(r["layout"])
        cl = replace(cluster, num_gpus=n)
        out.append(evaluate(model, make_layouts([lay]), int(r.get("global_batch_size") or B),
                            int(r.get("seq_length") or s), cl, opts))
    return out


def _with(cluster: Cluster, x: dict) -> Cluster:
    return replace(cluster, **x)


def calibrate(model: ModelConfig, cluster: Cluster, runs: list[dict], global_batch_size: int,
              seq_length: int, opts: Options, iters: int = 30) -> tuple[Cluster, Options, dict]:
    """The cluster and options with the fitted parameters (module docstring) and a report:
    ``fitted`` (name -> (before, after)), ``rows`` (per run: measured, predicted before and
    after, seconds; and memory, GB, when measured), ``median_before`` / ``median_after`` (the
    runs' median absolute step-time error)."""
    names = list(PARAMS[:1] if len(runs) < K_FROM_RUNS else PARAMS)
    start = {"gemm_efficiency": cluster.gemm_efficiency or GEMM_EFFICIENCY,
             "mem_traffic": cluster.mem_traffic or MEM_TRAFFIC}
    meas = np.array([float(r["step_time_s"]) for r in runs])

    def times(x):
        cl = _with(cluster, dict(zip(names, np.exp(x))))
        return np.array([float(e["time_iteration"][0]) for e in
                         _predict(model, cl, runs, global_batch_size, seq_length, opts)])

    def res(x):
        return np.log(times(x) / meas)
    x = least_squares(res, np.log(np.array([start[k] for k in names])), iters)
    fitted = {k: float(v) for k, v in zip(names, np.exp(x))}
    cl = _with(cluster, fitted)
    report = {"fitted": {k: (float(start[k]), fitted[k]) for k in names}}
    after = _predict(model, cl, runs, global_batch_size, seq_length, opts)
    new_opts = opts
    mem_runs = [(i, float(r["peak_memory_gb"]) * GB) for i, r in enumerate(runs)
                if isinstance(r.get("peak_memory_gb"), (int, float))]
    if mem_runs:
        counted = [float(after[i]["mem_total"][0] - after[i]["mem_reserve"][0]) for i, _ in mem_runs]
        extra = [m - (1 + opts.reserve_fraction) * c for (_, m), c in zip(mem_runs, counted)]
        reserve = max(0.0, statistics.median(extra))
        report["fitted"]["reserve_bytes"] = (opts.reserve_bytes, reserve)
        new_opts = replace(opts, reserve_bytes=reserve)
        after = _predict(model, cl, runs, global_batch_size, seq_length, new_opts)
    before = _predict(model, cluster, runs, global_batch_size, seq_length, opts)
    rows = []
    for r, b, a in zip(runs, before, after):
        row = dict(layout=r["layout"], step_time_s=float(r["step_time_s"]),
                   predicted_before_s=float(b["time_iteration"][0]),
                   predicted_after_s=float(a["time_iteration"][0]))
        if isinstance(r.get("peak_memory_gb"), (int, float)):
            row.update(peak_memory_gb=float(r["peak_memory_gb"]),
                       memory_before_gb=float(b["mem_total"][0] / GB),
                       memory_after_gb=float(a["mem_total"][0] / GB))
        rows.append(row)
    report["rows"] = rows
    for when in ("before", "after"):
        report[f"median_{when}"] = statistics.median(
            abs(row[f"predicted_{when}_s"] / row["step_time_s"] - 1) for row in rows)
    return cl, new_opts, report


def format_report(report: dict, path: str) -> list[str]:
    """Lines for ``loom plan``'s text output."""
    f = report["fitted"]
    parts = [f"{k} {a:.4g} -> {b:.4g}" if k != "reserve_bytes" else
             f"reserve {a / GB:.3g} -> {b / GB:.3g} GB" for k, (a, b) in f.items()]
    lines = [f"calibrated from {len(report['rows'])} runs of {path}: " + ", ".join(parts)
             + f"; step time error median {100 * report['median_before']:.1f}% -> "
               f"{100 * report['median_after']:.1f}%"]
    if any(not math.isfinite(row["predicted_after_s"]) for row in report["rows"]):
        lines.append("  (some runs could not be predicted: check their layouts)")
    return lines
