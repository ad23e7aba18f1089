"""``make gpu-check``: loom measured on one CUDA GPU in at most six minutes (issue 48).

Five parts, in this order (a part that no longer fits the time budget is skipped and says so):

1. ``tier``: the CUDA correctness tier, ``pytest -m cuda tests/cuda`` in a subprocess (bf16
   tracks fp32; a fused SDPA kernel runs; fused cross-entropy equals the plain loss;
   ``--compile`` equals eager; dropout on the CUDA RNG tracker replays under recompute; an
   async checkpoint of CUDA tensors loads bit-equal; TP=2 and PP=2 parity with two ranks on the
   one GPU over gloo). Its junit XML gives each test's outcome and what it recorded.
2. ``speed``: a LLaMA-style model of 1.10B parameters (16 layers, h 2048, 16 heads, 4 KV
   groups, SwiGLU FFN 8192, V 32000, s 2048, untied) in bf16, no dropout, the largest
   micro-batch that fits (a power of two up to 16, 32K tokens: the planner's largest fitting one
   first, then up while a 2-step probe fits, down while it runs out of memory), one micro-batch
   per step: loom and the plain PyTorch loop of ``benchmarks/plain_llama.py`` (SDPA, fused
   AdamW, bf16 autocast) alternate, A B A B, each run a fresh build with ``warmup`` + ``steps``
   steps (an arm out of memory halves its own micro-batch); the
   median step, tokens/s and MFU (model FLOPs of :func:`loom.planner.flops.
   model_flops_per_iteration` over the step and the planner's peak of the GPU, 989 TFLOP/s for
   an H100 SXM), and the ratio. Weights are drawn on the GPU (normal 0.02, norms 1) instead of
   loom's per-name CPU generator: seconds per build, and no effect on step time or memory.
3. ``rows``: planner vs measured at five configurations of that model (b = the micro-batch
   found and half of it, no / selective / full recompute, s 2048 and 4096): the median step and
   the peak memory (``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` from the
   build on) against :func:`loom.planner.predict.predict_layout` (what ``loom train --dry-run``
   prints) on the GPU's row of ``loom/planner/hardware.py``.
4. ``attention``: causal ``scaled_dot_product_attention`` forward + backward per SDPA backend
   (flash, cuDNN, memory-efficient, math, and the default choice) at three shapes (s 2048 to
   8192, head dim 128) against the planner's attention time, all blocks and the causal half
   (:mod:`benchmarks.attention_kernels`; the question of docs/planner.md, "DGX Cloud").
5. ``compile``: part 2 again with ``--compile`` (loom: each layer ``torch.compile``'d; plain:
   each block), A B A B.

Without CUDA (and no ``--device``) it prints one line, ``no CUDA device: nothing measured``,
and exits 0. ``--device cpu --sizes tiny`` runs the same code on a tiny model (the CPU test,
``tests/integration/test_gpu_check.py``). :func:`estimate` is the script's own run time on an
H100 (steps x the planner's step time + allowances for start-up, the tier, builds and
compilation); the test keeps it under ``BUDGET_S``.

Output: ``benchmarks/results/gpu_check_<gpu>.json`` (everything, rewritten after each part) and
``gpu_check_<gpu>_runs.jsonl`` (the planner rows, one JSON object per line), a copy of both in
``--out`` (default ``$OUT``, the device tool's return folder) with the table
(``gpu_check_<gpu>.md``) and the tier's log and junit XML; the table is printed last. A held-out
``--sizes`` (``wide``, ``small``) names its files ``gpu_check_<gpu>_<sizes>.*``.

A planner row (``rows`` in the JSON, one line of the ``.jsonl``)::

    {"source": "loom gpu-check", "name": "b16 s2048 none", "status": "ok" | "oom" | "error: ...",
     "gpu": "H100-80GB", "device_name": ..., "torch": ..., "date": "YYYY-MM-DD",
     "world_size": 1, "config": {flag: value}, "layout": {tp, pp, dp, cp, vp, mbs,
     recompute, sp, zero, ep, zb, num_microbatches}, "global_batch_size": b,
     "seq_length": s, "measured": {"step_time_s", "step_times_s", "peak_allocated_bytes",
     "peak_reserved_bytes", "tokens_per_s", "mfu"}, "predicted": {"step_time_s", "time_s":
     {term: s}, "memory_bytes": {term: bytes, "total"}, "mfu"}, "error_pct": {...}}

``LoomConfig.from_flat(row["config"]).validate(row["world_size"])`` rebuilds the run's config.

    make gpu-check                        # = PYTHONPATH=. python3 -m benchmarks.gpu_check
    python -m benchmarks.gpu_check --parts speed,rows --budget 300
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

STARTED = time.monotonic()  # a script's budget counts from here, torch's import included
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/gpu_check.py` from the working tree
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

BUDGET_S = 360.0  # six minutes on one H100, the bound; a device command may run 10
PARTS = ("tier", "speed", "rows", "attention", "compile")
NO_CUDA = "no CUDA device: nothing measured"
ANCHORS = [
    ("nanochat, 1.88B on H100", "50.9% MFU",
     "github.com/karpathy/nanochat, the figure issue 48 gives"),
    ("Megatron-Core r0.8.0, GPT 1.7B (h 2048, 24 layers) to 462B on 48-6144 H100",
     "41% MFU at 1.7B; 41-49% over the table",
     "benchmarks.planner_sources.validation.MCORE_H100 (Megatron-LM README weak-scaling table)"),
]
# seconds on the H100 host that steps x the planner's step time does not cover: process start
# and imports, the whole CUDA tier (its own interpreter, two spawned ranks, one compilation),
# one Trainer or plain-model build (weights drawn on the GPU), the first step's extra (kernel
# selection, allocator growth), a first torch.compile of one layer or block (fwd + bwd), and a
# rebuild's compiled-code lookup. Guesses until measured: the JSON records the real ones.
ALLOW = {"startup": 20.0, "tier": 90.0, "build": 4.0, "first_step": 2.0, "compile": 45.0,
         "recompile": 5.0, "attention": 15.0}


@dataclass(frozen=True)
class Sizes:
    """The model and the run lengths: LLaMA layout, ``mbs_cap`` (largest micro-batch tried),
    ``warmup`` + ``steps`` per speed run, ``rounds`` of A B, the planner rows' ``row_warmup``
    + ``row_steps`` and their longer sequence ``long_seq``."""
    num_layers: int
    hidden_size: int
    heads: int
    groups: int
    ffn: int
    vocab: int
    seq: int
    mbs_cap: int
    warmup: int
    steps: int
    rounds: int
    row_warmup: int
    row_steps: int
    long_seq: int


FULL = Sizes(16, 2048, 16, 4, 8192, 32000, 2048, mbs_cap=16, warmup=2, steps=4, rounds=2,
             row_warmup=2, row_steps=4, long_seq=4096)
TINY = Sizes(2, 64, 4, 2, 128, 512, 64, mbs_cap=4, warmup=1, steps=2, rounds=2, row_warmup=1,
             row_steps=2, long_seq=128)
# Held-out shapes (issue 47): the planner's rows at widths and depths no fit has seen. ``wide``:
# Llama 3 8B's layer (h 4096, 32 heads, 8 KV groups, FFN 14336, V 128256) at 4 of its 32 layers;
# ``small``: 24 layers of h 1024 (16 heads, no GQA), FFN 2816, V 50304 (a GPT-2-medium-sized
# LLaMA). ``--sizes wide --parts rows`` writes ``gpu_check_<gpu>_wide.*`` beside the main run.
WIDE = Sizes(4, 4096, 32, 8, 14336, 128256, 2048, mbs_cap=8, warmup=2, steps=4, rounds=2,
             row_warmup=2, row_steps=4, long_seq=4096)
SMALL = Sizes(24, 1024, 16, 16, 2816, 50304, 2048, mbs_cap=16, warmup=2, steps=4, rounds=2,
              row_warmup=2, row_steps=4, long_seq=4096)
SIZES = {"full": FULL, "tiny": TINY, "wide": WIDE, "small": SMALL}


# -- loom's side ------------------------------------------------------------------------------------

def loom_flags(sz: Sizes, mbs: int, seq: int, recompute: Optional[str] = None,
               compile: bool = False, device: str = "cuda") -> dict:
    """The run's loom flags (``LoomConfig.from_flat``): the model, bf16, one micro-batch of
    ``mbs`` sequences of ``seq`` tokens per step, mock data, no evaluation or logging."""
    flags = dict(num_layers=sz.num_layers, hidden_size=sz.hidden_size,
                 num_attention_heads=sz.heads, group_query_attention=True,
                 num_query_groups=sz.groups, ffn_hidden_size=sz.ffn, vocab_size=sz.vocab,
                 seq_length=seq, max_position_embeddings=seq, normalization="RMSNorm",
                 norm_epsilon=1e-6, position_embedding_type="rope", swiglu=True,
                 untie_embeddings_and_output_weights=True, disable_bias_linear=True,
                 hidden_dropout=0.0, attention_dropout=0.0, bf16=True,
                 micro_batch_size=mbs, global_batch_size=mbs, lr=3e-4, train_iters=1000,
                 mock_data=True, eval_iters=0, log_interval=10**9, no_progress_bar=True,
                 device=device)
    if recompute:
        flags["recompute_granularity"] = recompute
    if recompute == "full":
        flags.update(recompute_method="uniform", recompute_num_layers=1)
    if compile:
        flags["compile"] = True
    return flags


def loom_config(flags: dict):
    from loom.config import LoomConfig
    return LoomConfig.from_flat(flags).validate(1)


def planner_gpu(device_name: str) -> str:
    """The planner's row for a torch device name; ``H100-80GB`` for a CPU or an unknown device
    (the tiny CPU run predicts for an H100 too: same code path)."""
    from loom.planner.hardware import lookup_gpu
    gpu = lookup_gpu(device_name) if device_name else None
    return gpu.name if gpu else "H100-80GB"


def predict(flags: dict, gpu: str) -> dict:
    """The planner's prediction of this exact run (one GPU of kind ``gpu``)."""
    from loom.planner.hardware import make_cluster
    from loom.planner.predict import predict_layout
    return predict_layout(loom_config(flags), 1, cluster=make_cluster(gpu, 1, 1))


