"""``loom plan --calibrate-from RUNS.jsonl`` (issue 47 item 4): a user's own measured steps fit a
small, named set of the planner's parameters, which then predict every other layout.

A run is one JSON line: ``{"layout": {...}, "step_time_s": T, "peak_memory_gb": M}`` with the
layout in :data:`loom.planner.layout.KEYS` names (``tp``, ``pp``, ``dp``, ``cp``, ``vp``, ``mbs``,
``recompute`` none/selective/full, ``sp``, ``zero``, ``ep``, ...; missing keys take
:func:`~loom.planner.layout.make_layouts`' defaults, ``dp`` is required) and optionally its own
``global_batch_size``, ``seq_length`` and ``num_gpus`` (default: the plan's). ``peak_memory_gb``
(``torch.cuda.max_memory_reserved``, GB = 1e9 bytes) may be left out. Or ``loom train``'s own
``--log-json`` file: :mod:`loom.planner.measured_runs` reads both.

Fitted, each by name (:func:`calibrate`):

* ``gemm_efficiency`` (``e`` of :func:`loom.planner.primitives.gemm_efficiency`: the large-GEMM
  fraction of peak on this cluster) and ``mem_traffic`` (``k`` of :mod:`loom.planner.timing`:
  element-wise HBM traffic per activation byte), in that order (:data:`PARAMS`: k only with e):
  least squares of ``log(predicted / measured)`` step time (Levenberg-Marquardt on the logs,
  :func:`least_squares`), **how many of them chosen by leave-one-out cross-validation over the
  runs** (:func:`select_fit`). The candidates (:func:`candidates`) are the nested models "none"
  (the shipped constants), "e", "e and k", each with at most ``n - 1`` parameters for ``n`` runs
  (every leave-one-out fit then has at least as many runs as parameters). Each candidate is
  refitted ``n`` times, each time without one run, and scored by the mean squared log error of
  the left-out run's prediction (the PRESS statistic, Allen 1974; model choice by leave-one-out
  cross-validation, Stone 1974; Hastie, Tibshirani & Friedman, "The Elements of Statistical
  Learning", 2nd ed., sec. 7.10). The smallest score wins; a tie (within :data:`LOO_TIE`) keeps
  fewer parameters, then the compute chain. So a calibration is kept only where it predicts runs
  it was not fitted on better than the shipped constants do: a parameter the runs cannot pin
  down, or a fit that follows one unusual run, predicts the left-out runs worse and is not chosen
  ("none" keeps the shipped values). When the runs determine the parameters (noise-free, more
  runs than parameters) the full model's score is ~0, it is chosen, and its fit is plain least
  squares: nothing is shrunk. One run cannot be cross-validated: it fits e alone. Bounds
  (:data:`BOUNDS`): e at most 1 (peak).
* Not among the default candidates (:data:`FREE` is empty), on the same code path when asked
  for (``free=NETWORK``, :func:`calibrate`'s ``free``; the 3-shot protocol's ``--network``): the
  network's ``dp_net_efficiency`` (:data:`NETWORK`; :attr:`loom.planner.hardware.Cluster.
  dp_net_efficiency`: the fraction of the inter-node bandwidth the data-parallel collectives
  get, <= 1, so it moves only runs whose DP or ZeRO-3 traffic crosses nodes), each compute
  candidate without and with it (3 runs: none, e, net, e+k, e+net). On the published tables'
  3-shot protocol it helped MegaScale (2.8% -> 1.4%) but, over 20 choices of 3 rows, gave
  worst choices of 369% (NAR t2), 88% (LF-H100) and 39% (SHO), where an overlapped or ZeRO-3
  collective crosses from hidden to exposed: docs/planner.md, "3-shot calibration".
* ``reserve_bytes`` (:class:`loom.planner.layout.Options`: context, workspaces and allocator
  fragmentation beyond the counted tensors): the median over the runs of measured peak minus the
  counted terms (``(1 + reserve_fraction)`` x weights, gradients, optimizer, activations), >= 0.

The same :func:`select_fit` serves the 3-shot protocol on the published tables
(``benchmarks/planner_sources/three_shot.py``).

Everything else (the links' bandwidths and latencies outside the DP collectives, overlap, the
layout arithmetic) stays the shipped model.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import replace

import numpy as np

from loom.config import ConfigError, ModelConfig
from loom.planner.hardware import GB, Cluster
from loom.planner.layout import Options, make_layouts
from loom.planner.primitives import GEMM_EFFICIENCY
from loom.planner.timing import MEM_TRAFFIC

PARAMS = ("gemm_efficiency", "mem_traffic")  # the compute chain: k only with e
NETWORK = ("dp_net_efficiency",)  # fitted with or without any of the chain, when asked for
FREE = ()  # the default: no network parameter (tried, worse over any 3 rows: module docstring)
# Where a fitted parameter may go (its log is clipped): a GEMM runs at most at peak (e <= 1) and
# above 5% of it; k from 0.1 (less traffic than one read per activation byte: everything fused)
# to 100; the DP collectives get at most the whole inter-node link (dp_net_efficiency <= 1: the
# shipped inter_bw is already the achieved, nccl-tests-style figure) and at least 5% of it.
# The bounds stop a fit of as many parameters as runs from running off to 0 or infinity.
BOUNDS = {"gemm_efficiency": (0.05, 1.0), "mem_traffic": (0.1, 100.0),
          "dp_net_efficiency": (0.05, 1.0)}
BAD_RESIDUAL = 1e3  # log error standing in for a prediction that is not finite (rejects a step)
LOO_TIE = 1e-9  # leave-one-out scores this close (mean squared log error) are a tie


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


def candidates(n: int, order=PARAMS, free=(), sizes=None) -> list[tuple[str, ...]]:
    """The parameter sets :func:`select_fit` chooses among for ``n`` runs: every prefix of the
    chain ``order`` (none, e, e+k: k is fitted only with e), each without and with the
    parameters ``free`` (a network parameter, :data:`NETWORK`: independent of the compute chain),
    at most ``n - 1`` parameters; ordered by size, then chain first (the order a tie resolves
    in). One run: ``order[0]`` alone. ``sizes``: keep only candidates of these sizes."""
    if n == 1:
        return [tuple(order[:1])]
    out = []
    for m in range(len(order) + 1):
        for j in range(len(free) + 1):
            for extra in itertools.combinations(free, j):
                c = tuple(order[:m]) + extra
                if len(c) <= n - 1 and (sizes is None or len(c) in sizes):
                    out.append(c)
    return sorted(out, key=lambda c: (len(c), len(set(c) & set(free))))  # chain first


def label(names) -> str:
    """A candidate's name in reports: ``"none"`` or its parameters joined by ``+``."""
    return "+".join(names) or "none"


