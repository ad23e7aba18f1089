"""Planner vs measured: predicted and measured step time and memory of >= 8 layouts (issue 4).

Model: GPT, 4 layers, h 256, 8 heads, FFN 1024, V 8192, s 256, global batch 16 sequences, fp32,
dropout 0, AdamW, mock data. CPU, gloo, one thread per rank.

1. Calibrate (``loom.planner.calibrate.calibrate_local``, ~15-20 s, 1 thread): GEMM curve,
   memory bandwidth, ``mem_traffic`` from one tiny single-rank training step of a *different*
   model (2 layers, s 128), gloo all-reduce alpha/bandwidth for 2 and 4 ranks. Global constants,
   never fitted per layout.
2. Oversubscription: the planner assumes one device per rank; R ranks on C cores each get
   ``min(1, C/R)`` of a core, so each layout's cluster has ``peak_flops`` and ``hbm_bw`` scaled
   by that share (``host_sharing.oversubscribed``); links are the all-reduce fit for R ranks.
3. For every layout: ``predict_layout`` (time, memory), then a Trainer run (3 warm-up + 5
   measured steps, median of the slowest rank's step time) and the peak RSS of every rank
   (``VmHWM``, max over ranks), also its growth over the rank's RSS just before the Trainer is
   built (torch, gloo and the interpreter excluded): the number compared with the planner.
4. The planner's pick (min predicted time among the 4-rank layouts) vs the measured fastest.

Issue 26 (docs/planner-validation.md): memory measured on tensors (model states + the peak of
autograd's saved tensors, recompute included), predicted per pipeline stage in fp32
(``_fp32_peak_bytes``); time with the host's shared cores (``host_sharing.shared_cores_time``,
``host_sharing.shared_cores_pipeline_time``) and the planner's GPU overlaps off
(``host_sharing.host_overlap_options``).

Waits (up to --max-wait s) for the 1-minute load average to drop below 2.5 before each layout and
records it. Layouts that fail (e.g. pipeline parallelism still in progress) are recorded with
their error and retried once at the end. Prints one JSON line per layout, then a markdown table.

    OMP_NUM_THREADS=1 python -m benchmarks.planner_vs_measured [--cluster FILE] [--only NAME,..]

``--rescore FILE [--json-out FILE]`` re-predicts a recorded run with the current planner (the
recorded calibration, measurements and host core count; seconds), so the recorded table follows
planner changes without re-measuring; tests/planner/test_planner_vs_measured_memory.py checks
that the recorded predictions are the current planner's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

from loom.config import LoomConfig, ModelConfig
from testkit import run_distributed

WARMUP, MEASURED = 2, 4
GLOBAL_BATCH = 16
MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024,
             seq_length=256, vocab_size=8192)
LOAD_LIMIT = 2.5

# name, ranks, tp, pp, cp, micro-batch, recompute, pipeline schedule
LAYOUTS = [
    ("DP4 b4", 4, 1, 1, 1, 4, None, "1f1b"),
    ("DP4 b2", 4, 1, 1, 1, 2, None, "1f1b"),
    ("DP4 b4 full-recompute", 4, 1, 1, 1, 4, "full", "1f1b"),
    ("TP2 DP2 b4", 4, 2, 1, 1, 4, None, "1f1b"),
    ("TP2 DP2 b4 selective", 4, 2, 1, 1, 4, "selective", "1f1b"),
    ("TP4 b8", 4, 4, 1, 1, 8, None, "1f1b"),
    ("CP2 DP2 b4", 4, 1, 1, 2, 4, None, "1f1b"),
    ("TP2 CP2 b8", 4, 2, 1, 2, 8, None, "1f1b"),
    ("PP2 DP2 b2 1f1b", 4, 1, 2, 1, 2, None, "1f1b"),
    ("PP2 TP2 b4 gpipe", 4, 2, 2, 1, 4, None, "gpipe"),
    ("PP4 b2 1f1b", 4, 1, 4, 1, 2, None, "1f1b"),
    ("DP2 b8 (2 ranks)", 2, 1, 1, 1, 8, None, "1f1b"),
    ("TP2 b8 (2 ranks)", 2, 2, 1, 1, 8, None, "1f1b"),
    ("DP4 b4 distopt (ZeRO-1)", 4, 1, 1, 1, 4, None, "1f1b", dict(zero=1)),
    ("DP4 b4 ZeRO-3 (FSDP2)", 4, 1, 1, 1, 4, None, "1f1b", dict(zero=3)),
    ("MoE EP2 DP4 b4", 4, 1, 1, 1, 4, None, "1f1b", dict(ep=2, moe=True)),
]
# the MoE layouts' model: MODEL with 4 experts of width 512, top-2 (same active FFN width 1024)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=512)


def _row(row) -> tuple:
    """A LAYOUTS row as 9 fields (the last: extra options ``zero``, ``ep``, ``moe``)."""
    return tuple(row) + ({},) if len(row) == 8 else tuple(row)


def make_config(ranks, tp, pp, cp, mbs, recompute, schedule, extra=None) -> LoomConfig:
    extra = extra or {}
    model = dict(MODEL, **MOE) if extra.get("moe") else MODEL
    cfg = LoomConfig(model=ModelConfig.gpt2(hidden_dropout=0.0, attention_dropout=0.0, **model))
    cfg.parallel.expert_model_parallel_size = extra.get("ep", 1)
    if extra.get("zero") == 1:
        cfg.training.use_distributed_optimizer = True
    elif extra.get("zero"):
        cfg.training.zero_stage = extra["zero"]
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.parallel.pipeline_model_parallel_size = pp
    cfg.parallel.context_parallel_size = cp
    cfg.parallel.pipeline_schedule = schedule
    cfg.parallel.overlap_grad_reduce = True  # the planner models an overlapped DP reduction
    cfg.training.micro_batch_size = mbs
    cfg.training.global_batch_size = GLOBAL_BATCH
    cfg.training.recompute_granularity = recompute
    if recompute == "full":  # loom's defaults before issue 21 (Megatron requires both)
        cfg.training.recompute_method, cfg.training.recompute_num_layers = "uniform", 1
    cfg.training.train_iters = WARMUP + MEASURED
    cfg.training.lr, cfg.training.adam_beta2 = 3e-4, 0.95  # loom's defaults before issue 21
    cfg.training.lr_decay_style, cfg.logging.eval_iters = "cosine", 0  # no evaluation
    cfg.data.mock_data = True
    cfg.logging.log_interval = 10**6
    cfg.logging.no_progress_bar = True
    return cfg.validate(ranks)


def _rss(key: str = "VmHWM") -> int:
    """This process's resident set (``VmRSS``) or its peak (``VmHWM``), bytes. Not
    ``getrusage`` ``ru_maxrss`` (what the trainer logs): on Linux a spawned child inherits the
    parent's high-water mark across fork + exec, so it reads the benchmark driver's peak."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _storage_key(t):
    """``(data_ptr, nbytes)`` of a tensor's storage (a DTensor's local shard); None when it has
    none (FSDP2 frees the unsharded parameters' storages between uses)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except (AttributeError, RuntimeError):
        return None


def _is_weight(t) -> bool:
    """A parameter (or a view of one, e.g. the ``weight.t()`` a linear layer saves): a model
    state, not an activation. FSDP2 saves its *unsharded* parameters, whose storages are the
    all-gather's output, not the sharded ones in ``SavedBytes.skip``, and frees them after the
    forward (``reshard_after_forward``): their bytes are not held with the activations."""
    import torch
    base = t._base if getattr(t, "_base", None) is not None else t
    # both: a parameter may itself be a view (FSDP2's unsharded one, of the all-gather output)
    return isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter)


class SavedBytes:
    """Live bytes of the tensors autograd saves for backward (the activations), counted by
    storage (views of one storage once) through ``torch.autograd.graph.saved_tensors_hooks``:
    a storage counts from the first save until autograd frees the last saved reference (a
    ``weakref.finalize`` on the packed holder). ``skip``: storages not counted (parameters:
    model states, not activations). ``peak``: the high-water mark, bytes."""

    class _Held:
        __slots__ = ("t", "__weakref__")

        def __init__(self, t):
            self.t = t

    def __init__(self, skip=()):
        self.skip = {k[0] for k in skip if k}
        self.refs, self.size, self.live, self.peak = {}, {}, 0, 0

    def pack(self, t):
        h = self._Held(t)
        self._count(t, h)
        return h

    def unpack(self, h):
        return h.t

    def _count(self, t, owner) -> None:
        """Count ``t``'s storage as live until ``owner`` (an object holding it) is freed."""
        import weakref
        got = _storage_key(t)
        if got is None or not got[0] or got[0] in self.skip or _is_weight(t):
            return
        key = got[0]
        if key not in self.refs:
            self.refs[key], self.size[key] = 0, got[1]
            self.live += self.size[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(owner, self._release, key)

    def recompute_hooks(self):
        """Saved-tensor hooks for the *recompute* of a non-reentrant ``torch.utils.checkpoint``
        (its ``context_fn`` recompute context). During backward, checkpoint re-runs the
        layer's forward under its own hooks (``_recomputation_hook``), which store the
        recomputed tensors in the checkpoint frame until their backward node unpacks and
        frees them; being the innermost hooks they hide those saves from :meth:`pack`, so a
        full-recompute run looked as if it held no layer activations at all. These hooks
        sit inside checkpoint's: each tensor is detached as checkpoint would, counted until
        that tensor object dies, and handed on to checkpoint's own pack hook (the top of
        autograd's default-hooks stack when the context is entered)."""
        import torch
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is None:  # not inside a recompute: nothing to chain to
            import contextlib
            return contextlib.nullcontext()
        outer_pack, outer_unpack = outer

        def pack(x):
            y = x.detach() if x.requires_grad else x
            if not _is_weight(x):  # y is a detached alias: ask x
                self._count(y, y)  # before outer_pack: it may stop the recompute by raising
            return outer_pack(y)

        return torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack)

    def _release(self, key):
        self.refs[key] -= 1
        if not self.refs[key]:
            self.live -= self.size.pop(key)
            del self.refs[key]


