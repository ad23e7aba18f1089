"""NAR table 2's ZeRO-3 rows under DeepSpeed's own 2021 ZeRO-3 schedule, event by event.

The planner prices ZeRO-3 as per-micro-batch weight all-gathers and a gradient reduce-scatter of
which ``timing.ZERO3_OVERLAP`` of the compute hides (fitted on these six rows; held out, its
prior 1.0 leaves the b = 4 rows 26-28% too fast: docs/planner.md, "Why the worst rows miss").
This script asks whether DeepSpeed's code at the paper's date explains the six rows without a
fitted number. It replays the parameter coordinator of ``deepspeed/runtime/zero/stage3.py`` at
:data:`SOURCE` over a Megatron GPT layer's module trace (forward; then per layer, last first, the
full-recompute forward and the backward):

* ``fetch_sub_module``: a module whose weight is not on the GPU all-gathers it, and any fetch
  that waited on a gather ends in ``torch.cuda.synchronize()`` (every stream, the gradient
  reduction's too);
* ``prefetch_next_sub_modules``: only when no gather is in flight and fewer than
  ``stage3_max_live_parameters`` elements are live, the next weights of the trace, whole, until
  ``stage3_prefetch_bucket_size`` elements;
* ``release_sub_module``: a weight is freed after use unless the trace reuses its module within
  ``stage3_max_reuse_distance`` elements (``_keep_for_later``), so the full recompute's forward
  keeps only the weights its backward needs soon;
* parameters under ``stage3_param_persistence_threshold`` (10^5: layer norms, biases) stay whole;
* gradients are reduced in ``reduce_bucket_size`` buckets on the reduction stream, the CPU waiting
  for the previous bucket first (``reduce_ipg_grads``); without ``contiguous_gradients`` (off
  by default for stage 3 until c9fee8214, 2021-07-01) as an all-reduce
  (``buffered_reduce_fallback``), with it as a reduce-scatter.

Compute per module is the planner's (``timing.layer_times``: GEMMs by weight size, attention,
element-wise time), each collective the planner's flat ring (``primitives.all_gather_time`` at
``cluster.inter_bw``), gathers and reductions queued on one link. The paper gives no DeepSpeed
version or config, so :data:`CONFIGS` runs three: April 2021's defaults, July 2021's (contiguous
gradients on) and ten times larger prefetch / live / reuse limits. They move the rows by up to
~45 points, and no one config fits all six (tests/planner/test_planner_deepspeed_zero3.py): the
schedule is real, the run's config is not published, so the fitted overlap stays.

    OMP_NUM_THREADS=1 python -m benchmarks.planner_deepspeed_zero3 \
        > benchmarks/results/planner_deepspeed_zero3.json        # ~1 s
"""

from __future__ import annotations

import json
import math
import statistics

from loom.planner.constants import fitted_cluster
from loom.planner.flops import hardware_flops_per_iteration
from loom.planner.layout import Options
from loom.planner.presets import NAR_TABLE2, gpt
from loom.planner.primitives import all_gather_time, all_reduce_time
from loom.planner.timing import layer_times

SOURCE = dict(repo="microsoft/DeepSpeed", commit="112ebff6e86a177608e52f7e36595ea2926ae37b",
              date="2021-04-08", paths=("deepspeed/runtime/zero/stage3.py",
                                        "deepspeed/runtime/zero/constants.py"))

# stage3_prefetch_bucket_size, stage3_max_live_parameters, stage3_max_reuse_distance (elements),
# reduce_bucket_size (elements), contiguous_gradients
CONFIGS = {
    "defaults_2021_04": dict(prefetch=5e7, live=1e9, reuse=1e9, bucket=5e8, contiguous=False),
    "defaults_2021_07": dict(prefetch=5e7, live=1e9, reuse=1e9, bucket=5e8, contiguous=True),
    "limits_x10": dict(prefetch=5e8, live=1e10, reuse=1e10, bucket=5e8, contiguous=True),
}

# Megatron GPT layer (2021), forward order: module, weight size in h^2 (0: no weight above the
# persistence threshold). Backward: parents first, then their children in reverse.
FORWARD = (("layer", 0), ("ln1", 0), ("attn", 0), ("qkv", 3), ("softmax", 0), ("dropout", 0),
           ("dense", 1), ("ln2", 0), ("mlp", 0), ("fc1", 4), ("fc2", 4))
BACKWARD = ("layer", "mlp", "fc2", "fc1", "ln2", "attn", "dense", "dropout", "softmax", "qkv",
            "ln1")


def trace(num_layers: int) -> list:
    """The iteration's module trace: ``(layer, module, phase)``, phase ``f`` (forward), ``r``
    (full recompute's forward) or ``b`` (backward)."""
    out = [(i, m, "f") for i in range(num_layers) for m, _ in FORWARD]
    for i in reversed(range(num_layers)):
        out += [(i, m, "r") for m, _ in FORWARD] + [(i, m, "b") for m in BACKWARD]
    return out