def select_fit(log_errors, start: dict, order=PARAMS, iters: int = 30, sizes=None,
               bounds=None, free=()) -> dict:
    """Fit one of :func:`candidates` (the prefixes of ``order``, each without and with
    ``free``) to ``n`` runs, chosen by leave-one-out cross-validation (the rule and its sources:
    module docstring).

    ``log_errors(values)`` -> array ``(n,)`` of ``log(predicted / measured)`` per run, given
    ``values`` (name -> value, every name of ``start``); a run not finite at ``start`` takes no
    part, a non-finite value elsewhere counts as :data:`BAD_RESIDUAL`. ``start``: the shipped
    value of every name of ``order`` and ``free``. ``sizes``: keep only candidates with these
    numbers of parameters (a single candidate skips the cross-validation; one run: ``order[0]``
    alone). Parameters are fitted on their logs (:func:`least_squares`, ``iters`` steps,
    stopping at a step below 1e-4), each clipped to ``bounds[name]`` (default :data:`BOUNDS`; a
    name not in it is not clipped).

    Returns ``names`` (the chosen ones), ``values`` (``start`` with them fitted), ``loo``
    (:func:`label` of each candidate -> the mean squared log error of the left-out runs; empty
    when not cross-validated), ``runs`` (indices of the runs that took part)."""
    names_all = tuple(order) + tuple(free)
    start = {k: float(start[k]) for k in names_all}
    bounds = BOUNDS if bounds is None else bounds
    lim = {k: np.log([bounds.get(k, (0.0, math.inf))[j] or 1e-300 for j in (0, 1)])
           for k in names_all}
    memo: dict = {}

    def clip(names, x):
        return np.clip(x, [lim[k][0] for k in names], [lim[k][1] for k in names])

    def errs(names, x):
        x = clip(names, x)
        key = (names, tuple(np.round(x, 12)))
        if key not in memo:
            r = np.asarray(log_errors({**start, **dict(zip(names, map(float, np.exp(x))))}),
                           dtype=float)
            memo[key] = np.where(np.isfinite(r), r, BAD_RESIDUAL)
        return memo[key]

    r0 = np.asarray(log_errors(dict(start)), dtype=float)
    used = np.flatnonzero(np.isfinite(r0))
    n = len(used)
    cands = candidates(max(n, 1), order, free, sizes)

    def fit(names, rows):
        x0 = np.log([start[k] for k in names])
        if not names or not len(rows):
            return names, x0
        # a start on its bound (the network fraction's shipped 1.0) would see a zero forward-
        # difference derivative (the step is clipped away): start 2 steps inside
        x0 = np.clip(x0, [lim[k][0] + 2e-4 for k in names], [lim[k][1] - 2e-4 for k in names])
        return names, least_squares(lambda x: errs(names, x)[rows], x0, iters, tol=1e-4)

    loo = {}
    if len(cands) > 1:
        for c in cands:
            loo[c] = float(np.mean([errs(*fit(c, used[used != i]))[i] ** 2 for i in used]))
    best = min(loo.values(), default=0.0)
    # a tie keeps fewer parameters (cands is ordered by size)
    names = next(c for c in cands if loo.get(c, 0.0) <= best + LOO_TIE)
    names, x = fit(names, used)
    x = clip(names, x)
    return dict(names=names, values={**start, **dict(zip(names, map(float, np.exp(x))))},
                loo={label(c): v for c, v in loo.items()}, runs=[int(i) for i in used])