def model_flops(flags: dict) -> float:
    """Model FLOPs of one step (KOR eq. 7 generalized: the MFU numerator, no recompute)."""
    from loom.planner.flops import model_flops_per_iteration
    cfg = loom_config(flags)
    return model_flops_per_iteration(cfg.model, flags["global_batch_size"], flags["seq_length"])


@contextlib.contextmanager
def weights_on_device():
    """Draw every matrix on its device (normal 0.02) instead of loom's per-name CPU generator
    (``loom.parallel.registry.initialize``: ~8 s of CPU per 1B-parameter build); vectors
    (norms) keep their initializer. Speed and memory do not depend on the values."""
    import loom.parallel.parallelize as par
    from loom.parallel.registry import local_shard
    real = par.initialize

    @torch.no_grad()
    def on_device(module, registry, seed, tp_rank, tp_size, expert_tp=None):
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
                continue
            meta = registry[name]
            full = meta.init(tuple(meta.full_shape), torch.Generator().manual_seed(seed))
            rank, size = expert_tp if expert_tp and meta.expert_parallel else (tp_rank, tp_size)
            p.copy_(local_shard(full, meta, rank, size, name).to(p.dtype))
    par.initialize = on_device
    try:
        yield
    finally:
        par.initialize = real


@contextlib.contextmanager
def compile_backend(backend: str):
    """``nn.Module.compile`` with ``backend`` (loom's ``--compile`` calls it with none:
    inductor). ``eager`` (Dynamo only) keeps the tiny CPU test fast."""
    if backend == "inductor":
        yield
        return
    real = torch.nn.Module.compile

    def comp(self, *args, **kwargs):
        kwargs.setdefault("backend", backend)
        return real(self, *args, **kwargs)
    torch.nn.Module.compile = comp
    try:
        yield
    finally:
        torch.nn.Module.compile = real