def simulate(num_layers: int, h: int, compute: dict, gather, reduce, cfg: dict) -> dict:
    """One iteration, one micro-batch: ``time`` (s) and ``gathered`` (weight elements
    all-gathered). ``compute[module]``: forward seconds (backward twice that); ``gather(numel)``,
    ``reduce(numel)``: seconds of one collective."""
    size = {m: k * h * h for m, k in FORWARD}
    tr = trace(num_layers)
    nxt, seen = [None] * len(tr), {}
    for i in reversed(range(len(tr))):
        nxt[i], seen[tr[i][:2]] = seen.get(tr[i][:2]), i
    cum = [0.0]
    for _, m, _ in tr:
        cum.append(cum[-1] + size[m])
    status, done, inflight = {}, {}, []
    live = cpu = gpu = link = red_done = bucket = bucket_ready = gathered = 0.0

    def issue(key):
        nonlocal link, live, gathered
        link = max(cpu, link) + gather(size[key[1]])
        done[key], status[key] = link, "inflight"
        inflight.append(key)
        live += size[key[1]]
        gathered += size[key[1]]

    def flush():
        nonlocal cpu, link, red_done, bucket
        cpu = max(cpu, red_done)  # reduction_stream.synchronize() before the next bucket
        link = red_done = max(cpu, link, bucket_ready) + reduce(bucket)
        bucket = 0.0

    for i, (layer, m, phase) in enumerate(tr):
        key, w = (layer, m), size[m]
        if w:  # fetch_sub_module
            if status.get(key, "free") == "free":
                issue(key)
            if status[key] == "inflight":
                cpu = gpu = max(cpu, gpu, red_done, max(done[k] for k in inflight))
                for k in inflight:
                    status[k] = "whole"
                inflight = []
        if not inflight and live < cfg["live"]:  # prefetch_next_sub_modules
            numel = 0.0
            for j in range(i, len(tr)):
                kj = tr[j][:2]
                if size[kj[1]] and status.get(kj, "free") == "free":
                    issue(kj)
                    numel += size[kj[1]]
                    if numel >= cfg["prefetch"]:
                        break
        gpu = max(gpu, cpu) + compute[m] * (2 if phase == "b" else 1)
        if w and phase == "b":  # the weight's gradient joins the reduction bucket
            if bucket and bucket + w > cfg["bucket"]:
                flush()
            bucket, bucket_ready = bucket + w, gpu
        if w and (nxt[i] is None or cum[nxt[i]] - cum[i + 1] >= cfg["reuse"]):
            status[key] = "free"  # release_sub_module
            live -= w
    if bucket:
        flush()
    return dict(time=max(gpu, link, red_done), gathered=gathered)


def module_compute(model, b: int, cluster, opts: Options) -> dict:
    """Forward seconds per module of one layer and micro-batch (the planner's terms)."""
    L = dict(tp=1, pp=1, cp=1, vp=1, mbs=b, dp=cluster.num_gpus, sp=0, recompute=2)
    lt = layer_times(model, 2048, L, cluster, opts)
    u, at, ew = float(lt["gemm"]) / 12, float(lt["attn"]), float(lt["elem"]) / 4
    return dict(layer=0.0, ln1=ew, attn=0.0, qkv=3 * u + at / 2, softmax=ew, dropout=at / 2,
                dense=u, ln2=ew, mlp=0.0, fc1=4 * u + ew, fc2=4 * u)


def predict(config: str, bandwidth_scale: float = 1.0, compute_scale: float = 1.0) -> list:
    """One dict per ZeRO-3 row of NAR table 2: ``row``, ``published_s``, ``simulated_s``,
    ``error`` (simulated / published - 1: the days' error), ``gathers_per_param``."""
    cfg, opts, out = CONFIGS[config], Options(flash_attention=False, max_zero_stage=3), []
    for scheme, P, _, B, n, b, tflops, _ in NAR_TABLE2:
        if scheme != "ZeRO-3":
            continue
        num_layers, h, a = (96, 12288, 96) if P < 200 else (105, 20480, 128)
        cl, model = fitted_cluster("A100-80GB", n), gpt(num_layers, h, a)
        comp = {k: v * compute_scale for k, v in module_compute(model, b, cl, opts).items()}
        bw = cl.inter_bw * bandwidth_scale
        gather = lambda x: float(all_gather_time(n, 2 * x, bw, cl.inter_alpha))  # noqa: E731
        reduce = (gather if cfg["contiguous"] else
                  lambda x: float(all_reduce_time(n, 2 * x, bw, cl.inter_alpha)))
        sim = simulate(num_layers, h, comp, gather, reduce, cfg)
        pub = hardware_flops_per_iteration(model, B, "full", 2048) / (n * tflops * 1e12)
        out.append(dict(row=f"{P}B {n} GPUs b{b}", published_s=pub, simulated_s=sim["time"],
                        error=sim["time"] / pub - 1,
                        gathers_per_param=sim["gathered"] / (12 * h * h * num_layers)))
    return out


def summary(rows: list) -> dict:
    err = [abs(r["error"]) for r in rows]
    return dict(median=statistics.median(err), worst=max(err))


def main() -> None:
    res = {"source": SOURCE, "configs": CONFIGS, "results": {}}
    for name in CONFIGS:
        rows = predict(name)
        res["results"][name] = dict(rows=rows, **summary(rows))
    print(json.dumps(res, indent=1, default=lambda x: None if math.isnan(x) else x))


if __name__ == "__main__":
    main()
