"""Why a search came back empty, and the nearest thing that would work.

Two different failures, two different messages:

* **no layout divides** (:func:`explain_no_layout`): no (t, p, c, d, b) satisfies the divisibility
  rules at all (heads, KV groups, FFN by t; B by d; fixed sizes by the GPU count). The message
  names the first rule that empties the search and how to satisfy it.
* **nothing fits** (:func:`explain_nothing_fits`): layouts exist but all exceed HBM. The message
  names the layout needing the least memory, its largest memory term, by how much it overflows,
  and the cheapest change that makes a layout fit, found by re-running the search with one
  constraint relaxed at a time, in this order (no new hardware first): full recompute, ZeRO
  stages up to 3, context parallelism, releasing each fixed size, then 2x, 4x, ... 64x the GPUs.
"""

from __future__ import annotations

from dataclasses import replace

from loom.config import ModelConfig
from loom.planner.hardware import GB, Cluster
from loom.planner.layout import Options
from loom.planner.mamba import is_hybrid, mamba_dims
from loom.planner.search import MEMORY_TERMS, enumerate_layouts, record, search

FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
         "cp": "--context-parallel-size", "dp": "--data-parallel-size",
         "ep": "--expert-model-parallel-size", "etp": "--expert-tensor-parallel-size",
         "mbs": "--micro-batch-size", "recompute": "--recompute-granularity",
         "sp": "--sequence-parallel", "zero": "--zero-stage", "vp":
         "--num-layers-per-virtual-pipeline-stage",
         "first_layers": "--decoder-first-pipeline-num-layers",
         "last_layers": "--decoder-last-pipeline-num-layers",
         "account_embedding": "--account-for-embedding-in-pipeline-split",
         "account_loss": "--account-for-loss-in-pipeline-split"}


def _short(rec: dict) -> str:
    ep = f" ep={rec['ep']}" if rec.get("ep", 1) > 1 else ""
    return (f"tp={rec['tp']} pp={rec['pp']} dp={rec['dp']}{ep} cp={rec['cp']} "
            f"mbs={rec['micro_batch_size']} recompute={rec['recompute']} zero={rec['zero']}")


def explain_no_layout(model: ModelConfig, cluster: Cluster, global_batch_size: int,
                      seq_length: int, fixed: dict, opts: Options) -> str:
    """The "no layout divides" message (see module docstring)."""
    n, B = cluster.num_gpus, global_batch_size
    head = (f"no layout divides: {n} GPUs, B={B}, L={model.num_layers}, "
            f"a={model.num_attention_heads}")
    mamba = ""
    if is_hybrid(model):
        _, H, G, *_ = mamba_dims(model)
        mamba = f", the Mamba heads H={H} and groups G={G} (--mamba-num-groups)"
    sizes = [(k, int(fixed[k])) for k in ("tp", "pp", "cp", "dp") if fixed.get(k)]
    product = 1
    for _, v in sizes:
        product *= v
    if n % product:  # the given sizes alone cannot tile the GPUs
        given = " x ".join(f"{FLAGS[k]} {v}" for k, v in sizes)
        return (f"{head}: {given} = {product} ranks does not divide the {n} GPUs: give sizes "
                f"whose product divides --num-gpus {n}, or --num-gpus a multiple of {product}")
    if fixed.get("pp", 1) > model.num_layers:
        return (f"{head}: --pipeline-model-parallel-size {fixed['pp']} exceeds --num-layers "
                f"{model.num_layers} (each stage holds at least one layer): lower it")
    for k, v in fixed.items():
        rest = {kk: vv for kk, vv in fixed.items() if kk != k}
        if k == "pp" and rest.get("layout"):  # the layout string needs its pipeline size
            continue
        if len(enumerate_layouts(model, cluster, B, seq_length, rest, opts)["tp"]):
            return (f"{head}: {FLAGS.get(k, k)} {v} admits no layout with the other sizes "
                    f"(it must divide the {n} GPUs, and for TP the heads, query groups and FFN"
                    f"{mamba}; PP needs p <= L; EP must divide the experts and, times the expert "
                    f"TP (which divides TP), t x d): change or drop "
                    f"{FLAGS.get(k, k)}")
    layout_keys = {k: v for k, v in fixed.items() if k in FLAGS}
    if len(layout_keys) > 1 and len(enumerate_layouts(model, cluster, B, seq_length, {},
                                                      opts)["tp"]):
        given = ", ".join(f"{FLAGS[k]} {v}" for k, v in layout_keys.items())
        return (f"{head}: the given {given} admit no layout together (each size must divide "
                f"the {n} GPUs, and for TP the heads, query groups and FFN; PP needs p <= L; "
                f"d = GPUs / (t p c) must divide the batch into micro-batches): drop some of "
                f"them and let the planner choose")
    if not any(B % d == 0 for d in range(1, n + 1) if n % d == 0):
        return f"{head}: --global-batch-size {B} has no divisor d dividing the GPU count"
    return (f"{head}: every (t, p, c) dividing the GPUs leaves a data-parallel size d that does "
            f"not divide --global-batch-size {B}; use a multiple of {n} "
            f"(e.g. --global-batch-size {-(-B // n) * n}) or another --num-gpus")


