"""loom's own runs on one NVIDIA H200 as a planner source (issue 47 item 5): ``loom H200``.

Provenance (:data:`CITATION`): ``make gpu-check`` (``benchmarks/gpu_check.py``, part ``rows``)
on one NVIDIA H200 (141 GB HBM3e), torch 2.11.0+cu130, CUDA 13.0, first 2026-11-28 (loom at
c1ba84f, results in 13c9b3c), re-measured 2026-11-30 after the fused loss's fp32-output GEMMs
and 4096-token chunks (within 1.6% of the first run's steps). The rows are :data:`RUNS`, one JSON object per line in the format of
``benchmarks/gpu_check.py``'s docstring. ``gpu_check_h200_3c0d7a8.json`` is an older run (a
Trainer leak inflated its peaks, a gradient-norm host hot spot slowed its steps; both fixed) and
is not this source.

The model: LLaMA-style, 1.10B parameters (16 layers, h 2048, 16 heads, 4 KV groups, SwiGLU FFN
8192, V 32000, untied), bf16, eager (no ``--compile``), one GPU, one micro-batch per step; the
five rows are micro-batch 16 and 8 at s 2048 without recompute, 16 with selective and with full
recompute, and 8 at s 4096. Each row's measured step is the median of 8 steps after warm-up.

The quantity compared, as for every source of :mod:`benchmarks.planner_sources.fit`: the step
time in seconds, ``|predicted / measured - 1|``, predicted by the *current* planner through the
call gpu_check makes (:func:`benchmarks.gpu_check.predict`, i.e.
:func:`loom.planner.predict.predict_layout` on the H200 row of :mod:`loom.planner.hardware`) so
the errors follow the planner as it changes; with other constants (a refit, a 3-shot
calibration) the same ``predict_layout`` on :func:`loom.planner.constants.fitted_cluster`.

Protocol (rule stated before its result was computed; docs/planner.md, "loom on an H200"): the
source is in no fit set, so it is held out of every fit (the shipped constants and every other
source's numbers are unchanged by it) and its leave-one-source-out error is the planner's error
with the fitted constants; it joins the 3-shot protocol (:mod:`benchmarks.planner_sources.
three_shot`) with 5 rows. The source :data:`SHAPES_SOURCE` (:func:`shape_points`) is the same
command at two more shapes (``--sizes wide`` and ``small``), held out the same way. Memory is reported beside it (:func:`memory_rows`), not in those
time protocols: peak allocated against the prediction less its reserve, peak reserved against
the prediction with it.

    OMP_NUM_THREADS=1 python -m benchmarks.planner_sources.loom_gpu   # the docs tables, ~2 s
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from loom.planner.constants import Constants

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = RESULTS / "gpu_check_h200_runs.jsonl"
# held-out shapes (gpu_check --sizes wide / small): their row names carry the shape's name
HELD_OUT = {"wide": RESULTS / "gpu_check_h200_wide_runs.jsonl",
            "small": RESULTS / "gpu_check_h200_small_runs.jsonl"}
PROFILE = ROOT / "benchmarks" / "results" / "gpu_profile_h200.json"
SOURCE = "loom H200"
# the same command at two shapes no planner change has looked at before it was measured
# (2026-11-30): Llama 3 8B's layer at 4 layers (V 128256) and 24 layers of h 1024 (V 50304)
SHAPES_SOURCE = "loom H200 shapes"
CITATION = dict(command="make gpu-check; python3 -m benchmarks.gpu_check --sizes wide|small "
                "--parts speed,rows", device="NVIDIA H200", torch="2.11.0+cu130",
                cuda="13.0", date="2026-11-30",
                commit="the fused loss's fp32-output GEMMs and 4096-token chunks (this file's "
                "commit)", file="benchmarks/results/gpu_check_h200{,_wide,_small}_runs.jsonl")


def _read(path: Path, prefix: str = "") -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [dict(r, name=prefix + r["name"]) for r in rows if r["status"] == "ok"]


def load_rows(path: Path = RUNS) -> list[dict]:
    """The measured rows (``status == "ok"``) of a gpu_check ``_runs.jsonl``, in file order."""
    return _read(path)


def load_shape_rows() -> list[dict]:
    """The rows of the held-out shapes (:data:`HELD_OUT`), named ``"wide b8 s2048 none"`` etc.:
    the source :data:`SHAPES_SOURCE`."""
    return [r for shape, f in HELD_OUT.items() for r in _read(f, f"{shape} ")]


def config_of(row: dict):
    """The run's :class:`loom.config.LoomConfig`, rebuilt from its flat flags."""
    from loom.config import LoomConfig
    return LoomConfig.from_flat(row["config"]).validate(row["world_size"])