# -- the device ------------------------------------------------------------------------------------

class Accel:
    """The device under test: synchronization, memory peaks (CUDA only), freeing."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.cuda else \
            f"cpu ({platform.processor() or platform.machine()})"

    def total_memory(self) -> Optional[int]:
        return torch.cuda.get_device_properties(self.device).total_memory if self.cuda else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        """Collect garbage, return the cached blocks, start a new peak."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> Optional[int]:
        """Bytes allocated now (CUDA only): a run's peak counts from here, so what an earlier
        run left allocated shows up instead of inflating the peak unseen."""
        return torch.cuda.memory_allocated(self.device) if self.cuda else None

    def peaks(self) -> dict:
        if not self.cuda:
            return {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
        return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device)}


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def attempt(accel: Accel, fn: Callable, *args) -> tuple[Optional[dict], Optional[str]]:
    """``(fn(*args), None)``, or ``(None, "oom")`` / ``(None, error)``; the device's memory is
    freed after either (outside the ``except``, once the traceback and its frames are gone)."""
    out = err = None
    try:
        out = fn(*args)
    except Exception as e:  # noqa: BLE001 - a part's failure is recorded, the others go on
        err = "oom" if is_oom(e) else one_line(e) + "\n" + traceback.format_exc()[-2000:]
    accel.free()
    return out, err


def _dynamo_counts() -> dict:
    try:
        from torch._dynamo.utils import counters
        return {"unique_graphs": counters["stats"]["unique_graphs"],
                "frames_ok": counters["frames"]["ok"],
                "recompiles": sum(counters["recompiles"].values())}
    except Exception:  # noqa: BLE001 - diagnostics only
        return {}