class _Deferred:
    """A context manager that builds the real one (``make()``) only when entered: checkpoint
    calls ``context_fn`` during the forward, but enters the recompute context later, inside
    its own recompute hooks, which :meth:`SavedBytes.recompute_hooks` must chain to."""

    def __init__(self, make):
        self.make, self.cm = make, None

    def __enter__(self):
        self.cm = self.make()
        return self.cm.__enter__()

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


def _state_bytes(trainer) -> int:
    """Bytes of every tensor reachable from the trainer's parts after training (parameters,
    gradient buffers, optimizer states, master shards), each storage once."""
    import torch
    seen, total, stack, visited = set(), 0, [trainer.parts], set()
    gradless, buffered = [], set()
    while stack:
        o = stack.pop()
        if id(o) in visited:
            continue
        visited.add(id(o))
        if isinstance(o, torch.Tensor):
            grads = [getattr(o, "grad", None), getattr(o, "main_grad", None)]
            for t in [o] + grads:
                got = _storage_key(t) if isinstance(t, torch.Tensor) else None
                if got is None:
                    continue
                key, size = got
                if key and key not in seen:
                    seen.add(key)
                    total += size
            if (isinstance(o, torch.nn.Parameter) and o.requires_grad
                    and all(g is None for g in grads)):
                gradless.append(o)
            continue
        if type(o).__name__ == "GradBuffer":  # loom.parallel.grad_buffer: DP's gradients
            buffered.update(id(q) for q in o.params if id(q) in o._bucket_of)
        if isinstance(o, torch.nn.Module):
            stack.extend(o.parameters())
            stack.extend(o.buffers())
            continue
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set)):
            stack.extend(o)
        elif hasattr(o, "__dict__") and type(o).__module__.split(".")[0] in ("loom", "torch"):
            stack.extend(vars(o).values())
    for q in gradless:
        if id(q) not in buffered:
            # no gradient buffer (DP = 1): backward wrote ``.grad`` and the step's
            # ``zero_grad(set_to_none=True)`` freed it again, but it was held from the
            # backward to the optimizer step: count its bytes. A parameter in a GradBuffer
            # (DP > 1) has its gradient there, counted with the buffer's storage above.
            local = q.to_local() if hasattr(q, "to_local") else q
            total += local.numel() * local.element_size()
    return total


