"""Refit the planner's constants from the published tables, and test them out of sample.

Sources (:data:`SOURCES`; tables in :mod:`loom.planner.presets` and
:mod:`benchmarks.planner_sources.validation`, copied from the papers), each compared on its published quantity:

* ``NAR t1``: NAR table 1, hardware TFLOP/s per GPU (10 rows).
* ``NAR t2``: NAR table 2, days for 300B tokens (6 ZeRO-3 + 6 PTD-P rows).
* ``KOR``: KOR table 3 iteration seconds (8) and KOR table 4 per-layer ms (10).
* ``SHO``: SHO table 1 weak-scaling efficiencies (ratios; 7: the 1-GPU 1.2B run is the unit).
* ``MC-H100 weak``: Megatron-Core r0.8.0 H100 weak scaling, model TFLOP/s per GPU (9 rows).
* ``MC-H100 strong``: Megatron-LM README strong scaling, MFU on 96 and 4608 H100 (2 rows).
* ``BLOOM``: BLOOM 176B, hardware TFLOP/s per GPU ("about 150", 1 row).
* ``OPT``: OPT-175B, hardware TFLOP/s per GPU ("up to 147", 1 row; metaseq's layout).
* ``TT``, ``LF-H100``, ``LF-A100``, ``Llama 3``: torchtitan, llm-foundry (H100, A100) and the
  Llama 3 paper (:mod:`benchmarks.planner_sources.published`: tokens/s per GPU; Llama 3: model TFLOP/s).
* ``MegaScale``: MegaScale's Megatron-LM baseline, 175B on 256-12,288 A100, MFU (8 rows;
  :mod:`benchmarks.planner_sources.megascale`).
* ``loom H200``: loom itself measured by ``make gpu-check`` on one H200, step seconds (5 rows:
  micro-batch, recompute, sequence length; :mod:`benchmarks.planner_sources.loom_gpu`).
* ``loom H200 shapes``: the same command at two shapes measured after that source's rows had
  been studied (10 rows: Llama 3 8B's layer at 4 layers, V 128256; 24 layers of h 1024, V 50304;
  :func:`benchmarks.planner_sources.loom_gpu.shape_points`).
* ``DGX-C``: NVIDIA's DGX Cloud benchmarking recipes, NeMo 24.09 / 24.11 on 8-2,304 H100, step
  seconds (35 rows: Llama 3.1 8B / 70B / 405B, Nemotron-4 15B / 340B, GPT-3 175B, weak scaling;
  :mod:`benchmarks.planner_sources.dgxc`).

The fit (:func:`fit`) follows :data:`loom.planner.constants.FIT_SETS`, in order:

1. ``compute`` (e, h0, k and the Hopper e): one least-squares problem, the mean squared
   ``log(pred / pub)`` over every row of NAR t1, KOR and MC-H100 weak (37 numbers;
   Levenberg-Marquardt on the logs of the constants, forward-difference Jacobian). The H100 rows
   constrain h0 too, since H100's h0 is the A100 h0 scaled by the ridge point (alone, the A100
   rows barely do: their rms log error moves 0.6% between h0 = 5 and 50).
1b. Only when no H100 source is left in 1 (MC-H100 held out): ``hopper_gemm_efficiency``
   alone, least squares over the other H100 sources (:data:`loom.planner.constants.
   FALLBACK_SETS`: TT, LF-H100, Llama 3) given the A100 constants of 1 (:func:`fit_hopper`).
2. ``zero3``: minimax of ``|log(days / pub)|`` over NAR t2's ZeRO-3 rows, given 1: grid 0-1 by
   0.01, then +-0.01 by 0.001.

:func:`leave_one_source_out` removes one source from every fit set, refits (a group left with no
rows takes its prior, :data:`loom.planner.constants.PRIORS`) and predicts the removed source:
the only errors here that measure prediction. Sources in no fit set (SHO, MC-H100 strong,
BLOOM, OPT, MegaScale, loom H200 (and its shapes), DGX-C, NAR t2's PTD-P rows) are held out in every fit; MC-H100 strong shares the Hopper
constant, the 177B shape and the README with MC-H100 weak, so the two are also held out
together. Cost: ~1-4 s per fit on one core, ~12 s for the whole protocol.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, replace

import numpy as np

from loom.planner.calibrate_runs import least_squares
from loom.planner.constants import FALLBACK_SETS, FIT_SETS, PRIORS, SHIPPED, Constants
from benchmarks.planner_sources import published as P
from benchmarks.planner_sources import validation as V
from benchmarks.planner_sources.loom_gpu import SHAPES_SOURCE as LOOM_SHAPES
from benchmarks.planner_sources.loom_gpu import SOURCE as LOOM_GPU, loom_gpu_points, shape_points
from benchmarks.planner_sources.dgxc import SOURCE as DGXC, dgxc_points
from benchmarks.planner_sources.megascale import megascale_points

SOURCES = ("NAR t1", "NAR t2", "KOR", "SHO", "MC-H100 weak", "MC-H100 strong", "BLOOM", "OPT",
           "TT", "LF-H100", "LF-A100", "Llama 3", "MegaScale", "loom H200", LOOM_SHAPES, DGXC)
H100_SOURCES = ("MC-H100 weak", "MC-H100 strong")
COMPUTE_PARAMS = ("gemm_efficiency", "gemm_half_dim", "mem_traffic")
COMPUTE_START = (0.7, 50.0, 2.0)  # e, h0, k (and Hopper e = 0.7): round numbers, not the fit
ZERO3_RANGE = (0.0, 1.0)
HOLDOUTS = tuple((s,) for s in SOURCES) + (H100_SOURCES,)


def source_points(source: str, c: Constants | None = None) -> list[tuple]:
    """``(name, predicted, published)`` of every row of ``source`` with constants ``c``."""
    if source == "NAR t1":
        return V.nar_table1_points(c)
    if source == "KOR":
        return V.kor_points(c)
    if source == "NAR t2":
        return [(f"NAR t2 {r['scheme']} {r['params_b']}B {r['gpus']} days", r["days"],
                 r["published_days"]) for r in V.nar_table2(c)]
    if source == "SHO":
        out = []
        for i, r in enumerate(V.sho_weak_scaling(constants=c)):
            if i:  # the 1.2B MP row is the unit of every ratio
                out.append((f"SHO {r['params_b']}B MP", r["pred_mp"], r["published_mp"]))
            out.append((f"SHO {r['params_b']}B MPxDP", r["pred_mp_dp"], r["published_mp_dp"]))
        return out
    if source == "MC-H100 weak":
        return [(f"MC-H100 {r['params_b']}B TFLOP/s", r["tflops"], r["published_tflops"])
                for r in V.mcore_h100(c)]
    if source == "MC-H100 strong":
        return [(f"MC-H100 177B {r['gpus']} GPUs MFU", r["mfu"], r["published_mfu"])
                for r in V.mcore_h100_strong(c)]
    if source == "BLOOM":
        b = V.bloom_176b(c)
        return [("BLOOM 176B hw TFLOP/s", b["hw_tflops"], b["published_tflops"])]
    if source == "OPT":
        o = V.opt_175b(c)
        return [("OPT-175B hw TFLOP/s", o["hw_tflops"], o["published_tflops"])]
    if source == "TT":
        return P.torchtitan_points(c)
    if source in ("LF-H100", "LF-A100"):
        return P.llm_foundry_points(source[3:], c)
    if source == "Llama 3":
        return P.llama3_points(c)
    if source == "MegaScale":
        return megascale_points(c)
    if source == LOOM_GPU:
        return loom_gpu_points(c)
    if source == LOOM_SHAPES:
        return shape_points(c)
    if source == DGXC:
        return dgxc_points(c)
    raise ValueError(f"unknown source {source!r}; one of {SOURCES}")


def _log_residuals(sources, c: Constants) -> np.ndarray:
    pts = [p for s in sources for p in source_points(s, c)]
    return np.array([math.log(pred / pub) for _, pred, pub in pts if pred == pred])


def fit_compute(sources, start=COMPUTE_START, iters: int = 40) -> Constants:
    """The compute constants minimizing the mean squared log error over ``sources`` (one
    least-squares problem for all their rows, see the module docstring): ``gemm_efficiency``,
    ``gemm_half_dim``, ``mem_traffic`` and, when an H100 source is among them,
    ``hopper_gemm_efficiency`` (else its prior, the fitted ``gemm_efficiency``). Others
    shipped."""
    names = list(COMPUTE_PARAMS) + (["hopper_gemm_efficiency"]
                                    if any(s in H100_SOURCES for s in sources) else [])
    x0 = list(start) + [start[0]] * (len(names) - 3)

    def const(x):
        c = replace(SHIPPED, **dict(zip(names, map(float, np.exp(x)))))
        return c if "hopper_gemm_efficiency" in names else \
            replace(c, hopper_gemm_efficiency=c.gemm_efficiency)

    def res(x):
        return _log_residuals(sources, const(x))
    return const(least_squares(res, np.log(np.asarray(x0, dtype=np.float64)), iters))


def _grid_fit(loss, lo: float, hi: float) -> float:
    """Argmin of ``loss`` on ``lo..hi`` by 0.01, then within +-0.01 of it by 0.001."""
    coarse = np.round(np.arange(lo, hi + 1e-9, 0.01), 6)
    best = min(coarse, key=loss)
    fine = np.round(np.arange(best - 0.01, best + 0.01 + 1e-9, 0.001), 6)
    return float(min((x for x in fine if lo <= x <= hi), key=loss))


def fit_hopper(c: Constants, sources) -> float:
    """``hopper_gemm_efficiency`` minimizing the mean squared log error over ``sources`` (H100
    sources outside the compute fit, :data:`loom.planner.constants.FALLBACK_SETS`), the other
    constants held at ``c``: grid 0.3-0.95 by 0.01, then +-0.01 by 0.001."""
    def loss(e):
        return float(np.mean(np.square(_log_residuals(
            sources, replace(c, hopper_gemm_efficiency=float(e))))))
    return _grid_fit(loss, 0.3, 0.95)


def fit_zero3(c: Constants) -> float:
    """``zero3_overlap`` minimizing the largest |log error| of NAR table 2's ZeRO-3 days."""
    def loss(ov):
        rows = V.nar_table2(replace(c, zero3_overlap=float(ov)), schemes=("ZeRO-3",))
        return max(abs(math.log(r["days"] / r["published_days"])) for r in rows)
    return _grid_fit(loss, *ZERO3_RANGE)


