"""Calibration: measure this machine (the fit of the compute model to published runs, and its
leave-one-source-out test, are research outside the package: :mod:`benchmarks.planner_sources`,
``python -m benchmarks.planner_fit``).

* :func:`calibrate_local` (``loom plan --calibrate``) measures this machine, one thread (one
  rank's share of a CPU host), in ~10-20 s, and fits every constant of the time model:

  - ``peak_flops``, ``gemm_efficiency``, ``gemm_half_dim``: a sweep of fp32 GEMMs
    ``[T, w] x [w, 4w]`` with their two backward products (T in 128..2048 tokens, w in 64..1024)
    fitted to the planner's curve ``time = 3 x flops / (peak e / (1 + h0/w + h0/T))``
    (linear least squares on seconds per FLOP, relative error); ``peak`` is the best rate seen,
    ``e`` the fitted asymptote over it.
  - ``hbm_bw``: in-place ``a += b`` on 32 MB fp32 tensors (3 x 32 MB moved), best of 5.
  - ``mem_traffic``: one tiny single-rank training step (loom's own GPT, 2 layers, h 256,
    s 128, batch 8, AdamW) on a model *not* used by the benchmarks; ``k`` is the one value that
    makes the planner's iteration time equal the measured one given the GEMM and bandwidth fits
    above (it absorbs element-wise kernels and Python/autograd overhead per activation byte).
  - ``intra_alpha``/``intra_bw`` (= inter): gloo all-reduce of 4 KB..32 MB among ``world`` local
    ranks (and among 2 of them) fitted to the ring formula
    ``t = 2 (n-1) alpha + 2 (n-1)/n M / W``.

  It writes a cluster JSON for ``--cluster FILE``. The planner assumes one device per rank;
  ranks sharing the host's cores: :mod:`loom.planner.host_sharing`. This is the only part of
  the planner that imports torch.distributed or starts processes.
"""

from __future__ import annotations

import os
import time

import numpy as np

from loom.planner.hardware import Cluster, make_cluster


# -- measure this machine -------------------------------------------------------------------------

GEMM_TOKENS = (128, 512, 2048)
GEMM_WIDTHS = (64, 128, 256, 512, 1024)
GEMM_MAX_FLOPS = 2.5e10  # skip sweep points above this (keeps the sweep ~3 s on one core)