def _fits(model, cluster, B, s, fixed, opts):
    res = search(model, cluster, B, s, fixed, opts)
    return record(res, int(res["order"][0])) if len(res["order"]) else None


def overflow(rec: dict, capacity_gb: float) -> str:
    """``"(tp=.. ...) needs X GB, Y GB too much; its largest term is T Z GB; it would take S s
    per iteration (F TFLOP/s/GPU)"``: what overflows a record that does not fit, by how much,
    and the time the planner still predicts for it (GB = 1e9 bytes)."""
    term = max(MEMORY_TERMS, key=lambda k: rec["memory_terms_gb"][k])
    return (f"({_short(rec)}) needs {rec['memory_gb']:.1f} GB, "
            f"{rec['memory_gb'] - capacity_gb:.1f} GB too much; its largest term is {term} "
            f"{rec['memory_terms_gb'][term]:.1f} GB; it would take "
            f"{rec['iteration_time_s']:.3g} s per iteration ({rec['tflops_per_gpu']:.0f} "
            f"TFLOP/s/GPU)")


def explain_nothing_fits(model: ModelConfig, cluster: Cluster, global_batch_size: int,
                         seq_length: int, fixed: dict, opts: Options, res: dict) -> str:
    """The "nothing fits" message for a search ``res`` with layouts but none in memory."""
    B, s = global_batch_size, seq_length
    i = int(res["mem_total"].argmin())
    rec = record(res, i)
    cap = cluster.hbm_bytes / GB
    msg = f"nothing fits in {cap:.0f} GB per GPU: the smallest layout " + overflow(rec, cap)
    fastest = record(res, int(res["time_iteration"].argmin()))
    if fastest != rec:
        msg += "; the fastest one " + overflow(fastest, cap)
    tries = []
    if fixed.get("recompute") not in (None, "full", 2):
        tries.append(("--recompute-granularity full", {**fixed, "recompute": "full"}, opts,
                      cluster))
    if opts.max_zero_stage < 3 and "zero" not in fixed and not opts.muon_ns_steps:
        tries.append(("--max-zero-stage 3 (ZeRO-2/3, data parallel only)", fixed,
                      replace(opts, max_zero_stage=3), cluster))
    if "zero" in fixed and fixed["zero"] < 3 and not opts.muon_ns_steps:
        tries.append(("--zero-stage 3", {**fixed, "zero": 3}, opts, cluster))
    split = ("layout", "first_layers", "last_layers", "account_embedding", "account_loss")
    for k in ("cp", "mbs", "tp", "pp", "dp", "ep", "etp", "sp", "vp", "recompute"):
        if k in fixed:  # releasing PP releases the split it carries (a layout is p x v stages)
            rest = {kk: vv for kk, vv in fixed.items()
                    if kk != k and not (k == "pp" and kk in split)}
            tries.append((f"drop {FLAGS[k]} {fixed[k]} (let the planner choose)", rest, opts,
                          cluster))
    for mult in (2, 4, 8, 16, 32, 64):
        tries.append((f"--num-gpus {cluster.num_gpus * mult}", fixed, opts,
                      replace(cluster, num_gpus=cluster.num_gpus * mult)))
    for label, fx, op, cl in tries:
        got = _fits(model, cl, B, s, fx, op)
        if got:
            return (f"{msg}.\ncheapest change: {label}: then {_short(got)} needs "
                    f"{got['memory_gb']:.1f} GB at {got['tflops_per_gpu']:.0f} TFLOP/s/GPU")
    return (f"{msg}.\nno single change found (tried recompute, ZeRO-3, releasing fixed sizes and "
            f"up to 64x the GPUs): shorten --seq-length or use a GPU with more memory")