def fit(exclude=(), _cache=None) -> tuple[Constants, dict]:
    """All constants refitted without the sources in ``exclude``; returns ``(constants,
    provenance)``: per group of :data:`loom.planner.constants.FIT_SETS`, the sources it was
    fitted on, or ``"prior"`` (:data:`loom.planner.constants.PRIORS`). ``_cache``: a dict
    reused across calls of one :func:`leave_one_source_out` (fits keyed by their sources)."""
    cache = {} if _cache is None else _cache
    used = {g: tuple(s for s in srcs if s not in set(exclude)) for g, srcs in FIT_SETS.items()}
    key = ("compute",) + used["compute"]
    if key not in cache:
        cache[key] = fit_compute(used["compute"])
    c = cache[key]
    hopper_from = None
    if not any(s in H100_SOURCES for s in used["compute"]):
        hopper_from = tuple(s for s in FALLBACK_SETS["hopper_gemm_efficiency"]
                            if s not in set(exclude))
        key = ("hopper", c) + hopper_from
        if hopper_from and key not in cache:
            cache[key] = fit_hopper(c, hopper_from)
        if hopper_from:
            c = replace(c, hopper_gemm_efficiency=cache[key])
    key = ("zero3", c) + used["zero3"]
    if key not in cache:
        cache[key] = fit_zero3(c) if used["zero3"] else PRIORS["zero3_overlap"]
    c = replace(c, zero3_overlap=cache[key])
    prov = {g: (s if s else "prior") for g, s in used.items()}
    if hopper_from is not None:
        prov["hopper"] = hopper_from or "prior"
    return c, prov