def predict_row(row: dict, c: Constants | None = None) -> dict:
    """The planner's prediction of ``row`` (:func:`loom.planner.predict.predict_layout`'s dict).
    ``c`` None: gpu_check's own call with the shipped constants; else the same prediction on a
    one-GPU cluster carrying ``c``."""
    if c is None:
        from benchmarks.gpu_check import predict
        return predict(row["config"], row["gpu"])
    from loom.planner.constants import fitted_cluster
    from loom.planner.predict import predict_layout
    return predict_layout(config_of(row), row["world_size"],
                          cluster=fitted_cluster(row["gpu"], row["world_size"], c,
                                                 gpus_per_node=1))


def shape_points(c: Constants | None = None) -> list[tuple]:
    """``(name, predicted, measured)`` step seconds of the held-out shapes' rows
    (:func:`load_shape_rows`): the source :data:`SHAPES_SOURCE`."""
    return loom_gpu_points(c, load_shape_rows())


def loom_gpu_points(c: Constants | None = None, rows: list[dict] | None = None) -> list[tuple]:
    """``(name, predicted, measured)`` step seconds of every row (:func:`load_rows`)."""
    return [(f"loom H200 {r['name']} step s", predict_row(r, c)["time_s"]["iteration"],
             r["measured"]["step_time_s"]) for r in (rows or load_rows())]


def memory_rows(rows: list[dict] | None = None) -> list[dict]:
    """Per row, bytes: ``allocated`` (measured ``max_memory_allocated``) against ``predicted``
    (the planner's total less its reserve) and ``reserved`` (``max_memory_reserved``) against
    ``predicted_total`` (with the reserve), and the signed errors ``pred / measured - 1``."""
    out = []
    for r in rows or load_rows():
        mem = predict_row(r)["memory_bytes"]
        m = r["measured"]
        less = mem["total"] - mem["reserve"]
        out.append(dict(name=r["name"], allocated=m["peak_allocated_bytes"], predicted=less,
                        allocated_error=less / m["peak_allocated_bytes"] - 1,
                        reserved=m["peak_reserved_bytes"], predicted_total=mem["total"],
                        reserved_error=mem["total"] / m["peak_reserved_bytes"] - 1))
    return out


def summary(values) -> dict:
    """``median`` and ``worst`` of the absolute values, and the signed ``min``/``max``."""
    a = [abs(v) for v in values]
    return dict(n=len(a), median=statistics.median(a), worst=max(a), min=min(values),
                max=max(values))


def step_fit(rows: list[dict] | None = None) -> dict:
    """The step as ``a x b + c`` through the two s-2048 no-recompute rows (b 16 and 8), measured
    and predicted: ``per_sequence`` a and ``fixed`` c, seconds."""
    by = {r["name"]: r for r in rows or load_rows()}
    big, small = by["b16 s2048 none"], by["b8 s2048 none"]
    out = {}
    for side, get in (("measured", lambda r: r["measured"]["step_time_s"]),
                      ("predicted", lambda r: predict_row(r)["time_s"]["iteration"])):
        a = (get(big) - get(small)) / 8
        out[side] = dict(per_sequence=a, fixed=get(small) - 8 * a)
    return out


def deltas(rows: list[dict] | None = None) -> dict:
    """What recompute and a longer sequence add to the b16 s2048 step, measured and predicted
    (seconds): ``selective``, ``full`` (over b16 s2048 none) and ``s4096`` (b8 s4096 over b16
    s2048: the same tokens, the attention's quadratic part)."""
    by = {r["name"]: r for r in rows or load_rows()}
    pairs = {"selective": ("b16 s2048 selective", "b16 s2048 none"),
             "full": ("b16 s2048 full", "b16 s2048 none"),
             "s4096": ("b8 s4096 none", "b16 s2048 none")}
    out = {}
    for k, (a, b) in pairs.items():
        out[k] = dict(measured=by[a]["measured"]["step_time_s"] - by[b]["measured"]["step_time_s"],
                      predicted=predict_row(by[a])["time_s"]["iteration"]
                      - predict_row(by[b])["time_s"]["iteration"])
    return out