def run_loom(accel: Accel, flags: dict, warmup: int, steps: int, backend: str = "inductor") -> dict:
    """Build loom's Trainer for ``flags`` and run ``warmup + steps`` steps; step times (the
    trainer's own, synchronized), losses, memory peaks from the build on."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    accel.free()
    at_start = accel.allocated()
    t0 = time.monotonic()
    cfg = loom_config(flags)
    with weights_on_device(), compile_backend(backend):
        tr = Trainer(cfg, mesh=ParallelMesh.single(accel.device))
    build_s = time.monotonic() - t0
    recs = [tr.train_step() for _ in range(warmup + steps)]
    times = [r["step_time_s"] for r in recs]
    out = {"build_s": round(build_s, 2), "warmup_step_s": [round(t, 4) for t in times[:warmup]],
           "step_times_s": [round(t, 5) for t in times[warmup:]],
           "loss_first": recs[0]["loss"], "loss_last": recs[-1]["loss"], **accel.peaks(),
           "allocated_at_start_bytes": at_start}
    del tr, recs
    return out


def run_plain(accel: Accel, flags: dict, warmup: int, steps: int, backend: str = "inductor") -> dict:
    """The plain PyTorch loop at the same model and shapes (fresh build, random tokens)."""
    from benchmarks.plain_llama import PlainRunner
    accel.free()
    at_start = accel.allocated()
    t0 = time.monotonic()
    cfg = loom_config(flags)
    runner = PlainRunner(cfg.model, accel.device, compile_blocks=bool(flags.get("compile")),
                         compile_backend=backend)
    b, s, V = flags["micro_batch_size"], flags["seq_length"], flags["vocab_size"]
    g = torch.Generator(device=accel.device).manual_seed(0)
    data = torch.randint(0, V, (warmup + steps, b, s + 1), device=accel.device, generator=g)
    build_s = time.monotonic() - t0
    times, losses = [], []
    for i in range(warmup + steps):
        accel.sync()
        start = time.perf_counter()
        losses.append(runner.step(data[i, :, :-1], data[i, :, 1:]))
        accel.sync()
        times.append(time.perf_counter() - start)
    out = {"build_s": round(build_s, 2), "warmup_step_s": [round(t, 4) for t in times[:warmup]],
           "step_times_s": [round(t, 5) for t in times[warmup:]],
           "loss_first": losses[0], "loss_last": losses[-1], **accel.peaks(),
           "allocated_at_start_bytes": at_start}
    del runner, data
    return out


ARMS = {"loom": run_loom, "plain": run_plain}


# -- micro-batch ------------------------------------------------------------------------------------

def powers_of_two(cap: int) -> list[int]:
    return [1 << i for i in range(cap.bit_length()) if 1 << i <= cap]


def planner_start(sz: Sizes, gpu: str, memory: Optional[int], device: str = "cuda") -> int:
    """The largest power-of-two micro-batch (<= ``mbs_cap``) whose predicted memory, reserve
    included, is at most 95% of the device's (``memory``; the planner's row without one)."""
    best = 1
    for mbs in powers_of_two(sz.mbs_cap):
        p = predict(loom_flags(sz, mbs, sz.seq, device=device), gpu)
        if p["memory_bytes"]["total"] <= 0.95 * (memory or p["hbm_bytes"]):
            best = mbs
    return best


def search_micro_batch(fits: Callable[[int], bool], start: int, cap: int) -> tuple:
    """The largest power of two <= ``cap`` that ``fits``, from ``start``: up (doubling) while it
    fits, else down (halving) until it fits. Returns ``(mbs or None, [(mbs, fits)] probed)``."""
    probes = [(start, fits(start))]
    if probes[-1][1]:
        m = start
        while 2 * m <= cap:
            probes.append((2 * m, fits(2 * m)))
            if not probes[-1][1]:
                break
            m *= 2
        return m, probes
    m = start
    while m > 1:
        m //= 2
        probes.append((m, fits(m)))
        if probes[-1][1]:
            return m, probes
    return None, probes


# -- speed ------------------------------------------------------------------------------------------

def summarize_arm(runs: list[dict], flags: dict, peak_flops: Optional[float]) -> dict:
    """Median step over every measured step of the arm's runs; tokens/s; MFU (model FLOPs over
    step time and the GPU's peak); per-run medians."""
    steps = [t for r in runs for t in r["step_times_s"]]
    med = statistics.median(steps)
    tokens = flags["micro_batch_size"] * flags["seq_length"]
    flops = model_flops(flags)
    return {"mbs": flags["micro_batch_size"], "median_step_s": med, "step_times_s": steps,
            "run_medians_s": [statistics.median(r["step_times_s"]) for r in runs],
            "tokens_per_s": tokens / med, "model_tflops": flops / med / 1e12,
            "mfu": flops / med / peak_flops if peak_flops else None,
            "peak_allocated_bytes": max((r["peak_allocated_bytes"] or 0) for r in runs) or None,
            "peak_reserved_bytes": max((r["peak_reserved_bytes"] or 0) for r in runs) or None,
            "build_s": [r["build_s"] for r in runs], "warmup_step_s": [r["warmup_step_s"]
                                                                      for r in runs],
            "loss_first": runs[0]["loss_first"], "loss_last": runs[-1]["loss_last"]}


def speed(accel: Accel, sz: Sizes, mbs: int, compiled: bool, backend: str,
          peak_flops: Optional[float], clock: "Clock", part: str) -> dict:
    """loom and the plain loop alternating, A B A B (``rounds``), each run a fresh build at
    micro-batch ``mbs`` (an arm that runs out of memory halves its own); per arm the summary,
    and the ratio of tokens/s."""
    dev = accel.device.type
    arm_mbs = {arm: mbs for arm in ARMS}
    runs: dict = {arm: [] for arm in ARMS}
    notes = []
    for r in range(sz.rounds):
        if r and not clock.fits_round(part):
            notes.append(f"rounds after {r}: skipped (time budget)")
            break
        for arm, fn in ARMS.items():
            while arm_mbs[arm]:
                flags = loom_flags(sz, arm_mbs[arm], sz.seq, compile=compiled, device=dev)
                res, err = attempt(accel, fn, accel, flags, sz.warmup, sz.steps, backend)
                if res is not None:
                    runs[arm].append({**res, "mbs": arm_mbs[arm]})
                    break
                if err != "oom" or arm_mbs[arm] == 1:
                    notes.append(f"{arm} b{arm_mbs[arm]}: {err.splitlines()[0]}")
                    runs[arm].append({"error": err})
                    arm_mbs[arm] = 0
                    break
                notes.append(f"{arm} b{arm_mbs[arm]}: out of memory, halved")
                arm_mbs[arm] //= 2
    out = {"compiled": compiled, "rounds": len(runs["loom"]), "notes": notes}
    for arm in ARMS:
        ok = [x for x in runs[arm] if "error" not in x]
        ok = [x for x in ok if x["mbs"] == ok[0]["mbs"]]  # (an arm that halved in round 2)
        out[arm] = summarize_arm(ok, loom_flags(sz, ok[0]["mbs"], sz.seq, compile=compiled,
                                                device=dev), peak_flops) if ok else \
            {"error": next((x["error"] for x in runs[arm]), "not run")}
    if "tokens_per_s" in out["loom"] and "tokens_per_s" in out["plain"]:
        out["loom_over_plain_tokens_per_s"] = out["loom"]["tokens_per_s"] / \
            out["plain"]["tokens_per_s"]
    if compiled:
        out["dynamo"] = _dynamo_counts()
    return out