def measure_gemm_flops(n: int = 1024, repeats: int = 5, dtype: str = "float32") -> float:
    """Achievable FLOP/s of an ``n x n x n`` ``torch.matmul`` on this machine's default device
    (``2 n^3`` FLOPs per product), best of ``repeats``."""
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(n, n, dtype=dt)
    b = torch.randn(n, n, dtype=dt)
    torch.matmul(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def measure_gemm_sweep(tokens=GEMM_TOKENS, widths=GEMM_WIDTHS, repeats: int = 3,
                       max_flops: float = GEMM_MAX_FLOPS) -> list[tuple]:
    """``[(T, w, flops, seconds)]``: a transformer-shaped fp32 GEMM ``[T, w] x [w, 4w]`` plus its
    two backward products (``dX = dY W^T``, ``dW = X^T dY``), ``flops = 3 x 2 T w 4w``, best of
    ``repeats``, on the current thread count."""
    import torch

    out = []
    for T in tokens:
        for w in widths:
            n = 4 * w
            fl = 3 * 2.0 * T * w * n
            if fl > max_flops:
                continue
            x, W, dy = torch.randn(T, w), torch.randn(w, n), torch.randn(T, n)
            best = float("inf")
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                torch.matmul(x, W)
                torch.matmul(dy, W.t())
                torch.matmul(x.t(), dy)
                if i:  # first one is the warm-up
                    best = min(best, time.perf_counter() - t0)
            out.append((T, w, fl, best))
    return out


def fit_gemm_curve(points) -> tuple[float, float, float]:
    """Fit ``seconds / flops = (1 + h0/w + h0/T) / R`` (``R = peak x e``) to the sweep by least
    squares on the relative error; returns ``(peak, e, h0)`` with ``peak`` the best measured
    rate (so ``e = R / peak``)."""
    T = np.array([p[0] for p in points], float)
    w = np.array([p[1] for p in points], float)
    y = np.array([p[3] / p[2] for p in points], float)  # seconds per FLOP
    X = np.stack([np.ones_like(y), 1 / w + 1 / T], 1) / y[:, None]  # rows scaled: relative error
    (a, b), *_ = np.linalg.lstsq(X, np.ones_like(y), rcond=None)
    a = max(float(a), 1e-15)
    R = 1.0 / a
    h0 = max(float(b) / a, 1e-3)
    peak = float(max(1.0 / y.min(), R))
    return peak, R / peak, h0


def measure_memory_bandwidth(nbytes: int = 32 << 20, repeats: int = 5) -> float:
    """Bytes/s of an in-place fp32 ``a += b`` on ``nbytes`` tensors (reads a and b, writes a:
    3 x nbytes moved), best of ``repeats``."""
    import torch

    a = torch.ones(nbytes // 4)
    b = torch.ones(nbytes // 4)
    a.add_(b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.add_(b)
        best = min(best, time.perf_counter() - t0)
    return 3.0 * nbytes / best


# The one training step that fits ``mem_traffic`` (not a benchmark model: 2 layers, s 128).
CAL_MODEL = dict(num_layers=2, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024,
                 seq_length=128, vocab_size=4096)
CAL_BATCH = 8


def _cal_model_config():
    from loom.config import ModelConfig
    return ModelConfig.gpt2(hidden_dropout=0.0, attention_dropout=0.0, **CAL_MODEL)


def measure_train_step(steps: int = 3) -> float:
    """Seconds of one single-rank training step (forward, backward, AdamW) of loom's GPT at
    :data:`CAL_MODEL` on a batch of :data:`CAL_BATCH` random sequences, median of ``steps`` after
    one warm-up, current thread count."""
    import torch

    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model

    cfg = _cal_model_config()
    mesh = ParallelMesh.single()
    model = build_model(get_family("gpt"), cfg, mesh, seed=1234)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (CAL_BATCH, cfg.seq_length + 1), generator=g)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        loss = model(ids[:, :-1], labels=ids[:, 1:]).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def fit_mem_traffic(step_s: float, cluster: Cluster) -> float:
    """The ``mem_traffic`` that makes the planner's iteration time of the calibration step
    (:data:`CAL_MODEL`, 1 rank, fused attention) equal ``step_s``: the time model is linear in
    it, so ``k = (step_s - time at k~0) / (time at k=1 - time at k~0)``."""
    from dataclasses import replace

    from loom.planner.layout import Options, make_layouts
    from loom.planner.timing import time_terms

    model = _cal_model_config()
    L = make_layouts(dict(tp=1, pp=1, dp=1, cp=1, mbs=CAL_BATCH))

    def it(k):
        cl = replace(cluster, num_gpus=1, gpus_per_node=1, mem_traffic=k)
        return float(time_terms(model, L, CAL_BATCH, model.seq_length, cl,
                                Options(flash_attention=True))["iteration"][0])

    t0, t1 = it(1e-9), it(1.0)
    return max(0.1, (step_s - t0) / max(t1 - t0, 1e-12))


def _allreduce_worker(rank: int, world: int, port: int, sizes: list, repeats: int, queue,
                      sub: int = 0) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        groups = [(world, None)]
        if 1 < sub < world:
            groups.append((sub, dist.new_group(list(range(sub)))))
        res = {}
        for n, group in groups:
            out = []
            if rank < n:
                for nbytes in sizes:
                    x = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
                    dist.all_reduce(x, group=group)
                    ts = []
                    for _ in range(repeats):
                        dist.barrier(group=group)
                        t0 = time.perf_counter()
                        dist.all_reduce(x, group=group)
                        ts.append(time.perf_counter() - t0)
                    out.append(float(np.median(ts)))
            res[n] = out
            dist.barrier()
        if rank == 0:
            queue.put(res)
    finally:
        dist.destroy_process_group()


def measure_allreduce(world: int = 2, sizes=(4 << 10, 256 << 10, 4 << 20, 32 << 20),
                      repeats: int = 5, sub: int = 0):
    """All-reduce times (seconds, median of ``repeats``) for message ``sizes`` (bytes) between
    ``world`` local gloo ranks started with ``torch.multiprocessing`` (one thread each).
    Returns ``(sizes, times)``; with ``1 < sub < world`` also among ranks ``0..sub-1`` of the
    same processes: ``(sizes, {world: times, sub: times})``."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_allreduce_worker, args=(world, port, list(sizes), repeats, queue, sub),
                       nprocs=world, join=True, start_method="spawn")
    res = queue.get()
    if 1 < sub < world:
        return list(sizes), res
    return list(sizes), res[world]


def fit_alpha_beta(sizes, times, world: int = 2) -> tuple[float, float]:
    """Least squares of ``t = 2 (n-1) alpha + 2 (n-1)/n M / W`` (references.md ring all-reduce);
    returns ``(alpha seconds, W bytes/s)``."""
    n = world
    X = np.stack([np.full(len(sizes), 2.0 * (n - 1)), 2.0 * (n - 1) / n * np.asarray(sizes, float)], 1)
    coef, *_ = np.linalg.lstsq(X, np.asarray(times, float), rcond=None)
    alpha = max(float(coef[0]), 1e-7)
    inv_bw = max(float(coef[1]), 1e-15)
    return alpha, 1.0 / inv_bw


def calibrate_local(path: str | None = "cluster.json", world: int = 2,
                    fit_step: bool = True) -> Cluster:
    """Measure this machine (one thread = one rank's core) and write a cluster JSON
    (``--cluster FILE``): GEMM curve (``peak_flops``, ``gemm_efficiency``, ``gemm_half_dim``),
    ``hbm_bw``, ``mem_traffic`` (from one tiny training step; ``fit_step=False`` keeps the A100
    value) and the gloo all-reduce alpha/bandwidth among ``max(world, 2)`` local ranks (both
    links; one node). ``hbm_bytes`` is the physical memory. See the module docstring."""
    import torch

    from loom.planner.timing import MEM_TRAFFIC

    t_start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sweep = measure_gemm_sweep()
        peak, eff, h0 = fit_gemm_curve(sweep)
        hbm_bw = measure_memory_bandwidth()
        cl = Cluster(gpu="local-cpu", num_gpus=1, gpus_per_node=1, peak_flops=peak,
                     hbm_bw=hbm_bw, gemm_efficiency=eff, gemm_half_dim=h0,
                     mem_traffic=MEM_TRAFFIC)
        step_s = measure_train_step() if fit_step else float("nan")
        k = fit_mem_traffic(step_s, cl) if fit_step else MEM_TRAFFIC
    finally:
        torch.set_num_threads(threads)
    n = max(2, world)
    sub = 2 if n > 2 else 0
    sizes, res = measure_allreduce(n, sub=sub)
    times = res if not sub else res[n]
    alpha, bw = fit_alpha_beta(sizes, times, n)
    ar = {str(n): dict(times_s=times, alpha_s=alpha, bw_bytes_per_s=bw)}
    if sub:
        a2, b2 = fit_alpha_beta(sizes, res[2], 2)
        ar["2"] = dict(times_s=res[2], alpha_s=a2, bw_bytes_per_s=b2)
    try:
        mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        mem = 16e9
    cl = Cluster(gpu="local-cpu", num_gpus=n, gpus_per_node=n, peak_flops=peak,
                 hbm_bytes=mem, hbm_bw=hbm_bw, intra_bw=bw, inter_bw=bw,
                 intra_alpha=alpha, inter_alpha=alpha, gemm_efficiency=eff,
                 gemm_half_dim=h0, mem_traffic=k,
                 notes={"method": "1 thread per rank: fp32 GEMM sweep [T,w]x[w,4w] fwd+2 bwd "
                                  "fitted to peak*e/(1+h0/w+h0/T); a+=b 32 MB for hbm_bw; "
                                  "mem_traffic from one single-rank training step of "
                                  f"{CAL_MODEL} batch {CAL_BATCH}; gloo all_reduce ring fit",
                        "gemm_sweep": [dict(tokens=T, width=w, flops=f, seconds=s)
                                       for (T, w, f, s) in sweep],
                        "calibration_step_s": step_s,
                        "allreduce_sizes_bytes": sizes, "allreduce": ar,
                        "cpu_count": os.cpu_count(),
                        "seconds": round(time.perf_counter() - t_start, 2)})
    if path:
        cl.save(path)
    return cl