def measure(ranks, tp, pp, cp, mbs, recompute, schedule, extra=None) -> dict:
    """One rank: build the Trainer for the layout, train, return this rank's numbers."""
    import torch

    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    torch.set_num_threads(1)
    cfg = make_config(ranks, tp, pp, cp, mbs, recompute, schedule, extra)
    mesh = (ParallelMesh.build(tp=tp, pp=pp, cp=cp, ep=(extra or {}).get("ep", 1))
            if ranks > 1 else ParallelMesh.single())
    base = _rss("VmRSS")
    trainer = Trainer(cfg, mesh=mesh)
    params = {_storage_key(p) for c in trainer.parts.model.chunks for p in c.parameters()}
    saved = SavedBytes(skip=params)
    # full / selective recompute: count what checkpoint saves while it recomputes (see
    # SavedBytes.recompute_hooks); the recompute context is entered inside checkpoint's own
    # hooks. Only this rank process's module attribute is replaced.
    import contextlib
    import functools

    import loom.parallel.recompute as recompute_mod
    ctx = lambda: (contextlib.nullcontext(), _Deferred(saved.recompute_hooks))  # noqa: E731
    recompute_mod.checkpoint = functools.partial(recompute_mod.checkpoint, context_fn=ctx)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        history = trainer.train()
    times = [r["step_time_s"] for r in history[WARMUP:]]
    return {"median_step_s": statistics.median(times), "steps_s": times,
            "loss": history[-1]["loss"], "peak_rss": _rss(), "base_rss": base,
            "saved_peak": saved.peak, "states": _state_bytes(trainer)}


