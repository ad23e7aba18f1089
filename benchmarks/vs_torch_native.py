"""loom against PyTorch-native parallelism on the reference work (CPU, gloo, fp32).

Reference work: 4 layers, h 256, 4 heads, FFN 1024, V 8192, s 256, global batch 8, fp32, no
linear biases, untied output, AdamW (lr 3e-4 constant, wd 0.01 on matrices, no clipping), no
dropout. Both sides start from loom's seed-1234 weights (the native model copies the
single-process loom model's parameters, see ``native_parallel.py``) and read the same samples
(loom's mock dataset and micro-batch sampler), so their losses must agree (checked: first step
rtol 1e-4, last step 1e-3).

Per layout, the two run alternately in fresh spawned worlds, loom first then native, ``--repeats``
times (A B A B A B). A run does ``--warmup`` + ``--steps`` steps, each after a barrier; a step's
time is the slowest rank's, a run's time the median over its measured steps, a layout's the
median over runs. CPU s/step is the same statistic of ``time.process_time()`` (all threads of
the rank's process; blocking waits excluded): on a shared machine it is far steadier than wall
time, but it does not see waiting, i.e. pipeline bubbles and exposed communication. Peak RSS: ``ru_maxrss`` of each rank process (its whole life: imports, model,
optimizer state, activations), max over ranks. One thread per rank. Prints one JSON line per
layout, then a markdown table.

GEMM floor (``gemm_floor_s``): linear-layer GEMM FLOPs per step (QKV, projection, FC1, FC2
and the output layer; forward + 2 backward GEMMs, split by t) at this machine's fp32 GEMM rate
(``loom.planner.calibrate.measure_gemm_flops``, the planner's calibration, measured once before
the layouts): the slowest rank's on one core, or all ranks' on the cores they share, whichever
is longer. ``gemm_share`` = floor / step time: the part of the step no implementation of
the same math can remove on this machine (attention's own GEMMs are not counted).

``--thp``: both sides run with ``THP_MEM_ALLOC_ENABLE=1`` (PyTorch's CPU allocator then backs
tensors of 2 MiB and more with transparent huge pages): on this VM a fresh multi-MiB tensor's
4 KiB page faults cost ~0.6 ms per MiB, and that cost falls on both sides' activations.

``--compile``: both sides compile every transformer block (loom ``--compile``; native: each
block ``torch.compile``'d after TP, before FSDP2 / DDP, as torchtitan does); use ``--warmup 2``
or more so the compilation stays out of the measured steps.

    OMP_NUM_THREADS=1 python -m benchmarks.vs_torch_native [--layouts 1 dp2 tp2 ...] [--compile]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch

from loom.config import LoomConfig, ModelConfig
from testkit import run_distributed

# name: (tp, pp, dp, sequence_parallel, micro_batch, native data-parallel kind, schedule)
LAYOUTS = {
    "1": (1, 1, 1, False, 8, "none", "1f1b"),
    "dp2": (1, 1, 2, False, 4, "ddp", "1f1b"),
    "dp2-fsdp2": (1, 1, 2, False, 4, "fsdp2", "1f1b"),
    "tp2": (2, 1, 1, False, 8, "none", "1f1b"),
    "tp2-sp": (2, 1, 1, True, 8, "none", "1f1b"),
    "pp2-1f1b": (1, 2, 1, False, 2, "none", "1f1b"),
    "pp2-gpipe": (1, 2, 1, False, 2, "none", "gpipe"),
    "dp4": (1, 1, 4, False, 2, "ddp", "1f1b"),
    "tp4": (4, 1, 1, False, 8, "none", "1f1b"),
    "pp4-1f1b": (1, 4, 1, False, 2, "none", "1f1b"),
    "tp2xdp2": (2, 1, 2, False, 4, "fsdp2", "1f1b"),
    "pp2xdp2": (1, 2, 2, False, 2, "fsdp2", "1f1b"),  # DDP + pipelining: reducer assert
    "tp2xpp2": (2, 2, 1, False, 2, "none", "1f1b"),
}
NATIVE_NAME = {"none": "", "ddp": "DDP", "fsdp2": "FSDP2"}


def reference_config(tp: int, pp: int, dp: int, sp: bool, micro: int, schedule: str,
                     steps: int) -> LoomConfig:
    cfg = LoomConfig(model=ModelConfig.gpt2(
        num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024,
        seq_length=256, vocab_size=8192, hidden_dropout=0.0, attention_dropout=0.0,
        disable_bias_linear=True, untie_embeddings_and_output_weights=True))
    p, t = cfg.parallel, cfg.training
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = tp, pp
    p.sequence_parallel, p.pipeline_schedule = sp, schedule
    p.ddp_bucket_size = None  # loom's default rule (loom.parallel.grad_buffer.default_bucket_size)
    p.overlap_grad_reduce = True  # as DDP: bucket all-reduces overlap backward
    t.micro_batch_size, t.global_batch_size, t.train_iters = micro, 8, steps
    t.lr_decay_style, t.clip_grad = "constant", 0.0
    t.lr, t.adam_beta2 = 3e-4, 0.95  # loom's defaults before issue 21: numbers stay comparable
    cfg.data.mock_data = True
    cfg.logging.log_interval, cfg.logging.no_progress_bar = 10**6, True
    return cfg.validate(tp * pp * dp)


def gemm_flops(layout: tuple, cfg: LoomConfig) -> tuple[float, float]:
    """Linear-layer GEMM FLOPs per step (forward + backward = 3 x 2 m n k): ``(slowest rank,
    all ranks)``; the slowest rank is a last pipeline stage, which also holds the output
    layer."""
    tp, pp, dp = layout[:3]
    m = cfg.model
    h, f, V = m.hidden_size, m.ffn_size, m.padded_vocab(tp)
    tokens = cfg.training.global_batch_size * m.seq_length
    per_layer = h * 3 * h + h * h + 2 * h * f  # QKV (a = g), projection, FC1, FC2
    last_stage = (m.num_layers // pp) * per_layer + h * V
    total = m.num_layers * per_layer + h * V
    return 6.0 * tokens / dp * last_stage / tp, 6.0 * tokens * total


def gemm_floor_s(layout: tuple, cfg: LoomConfig, rate: float, cores: int) -> float:
    """Seconds no implementation of the same math can beat here: the slowest rank's GEMMs at
    ``rate`` FLOP/s, or all ranks' GEMMs at ``rate`` per core on ``min(cores, ranks)`` cores,
    whichever is longer (ranks sharing cores share their rate only while they all compute,
    which pipelines do not)."""
    rank, total = gemm_flops(layout, cfg)
    world = layout[0] * layout[1] * layout[2]
    return max(rank / rate, total / (rate * min(cores, world)))


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_loom(layout: tuple, steps: int, compile_layers: bool = False) -> dict:
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    tp, pp, dp, sp, micro, _, schedule = layout
    cfg = reference_config(tp, pp, dp, sp, micro, schedule, steps)
    cfg.training.compile = compile_layers
    world = tp * pp * dp
    mesh = ParallelMesh.build(tp=tp, pp=pp, dp=dp) if world > 1 else ParallelMesh.single()
    tr = Trainer(cfg, mesh=mesh)
    times, cpus, losses = [], [], []
    for _ in range(steps):
        if world > 1:
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples))
        tr.optimizer_step()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        tr.consumed_samples += tr.global_batch
        losses.append(tr.global_loss(loss))
    return {"times": times, "cpu": cpus, "losses": losses, "rss_mib": _rss_mib()}


def run_native(layout: tuple, steps: int, compile_layers: bool = False) -> dict:
    import torch.distributed as dist

    from loom.data.gpt_dataset import MockGPTDataset
    from loom.data.sampler import get_batch, microbatch_indices
    from benchmarks.native_parallel import NativeRunner
    tp, pp, dp, sp, micro, dp_kind, schedule = layout
    cfg = reference_config(tp, pp, dp, sp, micro, schedule, steps)
    world = tp * pp * dp
    runner = NativeRunner(cfg, dp, pp, tp, sp, dp_kind, schedule, compile_layers)
    m = cfg.model
    ds = MockGPTDataset(m.vocab_size, m.seq_length, cfg.training.seed)
    dp_rank = runner.mesh["dp"].get_local_rank()
    tp_rank = runner.mesh["tp"].get_local_rank()
    n_micro = 8 // (micro * dp)
    times, cpus, losses = [], [], []
    for step in range(steps):
        idx = microbatch_indices(step * 8, micro, n_micro, dp_rank, dp)
        batches = [get_batch(ds, i) for i in idx]
        if world > 1:
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = runner.step(batches)
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        share = loss / dp if loss is not None and tp_rank == 0 else 0.0
        if world > 1:
            t = torch.tensor([share], dtype=torch.float64)
            dist.all_reduce(t)
            share = float(t)
        losses.append(share)
    return {"times": times, "cpu": cpus, "losses": losses, "rss_mib": _rss_mib()}


def measure(name: str, repeats: int, warmup: int, steps: int, compile_layers: bool,
            gemm_rate: float) -> dict:
    layout = LAYOUTS[name]
    tp, pp, dp = layout[:3]
    world = tp * pp * dp
    impls = {"loom": (run_loom, (compile_layers,)), "native": (run_native, (compile_layers,))}
    runs = {k: [] for k in impls}
    cpu = {k: [] for k in impls}
    rss = {k: [] for k in impls}
    losses = {}
    for _ in range(repeats):
        for impl, (fn, extra) in impls.items():
            res = run_distributed(world, fn, layout, warmup + steps, *extra, timeout=1800)
            per_step = [max(r["times"][i] for r in res) for i in range(warmup, warmup + steps)]
            runs[impl].append(statistics.median(per_step))
            cpu[impl].append(statistics.median(
                max(r["cpu"][i] for r in res) for i in range(warmup, warmup + steps)))
            rss[impl].append(max(r["rss_mib"] for r in res))
            losses[impl] = res[0]["losses"]
    med = {k: statistics.median(v) for k, v in runs.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}

    def same(a: str) -> bool:
        first = abs(losses[a][0] - losses["native"][0]) / abs(losses["native"][0])
        last = abs(losses[a][-1] - losses["native"][-1]) / abs(losses["native"][-1])
        return first < 1e-4 and last < 1e-3

    floor = gemm_floor_s(layout, reference_config(*layout[:5], layout[6], 1), gemm_rate,
                         os.cpu_count() or 1)
    return {"layout": name, "tp": tp, "pp": pp, "dp": dp, "sp": layout[3],
            "gemm_floor_s": round(floor, 4),
            "gemm_share_loom": round(floor / med["loom"], 3),
            "gemm_share_native": round(floor / med["native"], 3),
            "compile": compile_layers,
            "native": native_label(layout), "ranks": world,
            "loom_s_per_step": round(med["loom"], 4), "native_s_per_step": round(med["native"], 4),
            "ratio_loom_over_native": round(med["loom"] / med["native"], 3),
            "loom_cpu_s_per_step": round(cmed["loom"], 4),
            "native_cpu_s_per_step": round(cmed["native"], 4),
            "cpu_ratio_loom_over_native": round(cmed["loom"] / cmed["native"], 3),
            "loom_runs": [round(x, 4) for x in runs["loom"]],
            "native_runs": [round(x, 4) for x in runs["native"]],
            "loom_peak_rss_mib": round(max(rss["loom"]), 1),
            "native_peak_rss_mib": round(max(rss["native"]), 1),
            "loss_first_step": [losses["loom"][0], losses["native"][0]],
            "loss_last_step": [losses["loom"][-1], losses["native"][-1]],
            "same_loss": same("loom")}


def native_label(layout: tuple) -> str:
    tp, pp, dp, sp, _, dp_kind, schedule = layout
    parts = []
    if dp > 1:
        parts.append(NATIVE_NAME[dp_kind] if tp == 1 else "FSDP2")
    if tp > 1:
        parts.append("DTensor TP" + (" + SequenceParallel" if sp else "") + " + loss_parallel")
    if pp > 1:
        parts.append(f"pipelining {schedule.upper()}")
    return " + ".join(parts) or "plain module"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--compile", action="store_true",
                    help="both sides torch.compile every transformer block")
    ap.add_argument("--thp", action="store_true",
                    help="both sides: THP_MEM_ALLOC_ENABLE=1 (huge-page-backed CPU tensors)")
    args = ap.parse_args()
    if args.thp:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # inherited by every spawned rank
    torch.set_num_threads(1)
    from loom.planner.calibrate import measure_gemm_flops
    gemm_rate = measure_gemm_flops(1024)
    print(json.dumps({"gemm_flops_per_s": round(gemm_rate), "thp": args.thp}), flush=True)
    rows = []
    for name in args.layouts:
        try:
            row = measure(name, args.repeats, args.warmup, args.steps, args.compile, gemm_rate)
        except RuntimeError as e:  # one layout failing must not lose the others
            print(json.dumps({"layout": name, "error": str(e)[-2000:]}), flush=True)
            continue
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| layout | native | loom s/step | native s/step | loom / native |"
          " CPU s/step loom / native | CPU ratio | GEMM floor s (share loom / native) |"
          " peak RSS/rank loom / native (MiB) | same loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cols = [r["layout"], r["native"], f"{r['loom_s_per_step']:.3f}",
                f"{r['native_s_per_step']:.3f}", f"{r['ratio_loom_over_native']:.2f}",
                f"{r['loom_cpu_s_per_step']:.3f} / {r['native_cpu_s_per_step']:.3f}",
                f"{r['cpu_ratio_loom_over_native']:.2f}",
                f"{r['gemm_floor_s']:.3f} ({r['gemm_share_loom']:.2f} / "
                f"{r['gemm_share_native']:.2f})",
                f"{r['loom_peak_rss_mib']:.0f} / {r['native_peak_rss_mib']:.0f}",
                "yes" if r["same_loss"] else "NO"]
        print("| " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