def errors(points) -> dict:
    """``n``, ``median`` and ``worst`` absolute relative error ``|pred / pub - 1|`` and the
    per-row signed errors (``rows``) of ``(name, pred, pub)`` points."""
    rows = {name: pred / pub - 1 for name, pred, pub in points}
    a = [abs(v) for v in rows.values()]
    return dict(n=len(a), median=statistics.median(a), worst=max(a), rows=rows)


def leave_one_source_out(holdouts=HOLDOUTS) -> dict:
    """Per held-out set (:data:`HOLDOUTS`: each source alone, and the two Megatron-Core H100
    tables together, one README): the constants refitted without it and its rows' errors
    predicted with them (``heldout``), next to the in-sample errors of the all-sources fit
    (``in_sample``: how well the curve fits, not how well it predicts). ``overall``: pooled
    over the held-out rows of the single sources."""
    cache: dict = {}
    full, _ = fit(_cache=cache)
    fitted = {s for srcs in FIT_SETS.values() for s in srcs}
    out = {"all_sources_fit": asdict(full), "sources": {}}
    pooled = []
    for held in holdouts:
        c, prov = fit(exclude=held, _cache=cache)
        pts = [p for s in held for p in source_points(s, c)]
        err = errors(pts)
        if len(held) == 1:
            pooled += [abs(v) for v in err["rows"].values()]
        out["sources"][" + ".join(held)] = dict(
            constants=asdict(c), fitted_on=prov, heldout=err,
            in_sample=errors([p for s in held for p in source_points(s, full)]),
            ever_fitted=any(s in fitted for s in held))
    out["overall"] = dict(n=len(pooled), median=statistics.median(pooled), worst=max(pooled))
    return out