def load1() -> float:
    return os.getloadavg()[0]


def wait_quiet(max_wait: float) -> float:
    t0 = time.monotonic()
    while load1() > LOAD_LIMIT and time.monotonic() - t0 < max_wait:
        time.sleep(10)
    return load1()


def predicted(cal, name_row, cores: int | None = None) -> dict:
    from loom.planner.host_sharing import (host_overlap_options, oversubscribed,
                                        shared_cores_pipeline_time, shared_cores_time)
    from loom.planner.layout import Options
    from loom.planner.predict import predict_layout

    _, ranks, tp, pp, cp, mbs, rc, sched, extra = _row(name_row)
    cl = cal
    ar = cal.notes.get("allreduce", {}).get(str(ranks))
    if ar:  # links: the all-reduce fit among this many ranks
        from dataclasses import replace
        cl = replace(cal, intra_alpha=ar["alpha_s"], inter_alpha=ar["alpha_s"],
                     intra_bw=ar["bw_bytes_per_s"], inter_bw=ar["bw_bytes_per_s"])
    cores = cores or os.cpu_count() or 1  # the host's cores (a rescore: the recorded run's)
    cfg = make_config(ranks, tp, pp, cp, mbs, rc, sched, extra)
    # R ranks on C < R cores: the step takes at least its critical path at one core per rank
    # and at least the ranks' busy time shared by the cores (a rank blocked in a pipeline
    # bubble or a receive gives its core away): max(T_1, R (T_1 - bubble) / C), where T_1 is
    # the planner's step with one core per rank (host_sharing.shared_cores_time)
    cl1 = oversubscribed(cl, ranks, ranks)
    # no core is free to progress gloo behind compute: the planner's overlaps are off
    opts = Options(flash_attention=True, **host_overlap_options(ranks, cores))
    p = predict_layout(cfg, ranks, cluster=cl1, opts=opts)
    if pp > 1:
        # pipelines: the stages differ (the last also runs the output layer and the loss), so
        # the total work is that of the same layout unpipelined (pp = 1, same dp, tp, cp,
        # micro-batch and m) times the number of pipelines, and the critical path is the
        # slowest stage plus one micro-batch through the others
        # (host_sharing.shared_cores_pipeline_time)
        flat_ranks = ranks // pp
        flat = predict_layout(make_config(flat_ranks, tp, 1, cp, mbs, rc, "1f1b", extra),
                              flat_ranks, cluster=oversubscribed(cl, flat_ranks, flat_ranks),
                              opts=opts)
        p["time_s"]["iteration"] = shared_cores_pipeline_time(
            p["time_s"], flat["time_s"], ranks, pp, p["layout"]["num_microbatches"], cores)
    else:
        p["time_s"]["iteration"] = shared_cores_time(p["time_s"], ranks, cores)
    cl = oversubscribed(cl, ranks, cores)
    mem = p["memory_bytes"]
    no_reserve = mem["total"] - mem["reserve"]
    return {"pred_step_s": p["time_s"]["iteration"],
            "pred_terms_s": {k: round(v, 4) for k, v in p["time_s"].items() if v > 0},
            "pred_mem_bytes": no_reserve, "pred_mem_fp32_bytes": _fp32_peak_bytes(cfg, ranks),
            "pred_mem_with_reserve_bytes": mem["total"], "compute_share": cl.notes[
                "oversubscription"]["share"], "microbatches": p["layout"]["num_microbatches"]}