def _predict(model: ModelConfig, cluster: Cluster, runs: list[dict], B: int, s: int,
             opts: Options) -> list[dict]:
    """The planner's evaluation of every run (one row each: arrays of length 1), under the
    run's own ``options`` where it has them (a logged run, :data:`RUN_OPTIONS`); runs with the
    same GPU count, global batch, sequence length and options are evaluated together, as the
    search evaluates its layouts."""
    from loom.planner.search import evaluate
    groups: dict = {}
    for i, r in enumerate(runs):
        key = (int(r.get("num_gpus") or cluster.num_gpus), int(r.get("global_batch_size") or B),
               int(r.get("seq_length") or s), tuple(sorted((r.get("options") or {}).items())))
        groups.setdefault(key, []).append(i)
    out: list = [None] * len(runs)
    for (n, b, sq, own), idx in groups.items():
        e = evaluate(model, make_layouts([dict(runs[i]["layout"]) for i in idx]), b, sq,
                     replace(cluster, num_gpus=n), replace(opts, **dict(own)))
        for j, i in enumerate(idx):
            out[i] = {k: (v[j:j + 1] if isinstance(v, np.ndarray) and v.ndim and
                          len(v) == len(idx) else v) for k, v in e.items()}
    return out


def _with(cluster: Cluster, x: dict) -> Cluster:
    return replace(cluster, **x)


def calibrate(model: ModelConfig, cluster: Cluster, runs: list[dict], global_batch_size: int,
              seq_length: int, opts: Options, iters: int = 30,
              free=FREE) -> tuple[Cluster, Options, dict]:
    """The cluster and options with the fitted parameters (module docstring; ``free``: the
    parameters :func:`select_fit` may add to each compute candidate, :data:`NETWORK` or the
    default none) and a report:
    ``fitted`` (name -> (before, after)), ``kept`` (name -> shipped value: the parameters
    :func:`select_fit` left out), ``loo`` (candidate, e.g. ``"none"``, ``"gemm_efficiency"``,
    ``"dp_net_efficiency"``, ``"gemm_efficiency+mem_traffic"`` -> mean squared leave-one-out log
    error), ``rows`` (per
    run: measured, predicted before and
    after, seconds; and memory, GB, when measured), ``median_before`` / ``median_after`` (the
    runs' median absolute step-time error)."""
    for r in runs:  # a logged run carries its model: it must be the planned one
        for k, v in (r.get("model_shape") or {}).items():
            if getattr(model, k) != v:
                raise ConfigError(f"{r.get('source', '--calibrate-from')}: its model has {k} "
                                  f"{v}, the plan's {getattr(model, k)}: calibrate with runs "
                                  f"of the planned model")
    start = {"gemm_efficiency": cluster.gemm_efficiency or GEMM_EFFICIENCY,
             "mem_traffic": cluster.mem_traffic or MEM_TRAFFIC,
             "dp_net_efficiency": cluster.dp_net_efficiency}
    meas = np.array([float(r["step_time_s"]) for r in runs])

    def log_errors(values):
        t = [float(e["time_iteration"][0]) for e in
             _predict(model, _with(cluster, values), runs, global_batch_size, seq_length, opts)]
        return np.log(np.array(t) / meas)
    sel = select_fit(log_errors, start, PARAMS, iters, free=tuple(free))
    fitted = {k: sel["values"][k] for k in sel["names"]}
    cl = _with(cluster, fitted)
    report = {"fitted": {k: (float(start[k]), fitted[k]) for k in sel["names"]},
              "kept": {k: float(start[k]) for k in PARAMS + tuple(free)
                       if k not in sel["names"]},
              "loo": sel["loo"]}
    after = _predict(model, cl, runs, global_batch_size, seq_length, opts)
    new_opts = opts
    mem_runs = [(i, float(r["peak_memory_gb"]) * GB) for i, r in enumerate(runs)
                if isinstance(r.get("peak_memory_gb"), (int, float))]
    if mem_runs:
        counted = [float(after[i]["mem_total"][0] - after[i]["mem_reserve"][0])
                   for i, _ in mem_runs]
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
    lines = [f"calibrated from {len(report['rows'])} runs of {path}: "
             + (", ".join(parts) or "nothing fitted")
             + f"; step time error median {100 * report['median_before']:.1f}% -> "
               f"{100 * report['median_after']:.1f}%"]
    if report.get("loo"):
        kept = ", ".join(f"{k} {v:.4g}" for k, v in report.get("kept", {}).items())
        lines.append("  chosen by leave-one-out over the runs (rms log error of the left-out "
                     "run: " + ", ".join(f"{k} {100 * math.sqrt(v):.2g}%"
                                          for k, v in report["loo"].items())
                     + ")" + (f"; kept at the shipped value: {kept}" if kept else ""))
    if any(not math.isfinite(row["predicted_after_s"]) for row in report["rows"]):
        lines.append("  (some runs could not be predicted: check their layouts)")
    return lines