def profile_terms(path: Path = PROFILE, rows: list[dict] | None = None) -> dict:
    """The b8 s2048 step's device time by the planner's terms, from ``gpu_profile_h200.json``
    (torch.profiler, device seconds per step, after the fixes): ``compute`` (``aten::mm`` +
    cuDNN attention forward and backward: the GEMMs and the attention the planner's compute term
    counts), ``optimizer`` (``aten::_fused_adamw_``), ``elementwise`` (the rest of the device's
    busy time: norms, SwiGLU, RoPE, copies, concatenations, the loss) against the planner's terms
    for that row (``predicted``)."""
    prof = json.loads(Path(path).read_text())["profile"]["loom"]
    dev = {e["op"]: e["device_s_per_step"] for e in prof["top_device"]}
    compute = dev["aten::mm"] + dev["aten::_cudnn_attention_forward"] + \
        dev["aten::_cudnn_attention_backward"]
    optimizer = dev["aten::_fused_adamw_"]
    busy = prof["device_busy_s_per_step"]
    row = next(r for r in rows or load_rows() if r["name"] == "b8 s2048 none")
    t = predict_row(row)["time_s"]
    return dict(measured=dict(compute=compute, elementwise=busy - compute - optimizer,
                              optimizer=optimizer, busy=busy, wall=prof["wall_s_per_step"],
                              step=row["measured"]["step_time_s"]),
                predicted=dict(compute=t["compute"], elementwise=t["elementwise"],
                               optimizer=t["optimizer"], step=t["iteration"]))


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def _pc(x: float) -> str:
    return f"{100 * x:+.1f}%"


def markdown(rows: list[dict] | None = None) -> str:
    """docs/planner.md's table of this source: per row the measured and predicted step, its
    error, and the memory pairs; then the medians and worsts."""
    rows = rows or load_rows()
    pts = loom_gpu_points(rows=rows)
    mem = memory_rows(rows)
    lines = ["| loom H200 row | measured step | predicted step | error | peak allocated: "
             "measured / predicted less reserve | error | peak reserved: measured / "
             "predicted | error |", "|---|---|---|---|---|---|---|---|"]
    for (_, pred, meas), r, m in zip(pts, rows, mem):
        lines.append(f"| {r['name']} | {meas:.3f} s | {pred:.3f} s | {_pc(pred / meas - 1)} | "
                     f"{_gb(m['allocated'])} / {_gb(m['predicted'])} | "
                     f"{_pc(m['allocated_error'])} | {_gb(m['reserved'])} / "
                     f"{_gb(m['predicted_total'])} | {_pc(m['reserved_error'])} |")
    st = summary([p / q - 1 for _, p, q in pts])
    al = summary([m["allocated_error"] for m in mem])
    rs = summary([m["reserved_error"] for m in mem])
    lines.append(f"| median / worst of {st['n']} | | | {100 * st['median']:.1f}% / "
                 f"{100 * st['worst']:.1f}% | | {100 * al['median']:.1f}% / "
                 f"{100 * al['worst']:.1f}% | | {100 * rs['median']:.1f}% / "
                 f"{100 * rs['worst']:.1f}% |")
    return "\n".join(lines)


def terms_markdown(rows: list[dict] | None = None) -> str:
    """The disagreement by term (docs/planner.md): the b8 profile against the planner's terms,
    the two-row line ``a b + c``, and what recompute and s 4096 add."""
    rows = rows or load_rows()
    p = profile_terms(rows=rows)
    lines = ["| b8 s2048 none, seconds per step | measured (profile) | predicted | "
             "predicted - measured |", "|---|---|---|---|"]
    for k in ("compute", "elementwise", "optimizer"):
        a, b = p["measured"][k], p["predicted"][k]
        lines.append(f"| {k} | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
    a, b = p["measured"]["step"], p["predicted"]["step"]
    lines.append(f"| step (measured: the row's median) | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
    f = step_fit(rows)
    lines += ["", "| s2048, no recompute: step = a b + c | measured | predicted |",
              "|---|---|---|",
              f"| a, per sequence | {f['measured']['per_sequence']:.4f} s | "
              f"{f['predicted']['per_sequence']:.4f} s |",
              f"| c, per step | {f['measured']['fixed']:.4f} s | "
              f"{f['predicted']['fixed']:.4f} s |"]
    d = deltas(rows)
    lines += ["", "| added to b16 s2048 none | measured | predicted |", "|---|---|---|"]
    for k, label in (("selective", "selective recompute"), ("full", "full recompute"),
                     ("s4096", "b8 s4096 (same tokens)")):
        lines.append(f"| {label} | {d[k]['measured']:+.4f} s | {d[k]['predicted']:+.4f} s |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
    print()
    print(terms_markdown())
    print()
    print(markdown(load_shape_rows()).replace("| loom H200 row |", "| loom H200 shapes row |"))