def _fp32_peak_bytes(cfg, ranks: int) -> float:
    """The planner's memory terms (memory.stage_memory_terms, no reserve) as this fp32 loom run
    holds them, for every pipeline stage, and the largest. Per stage: weights 4 B (the master
    copy) instead of 2, gradients 4 B as the planner's fp32 main_grad, Adam m and v 8 B instead
    of 12 (no separate master), each sharded as the planner shards it; activations 4 B instead
    of 2; the output layer's terms as :func:`_loom_output_bytes`. The loss's forward transient
    (memory_runtime.loss_transient_bytes, in the output stage's activations) is left out: the
    measurement counts saved tensors, not what a forward frees before returning. A unit
    conversion, not a fit. Per stage because a pipeline's first stage (``p`` micro-batches in
    flight) and its last (the loss) peak differently."""
    import numpy as np

    from loom.planner.layout import Options, make_layouts
    from loom.planner.memory import padded_vocab, stage_memory_terms
    from loom.planner.memory_runtime import loss_transient_bytes
    from loom.planner.predict import layout_of

    stages = stage_memory_terms(cfg.model, make_layouts(layout_of(cfg, ranks)),
                                cfg.global_batch_size(ranks), cfg.model.seq_length,
                                Options(flash_attention=True))
    pp = cfg.parallel.pipeline_model_parallel_size
    names = ("first", "last", "middle")[:min(3, pp)]
    t = cfg.parallel.tensor_model_parallel_size
    S = cfg.model.seq_length * cfg.training.micro_batch_size / cfg.parallel.context_parallel_size
    transient = float(loss_transient_bytes(cfg.model, S, float(padded_vocab(cfg.model, t)), t,
                                           "loom"))

    def one(st, k):  # the one layout's value (a term may be a scalar, e.g. the middle's output)
        return float(np.asarray(st[k]).flat[0])

    def fp32(name, st):
        out = name == "last" or pp == 1
        acts = one(st, "activations") - (transient if out else 0.0)
        return (2 * one(st, "weights") + one(st, "gradients") + one(st, "optimizer") * 8 / 12
                + 2 * acts + _loom_output_bytes(cfg, one(st, "embedding_output")))

    return max(fp32(n, stages[n]) for n in names)


def _loom_output_bytes(cfg, embedding_output: float) -> float:
    """The planner's ``embedding_output`` term of one stage (memory.py: on the stage with the
    output layer, per micro-batch in flight there, the 16-bit final-norm and output-layer
    inputs ``2 x 2 S h`` and what loom's fused linear cross-entropy saves, fp32 ``dL/dx``
    ``[S, h]``, ``dL/dw`` ``[Vp/t, h]`` and the log-sum-exp ``[S]``) as this fp32 run holds it:
    the two 16-bit inputs doubled, the rest already fp32. ``S = s b / cp`` tokens per
    micro-batch; this benchmark's model has no dropout, so the term is a whole number of
    micro-batches' outputs (0 on a stage without the output layer)."""
    from loom.parallel.cross_entropy_cost import saved_bytes
    from loom.planner.memory import padded_vocab

    m, p = cfg.model, cfg.parallel
    t = p.tensor_model_parallel_size
    S = m.seq_length * cfg.training.micro_batch_size / p.context_parallel_size
    vp = float(padded_vocab(m, t)) / t
    h = m.hidden_size
    sp = t if p.sequence_parallel else 1  # the norm's input is [S/t, h] with SP
    n = embedding_output / (2 * 2 * S * h / sp + float(saved_bytes(S, h, vp)))  # in flight
    return embedding_output + n * 2 * 2 * S * h / sp