# -- planner rows -----------------------------------------------------------------------------------

def row_configs(sz: Sizes, mbs: int) -> list[tuple]:
    """``(name, mbs, seq, recompute)`` of the planner rows at the micro-batch found."""
    half = max(1, mbs // 2)
    rows = [(mbs, sz.seq, None), (half, sz.seq, None), (mbs, sz.seq, "selective"),
            (mbs, sz.seq, "full"), (half, sz.long_seq, None)]
    seen, out = set(), []
    for b, s, rc in rows:
        if (b, s, rc) not in seen:
            seen.add((b, s, rc))
            out.append((f"b{b} s{s} {rc or 'none'}", b, s, rc))
    return out


def pct(pred: Optional[float], meas: Optional[float]) -> Optional[float]:
    return None if not pred or not meas else round(100.0 * (pred - meas) / meas, 1)


def planner_row(name: str, flags: dict, measured: Optional[dict], status: str, gpu: str,
                meta: dict, peak_flops: Optional[float]) -> dict:
    """One row of the format the module docstring gives (measured None: not measured)."""
    p = predict(flags, gpu)
    mem = p["memory_bytes"]
    row = {"source": "loom gpu-check", "name": name, "status": status, "gpu": gpu, **meta,
           "world_size": 1, "config": flags, "layout": p["layout"],
           "global_batch_size": flags["global_batch_size"], "seq_length": flags["seq_length"],
           "predicted": {"step_time_s": p["time_s"]["iteration"],
                         "time_s": {k: v for k, v in p["time_s"].items() if v},
                         "memory_bytes": mem, "mfu": p["mfu"], "fits": p["fits"]}}
    if measured:
        med = statistics.median(measured["step_times_s"])
        flops = model_flops(flags)
        row["measured"] = {
            "step_time_s": med, "step_times_s": measured["step_times_s"],
            "peak_allocated_bytes": measured["peak_allocated_bytes"],
            "peak_reserved_bytes": measured["peak_reserved_bytes"],
            "tokens_per_s": flags["global_batch_size"] * flags["seq_length"] / med,
            "mfu": flops / med / peak_flops if peak_flops else None,
            "build_s": measured.get("build_s")}
        row["error_pct"] = {
            "step_time": pct(p["time_s"]["iteration"], med),
            # allocated: the tensors; the planner's terms without its reserve
            "allocated_vs_total_less_reserve": pct(mem["total"] - mem["reserve"],
                                                   measured["peak_allocated_bytes"]),
            # reserved: what the allocator took from the device; the planner's total
            "reserved_vs_total": pct(mem["total"], measured["peak_reserved_bytes"])}
    return row


def planner_rows(accel: Accel, sz: Sizes, mbs: int, first: Optional[dict], gpu: str, meta: dict,
                 peak_flops: Optional[float], clock: "Clock", part: str) -> list[dict]:
    """Measure each row (the first, b = ``mbs`` without recompute, is the speed part's loom
    run ``first`` when given) and pair it with the planner's prediction."""
    rows = []
    configs = row_configs(sz, mbs)
    for i, (name, b, s, rc) in enumerate(configs):
        flags = loom_flags(sz, b, s, rc, device=accel.device.type)
        if i == 0 and first is not None:
            res, err = first, None
        elif not clock.fits(part, fraction=1.0 / max(1, len(configs) - 1)):
            rows.append(planner_row(name, flags, None, "skipped: time budget", gpu, meta,
                                    peak_flops))
            continue
        else:
            res, err = attempt(accel, run_loom, accel, flags, sz.row_warmup, sz.row_steps)
        status = "ok" if res else ("oom" if err == "oom" else f"error: {err.splitlines()[0]}")
        rows.append(planner_row(name, flags, res, status, gpu, meta, peak_flops))
    return rows


def same_shape_ratio(res: dict, sz: Sizes) -> None:
    """When the plain loop ran at a smaller micro-batch than loom (out of memory), loom's
    tokens/s at that micro-batch from the planner rows over the plain loop's:
    ``speed["loom_over_plain_same_mbs"]`` (same shapes, not alternated)."""
    sp = res.get("speed") or {}
    plain, loom = sp.get("plain", {}), sp.get("loom", {})
    if "tokens_per_s" not in plain or plain["mbs"] == loom.get("mbs"):
        return
    name = f"b{plain['mbs']} s{sz.seq} none"
    row = next((r for r in res.get("rows") or [] if r["name"] == name and "measured" in r), None)
    if row:
        sp["loom_over_plain_same_mbs"] = row["measured"]["tokens_per_s"] / plain["tokens_per_s"]


# -- the CUDA tier ---------------------------------------------------------------------------------

def read_junit(path: str) -> list[dict]:
    """``[{"test", "outcome", "message", "properties"}]`` from pytest's junit XML."""
    out = []
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                message = (el.get("message") or el.text or "").strip().splitlines()[0][:300] \
                    if (el.get("message") or el.text) else ""
                break
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        out.append({"test": case.get("name"), "outcome": outcome, "message": message,
                    "properties": props})
    return out


def tier_command(xml: Path) -> list[str]:
    """``pytest -m cuda tests/cuda`` (the folder alone: other test modules import packages the
    GPU machine lacks), file order, junit XML to ``xml``."""
    return [sys.executable, "-m", "pytest", "-m", "cuda", "tests/cuda", "-v", "-rs",
            "-p", "no:randomly", "-p", "no:cacheprovider", f"--junitxml={xml}",
            "-o", "junit_family=xunit1"]  # xunit1: the tests' record_property values


def cuda_tier(out_dir: Path, timeout: float) -> dict:
    """The CUDA tier in a subprocess (:func:`tier_command`); its junit XML and log go to
    ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    xml, log = out_dir / "cuda_tier.xml", out_dir / "cuda_tier.log"
    xml.unlink(missing_ok=True)  # (a previous run's)
    cmd = tier_command(xml)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    t0 = time.monotonic()
    with open(log, "w") as fh:  # its own session: a timeout ends the spawned ranks too
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            status = f"exit {proc.wait(timeout=timeout)}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timed out after {timeout:.0f} s (the log has the tests that finished)"
    res = {"command": " ".join(cmd[1:]), "status": status,
           "seconds": round(time.monotonic() - t0, 1), "tests": []}
    if xml.exists():
        res["tests"] = read_junit(str(xml))
    return res


# -- time -------------------------------------------------------------------------------------------

def estimate(sz: Sizes = FULL, gpu: str = "H100-80GB", mbs: Optional[int] = None) -> dict:
    """The script's own run time on ``gpu`` (seconds by part, ``total``): every step it runs
    at the planner's step time for that run, plus :data:`ALLOW` (start-up, the tier, builds,
    first steps, compilation). ``mbs``: the micro-batch (default the planner's start).
    ``round``: one A B round of ``speed`` and of ``compile`` (after the first compilation)."""
    mbs = mbs or planner_start(sz, gpu, None)
    step = {}

    def t(b: int, s: int = sz.seq, rc: Optional[str] = None) -> float:
        if (b, s, rc) not in step:
            step[(b, s, rc)] = predict(loom_flags(sz, b, s, rc), gpu)["time_s"]["iteration"]
        return step[(b, s, rc)]

    def run(b: int, n: int, s: int = sz.seq, rc: Optional[str] = None) -> float:
        return ALLOW["build"] + ALLOW["first_step"] + n * t(b, s, rc)
    n = sz.warmup + sz.steps
    rounds = {"speed": 2 * run(mbs, n), "compile": 2 * (run(mbs, n) + ALLOW["recompile"])}
    # the probe that fits (2 steps), and the one above it, when there is one, out of memory
    # in its first step
    up = ALLOW["build"] + t(2 * mbs) if 2 * mbs <= sz.mbs_cap else 0.0
    parts = {"startup": ALLOW["startup"], "tier": ALLOW["tier"], "search": run(mbs, 2) + up,
             "speed": sz.rounds * rounds["speed"],
             "rows": sum(run(b, sz.row_warmup + sz.row_steps, s, rc)
                         for _, b, s, rc in row_configs(sz, mbs)[1:]),
             "attention": ALLOW["attention"],
             "compile": 2 * ALLOW["compile"] + sz.rounds * rounds["compile"]}
    parts["total"] = sum(parts.values())
    return {k: round(v, 1) for k, v in parts.items()} | {
        "mbs": mbs, "gpu": gpu, "round": {k: round(v, 1) for k, v in rounds.items()}}


class Clock:
    """The run's time budget: a part is started only when the estimate of what it costs fits
    what is left (``fits``); a speed part's next round likewise (``fits_round``)."""

    def __init__(self, budget: float, est: dict, start: Optional[float] = None):
        self.start = time.monotonic() if start is None else start
        self.budget, self.est = budget, est

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()

    def fits(self, part: str, fraction: float = 1.0) -> bool:
        return self.est.get(part, 0.0) * fraction <= self.left()

    def fits_round(self, part: str) -> bool:
        return self.est["round"].get(part, 0.0) <= self.left()

    def fits_start(self, part: str, rounds: int) -> bool:
        """Whether ``part`` can start: all of it, or for a speed part its first round."""
        later = (rounds - 1) * self.est["round"].get(part, 0.0)
        return self.est.get(part, 0.0) - later <= self.left()


# -- output -----------------------------------------------------------------------------------------

def _cell(text, n: int = 200) -> str:
    """One markdown table cell: one line, no ``|``, at most ``n`` characters."""
    return " ".join(str(text).split()).replace("|", "/")[:n]


def _gb(x) -> str:
    return "-" if not x else f"{x / 2**30:.1f} GiB"


def _pc(x) -> str:
    return "-" if x is None else f"{x:+.0f}%"


def table(res: dict) -> str:
    """The one table: tier outcomes, speed arms and ratios, planner rows, anchors."""
    head = (f"loom gpu-check: {res['device_name']} (planner row {res['gpu']}), torch "
            f"{res['torch']}, CUDA {res['cuda']}, {res['date']}, {res.get('seconds', 0):.0f} s "
            f"(estimate {res['estimate']['total']:.0f} s)")
    lines = [head, "", "| part | case | measured | planner / reference |", "|---|---|---|---|"]
    tier = res.get("tier")
    if tier:
        if not tier["tests"]:
            lines.append(f"| CUDA tier | pytest -m cuda tests/cuda | {tier['status']} | |")
        for t in tier["tests"]:
            props = "; ".join(f"{k} {v}" for k, v in t["properties"].items())
            lines.append(f"| CUDA tier | {_cell(t['test'])} | "
                         f"{_cell(t['outcome'] + ' ' + t['message'], 160)} | {_cell(props)} |")
    for key, label in (("speed", "eager"), ("compile", "--compile")):
        sp = res.get(key)
        if not isinstance(sp, dict) or "loom" not in sp:
            if sp:
                lines.append(f"| speed | {label} | {_cell(sp)} | |")
            continue
        for arm in ARMS:
            a = sp[arm]
            if "error" in a:
                lines.append(f"| speed | {arm} {label} | {_cell(a['error'].splitlines()[0])} | |")
                continue
            mfu = f", MFU {100 * a['mfu']:.1f}%" if a["mfu"] else ""
            lines.append(f"| speed | {arm} {label} b{a['mbs']} | {a['tokens_per_s']:,.0f} tok/s, "
                         f"{a['median_step_s']:.4f} s/step{mfu}, peak {_gb(a['peak_allocated_bytes'])}"
                         f" | {a['model_tflops']:.1f} model TFLOP/s |")
        if "loom_over_plain_tokens_per_s" in sp:
            lines.append(f"| speed | loom / plain {label} | "
                         f"{sp['loom_over_plain_tokens_per_s']:.3f} x tokens/s | A B x "
                         f"{sp['rounds']} rounds, medians |")
        if "loom_over_plain_same_mbs" in sp:
            lines.append(f"| speed | loom / plain {label} b{sp['plain']['mbs']} | "
                         f"{sp['loom_over_plain_same_mbs']:.3f} x tokens/s | loom from the "
                         f"planner row at the plain loop's micro-batch |")
        for note in sp.get("notes", []):
            lines.append(f"| speed | {label} note | {_cell(note)} | |")
    for row in res.get("rows") or []:
        pred = row["predicted"]
        ptxt = (f"{pred['step_time_s']:.4f} s, {_gb(pred['memory_bytes']['total'])} "
                f"({_gb(pred['memory_bytes']['total'] - pred['memory_bytes']['reserve'])} "
                f"less reserve)")
        if "measured" not in row:
            lines.append(f"| planner | {row['name']} | {_cell(row['status'])} | {ptxt} |")
            continue
        m, e = row["measured"], row["error_pct"]
        lines.append(f"| planner | {row['name']} | {m['step_time_s']:.4f} s, alloc "
                     f"{_gb(m['peak_allocated_bytes'])}, reserved {_gb(m['peak_reserved_bytes'])}"
                     f" | {ptxt}; step {_pc(e['step_time'])}, alloc "
                     f"{_pc(e['allocated_vs_total_less_reserve'])}, reserved "
                     f"{_pc(e['reserved_vs_total'])} |")
    att = res.get("attention")
    if isinstance(att, dict):
        lines.append(f"| attention | causal SDPA | {_cell(att.get('error'))} | |")
    for r in att if isinstance(att, list) else []:
        case = f"{r['backend']} b{r['b']} a{r['heads']} s{r['s']} d{r['d']}"
        plan = r["planner_ms"]
        ptxt = (f"{plan['shipped']:.3f} ms all blocks, {plan['causal_skip']:.3f} ms causal "
                f"half")
        if r["status"] != "ok":
            lines.append(f"| attention | {case} | {_cell(r['status'], 120)} | {ptxt} |")
            continue
        ratio = r["measured_over_planner"]
        lines.append(f"| attention | {case} | {r['ms']:.3f} ms fwd+bwd | {ptxt}; measured / "
                     f"planner {ratio['shipped']:.2f} / {ratio['causal_skip']:.2f} |")
    for what, value, source in ANCHORS:
        lines.append(f"| anchor | {what} | {value} | {source} |")
    for part, why in res.get("skipped", {}).items():
        lines.append(f"| skipped | {part} | {_cell(why)} | |")
    return "\n".join(lines)


def write(res: dict, results_dir: Path, out_dir: Optional[Path]) -> list[Path]:
    """The JSON, the rows' JSONL and the table, in ``results_dir`` and ``out_dir``."""
    held_out = res.get("sizes_name") not in (None, "full", "tiny")
    stem = (f"gpu_check_{res['gpu'].lower()}" + (f"_{res['sizes_name']}" if held_out else "")
            + ("" if res["device_type"] == "cuda" else "_cpu"))
    files = []
    for d in filter(None, (results_dir, out_dir)):
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        with open(d / f"{stem}_runs.jsonl", "w") as fh:
            for row in res.get("rows") or []:
                fh.write(json.dumps(row, default=str) + "\n")
        files += [d / f"{stem}.json", d / f"{stem}_runs.jsonl"]
    if out_dir:
        (out_dir / f"{stem}.md").write_text(table(res) + "\n")
    return files


# -- main -------------------------------------------------------------------------------------------

def main(argv: Optional[list] = None, started: Optional[float] = None) -> int:
    """The command line (see the module); ``started``: when the budget began (default now)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda; without CUDA "
                                                   "the script measures nothing)")
    ap.add_argument("--sizes", choices=sorted(SIZES), default="full")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ",".join(PARTS))
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds (default 360)")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--mbs", type=int, default=None, help="skip the search: this micro-batch")
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="also copy the results here (default $OUT)")
    args = ap.parse_args(argv)
    if args.device is None:
        if not torch.cuda.is_available():
            print(NO_CUDA)
            return 0
        args.device = "cuda"
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown part(s) {sorted(unknown)}: choose from {','.join(PARTS)}")
    sz = SIZES[args.sizes]
    accel = Accel(torch.device(args.device))
    name = accel.name()
    gpu = planner_gpu(name if accel.cuda else "")
    from loom.planner.hardware import make_cluster
    peak = make_cluster(gpu, 1, 1).peak_flops if accel.cuda else None
    out_dir = Path(args.out) if args.out else None
    results_dir = Path(args.results_dir)
    est = estimate(sz, gpu, mbs=args.mbs)
    clock = Clock(args.budget, est, start=started)
    meta = {"device_name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}
    res = {"gpu": gpu, "device_type": accel.device.type, **meta, "sizes_name": args.sizes,
           "sizes": asdict(sz),
           "python": platform.python_version(), "estimate": est, "budget_s": args.budget,
           "allowances_s": ALLOW, "anchors": ANCHORS, "skipped": {}}
    print(f"gpu-check on {name} (planner row {gpu}), torch {torch.__version__}: parts "
          f"{','.join(parts)}; own estimate {est['total']:.0f} s of {args.budget:.0f} "
          f"({', '.join(f'{k} {est[k]:.0f}' for k in ('startup',) + PARTS[:1] + ('search',) + PARTS[1:])})",
          flush=True)

    def done(part: str, t0: float) -> None:
        res.setdefault("part_seconds", {})[part] = round(time.monotonic() - t0, 1)
        res["seconds"] = round(clock.elapsed(), 1)
        write(res, results_dir, out_dir)
        print(f"[{clock.elapsed():6.0f} s] {part} done", flush=True)

    def start(part: str) -> Optional[float]:
        if part not in parts:
            return None
        if not clock.fits_start(part, sz.rounds):
            res["skipped"][part] = (f"time budget: {clock.left():.0f} s left, estimate "
                                    f"{clock.est.get(part, 0):.0f} s")
            return None
        return time.monotonic()

    if (t0 := start("tier")) is not None:
        res["tier"] = cuda_tier(out_dir or results_dir, timeout=min(2 * ALLOW["tier"],
                                                       max(30.0, clock.left() - 60.0)))
        done("tier", t0)
    mbs = args.mbs
    if mbs is None and any(p in parts for p in ("speed", "rows", "compile")):
        t0 = time.monotonic()
        first = planner_start(sz, gpu, accel.total_memory(), args.device)

        def fits(m: int) -> bool:
            flags = loom_flags(sz, m, sz.seq, device=args.device)
            got, err = attempt(accel, run_loom, accel, flags, 0, 2)
            res.setdefault("probes", []).append({"mbs": m, "result": got, "error": err})
            if err and err != "oom":
                raise RuntimeError(f"micro-batch probe b{m}: {err}")
            return got is not None
        try:
            mbs, probes = search_micro_batch(fits, first, sz.mbs_cap)
            res["micro_batch"] = {"planner_start": first, "found": mbs, "probes": probes}
        except RuntimeError as e:  # loom fails (not out of memory): the parts still run
            # at the planner's micro-batch, so the plain loop is measured and loom's failure
            # recorded in each part
            mbs = first
            res["micro_batch"] = {"planner_start": first, "found": None, "error": str(e),
                                  "used": f"b{first}, the planner's start (loom's probe failed)"}
        done("search", t0)
    if mbs and mbs != est["mbs"]:  # the parts' costs at the micro-batch found
        clock.est = res["estimate_at_found_mbs"] = estimate(sz, gpu, mbs=mbs)
    speed_loom = None
    if mbs and (t0 := start("speed")) is not None:
        res["speed"] = speed(accel, sz, mbs, False, args.compile_backend, peak, clock, "speed")
        ok = res["speed"]["loom"]
        if "error" not in ok and ok["mbs"] == mbs:  # the first planner row
            speed_loom = {"step_times_s": ok["step_times_s"],
                          "peak_allocated_bytes": ok["peak_allocated_bytes"],
                          "peak_reserved_bytes": ok["peak_reserved_bytes"],
                          "build_s": ok["build_s"][0]}
        done("speed", t0)
    if mbs and (t0 := start("rows")) is not None:
        res["rows"] = planner_rows(accel, sz, mbs, speed_loom, gpu, meta, peak, clock, "rows")
        done("rows", t0)
    same_shape_ratio(res, sz)
    if (t0 := start("attention")) is not None:
        from benchmarks.attention_kernels import FULL_SHAPES, TINY_SHAPES, measure
        try:
            res["attention"] = measure(accel.device, TINY_SHAPES if sz is TINY else FULL_SHAPES,
                                       gpu)
        except Exception as e:  # noqa: BLE001 - a broken part is recorded, the rest still runs
            res["attention"] = {"error": one_line(e)}
        done("attention", t0)
    if mbs and (t0 := start("compile")) is not None:
        res["compile"] = speed(accel, sz, mbs, True, args.compile_backend, peak, clock,
                               "compile")
        done("compile", t0)
    if not mbs and any(p in parts for p in ("speed", "rows", "compile")):
        res["skipped"]["speed, rows, compile"] = f"no micro-batch fits: {res.get('micro_batch')}"
    res["seconds"] = round(clock.elapsed(), 1)
    files = write(res, results_dir, out_dir)
    print()
    print(table(res))
    print(f"\nwrote {', '.join(str(f) for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(started=STARTED))