def run_layout(row, max_wait) -> dict:
    name, ranks, tp, pp, cp, mbs, rc, sched, extra = _row(row)
    load = wait_quiet(max_wait)
    t0 = time.monotonic()
    try:
        res = run_distributed(ranks, measure, ranks, tp, pp, cp, mbs, rc, sched, extra,
                              timeout=600)
    except Exception as e:  # noqa: BLE001 - record and go on
        msg = str(e).strip().splitlines()
        return {"status": "skipped", "error": msg[-1][:300] if msg else repr(e),
                "load_before": round(load, 2)}
    return {"status": "ok", "load_before": round(load, 2),
            "wall_s": round(time.monotonic() - t0, 1),
            "meas_step_s": res[0]["median_step_s"],
            "meas_steps_s": [round(x, 4) for x in res[0]["steps_s"]],
            "meas_peak_rss_bytes": max(r["peak_rss"] for r in res),
            "meas_mem_delta_bytes": max(r["peak_rss"] - r["base_rss"] for r in res),
            "meas_saved_peak_bytes": max(r["saved_peak"] for r in res),
            "meas_states_bytes": max(r["states"] for r in res),
            "meas_tensor_bytes": max(r["saved_peak"] + r["states"] for r in res),
            "loss": res[0]["loss"]}


def pct(pred, meas) -> float:
    return 100.0 * (pred - meas) / meas


def table(rows) -> str:
    mb = 1 << 20
    out = ["| layout | ranks | m | pred step s | meas step s | err % | pred mem MiB (fp32) | "
           "meas tensors MiB (states + saved peak) | mem err % | meas RSS growth MiB | load |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['layout']} | {r['ranks']} | {r['microbatches']} | "
                       f"{r['pred_step_s']:.3f} | skipped: {r['error'][:80]} | | "
                       f"{r['pred_mem_fp32_bytes'] / mb:.0f} | | | | {r['load_before']} |")
            continue
        out.append(f"| {r['layout']} | {r['ranks']} | {r['microbatches']} | "
                   f"{r['pred_step_s']:.3f} | {r['meas_step_s']:.3f} | {r['time_err_pct']:+.0f} | "
                   f"{r['pred_mem_fp32_bytes'] / mb:.0f} | {r['meas_tensor_bytes'] / mb:.0f} "
                   f"({r['meas_states_bytes'] / mb:.0f} + {r['meas_saved_peak_bytes'] / mb:.0f}) | "
                   f"{r['mem_err_pct']:+.0f} | {r['meas_mem_delta_bytes'] / mb:.0f} | "
                   f"{r['load_before']} |")
    return "\n".join(out)


def pick_summary(rows, ranks) -> dict | None:
    ok = [r for r in rows if r["status"] == "ok" and r["ranks"] == ranks]
    if len(ok) < 2:
        return None
    pick = min(ok, key=lambda r: r["pred_step_s"])
    best = min(ok, key=lambda r: r["meas_step_s"])
    slower = pct(pick["meas_step_s"], best["meas_step_s"])
    return {"ranks": ranks, "planner_pick": pick["layout"], "pick_measured_s": pick["meas_step_s"],
            "measured_fastest": best["layout"], "fastest_measured_s": best["meas_step_s"],
            "pick_slower_than_fastest_pct": round(slower, 1), "within_10pct": slower <= 10.0,
            "layouts_compared": len(ok)}


def score(rows) -> None:
    """Errors of the ``ok`` rows (in place): ``time_err_pct``, ``mem_err_pct``."""
    for rec in rows:
        if rec["status"] == "ok":
            rec["time_err_pct"] = round(pct(rec["pred_step_s"], rec["meas_step_s"]), 1)
            rec["mem_err_pct"] = round(pct(rec["pred_mem_fp32_bytes"], rec["meas_tensor_bytes"]),
                                       1)


def summarize(rows, total_s) -> dict:
    ok = [r for r in rows if r["status"] == "ok"]
    return {"picks": [s for s in (pick_summary(rows, 4), pick_summary(rows, 2)) if s],
            "mean_abs_time_err_pct": round(statistics.mean(abs(r["time_err_pct"]) for r in ok), 1)
            if ok else None,
            "mean_abs_mem_err_pct": round(statistics.mean(abs(r["mem_err_pct"]) for r in ok), 1)
            if ok else None,
            "measured_layouts": len(ok), "skipped": [r["layout"] for r in rows
                                                     if r["status"] != "ok"],
            "total_s": total_s}


def rescore(recorded: dict) -> dict:
    """A recorded run (``--json-out`` output) re-predicted by the current planner: same
    calibration, same measurements, same host core count (``host_cores``), new predictions and
    errors. Seconds, no training run."""
    from loom.planner.hardware import Cluster
    cal = Cluster.from_dict(recorded["calibration"])
    cores = recorded["host_cores"]
    byname = {r[0]: r for r in LAYOUTS}
    rows = []
    for rec in recorded["rows"]:
        rec = dict(rec)
        rec.update(predicted(cal, byname[rec["layout"]], cores))
        rows.append(rec)
    score(rows)
    return {"calibration": recorded["calibration"], "host_cores": cores, "rows": rows,
            "summary": summarize(rows, recorded["summary"]["total_s"]),
            "rescored": "predictions by the current planner; calibration and measurements "
                        "as recorded"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", help="cluster JSON from calibrate_local (default: calibrate now)")
    ap.add_argument("--save-cluster", default=None, help="write the calibration here")
    ap.add_argument("--rescore", metavar="FILE", default=None,
                    help="re-predict a recorded --json-out FILE with the current planner (its "
                         "calibration, measurements and host core count kept; no runs)")
    ap.add_argument("--only", default=None, help="comma-separated layout names")
    ap.add_argument("--max-wait", type=float, default=8.0,
                    help="seconds to wait per layout for load < 2.5")
    ap.add_argument("--json-out", default=None, help="also write all rows to this JSON file")
    args = ap.parse_args()
    t_start = time.monotonic()
    if args.rescore:
        with open(args.rescore) as fh:
            out = rescore(json.load(fh))
        if args.json_out:
            with open(args.json_out, "w") as fh:
                json.dump(out, fh, indent=1)
        print(table(out["rows"]))
        return 0

    from loom.planner.calibrate import calibrate_local
    from loom.planner.hardware import Cluster
    if args.cluster:
        cal = Cluster.load(args.cluster)
    else:
        load = wait_quiet(args.max_wait)
        cal = calibrate_local(args.save_cluster, world=4)
        cal.notes["load_before"] = round(load, 2)
    print(json.dumps({"calibration": {k: getattr(cal, k) for k in (
        "peak_flops", "gemm_efficiency", "gemm_half_dim", "hbm_bw", "mem_traffic", "intra_bw",
        "intra_alpha")} | {"allreduce": {n: {k: v for k, v in a.items() if k != "times_s"}
                                         for n, a in cal.notes.get("allreduce", {}).items()},
                           "calibration_step_s": cal.notes.get("calibration_step_s"),
                           "seconds": cal.notes.get("seconds"),
                           "load_before": cal.notes.get("load_before")}}), flush=True)

    layouts = LAYOUTS
    if args.only:
        names = set(args.only.split(","))
        layouts = [r for r in LAYOUTS if r[0] in names]
    rows = []
    for row in layouts:
        rec = {"layout": row[0], "ranks": row[1], "tp": row[2], "pp": row[3], "cp": row[4],
               "dp": row[1] // (row[2] * row[3] * row[4]), "mbs": row[5],
               "recompute": row[6] or "none", "schedule": row[7] if row[3] > 1 else None,
               **_row(row)[8]}
        rec.update(predicted(cal, row))
        rec.update(run_layout(row, args.max_wait))
        rows.append(rec)
        if rec["status"] == "ok":
            score([rec])
            print(json.dumps(rec), flush=True)
    for i, rec in enumerate(rows):  # retry failures once (e.g. pipeline work in progress)
        if rec["status"] != "ok":
            row = next(r for r in layouts if r[0] == rec["layout"])
            first_error = rec["error"]
            rec.update(run_layout(row, args.max_wait))
            rec["retried"] = True
            if rec["status"] == "ok":
                rec["first_error"] = first_error
                score([rec])
            print(json.dumps(rec), flush=True)
    summary = summarize(rows, round(time.monotonic() - t_start, 1))
    print(json.dumps({"summary": summary}), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"calibration": json.loads(cal.to_json()), "host_cores": os.cpu_count(),
                       "rows": rows, "summary": summary}, fh, indent=1)
    print()
    print(table(rows))
    for s in summary["picks"]:
        print(f"\n{s['ranks']} ranks: planner pick {s['planner_pick']} measured "
              f"{s['pick_measured_s']:.3f} s; measured fastest {s['measured_fastest']} "
              f"{s['fastest_measured_s']:.3f} s; pick is {s['pick_slower_than_fastest_pct']:+.1f}% "
              f"-> {'within' if s['within_10pct'] else 'NOT within'} 10%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
