"""Calibration: fit the compute model to published runs, and measure this machine.

* :func:`fit_compute_model` fits the three global constants of :mod:`loom.planner.timing`
  (``GEMM_EFFICIENCY``, ``GEMM_HALF_DIM``, ``MEM_TRAFFIC``) by minimizing the squared log error
  over NAR table 1 (hardware TFLOP/s per GPU at the published t, p, d with full recompute, the
  micro-batch and virtual stages the planner picks for that layout), KOR table 3 (iteration time,
  full recompute and SP + selective) and KOR table 4 (per-layer forward/backward times, 5 modes).
  One fit for all rows, never per row.
* :func:`calibrate_local` (``loom plan --calibrate``) measures this machine: bf16/fp32 GEMM
  FLOP/s with ``torch.matmul``, and all-reduce latency/bandwidth between 2 local ranks
  (gloo, ``torch.multiprocessing``) fitted to the alpha-beta ring formula
  ``t = 2 (n-1) alpha + 2 (n-1)/n M / W``; writes a cluster JSON for ``--cluster FILE``.
  This is the only part of the planner that imports torch.distributed or starts processes.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from loom.planner.hardware import Cluster, make_cluster


# -- fit to published measurements --------------------------------------------------------------

def validation_points(cluster_kw: dict | None = None):
    """Yield ``(name, predicted, published)`` for every published measurement used in the fit
    and in the tests, with the compute constants of ``cluster_kw`` (Cluster overrides)."""
    from loom.planner.layout import Options, make_layouts
    from loom.planner.presets import KOR_TABLE3, NAR_TABLE1, gpt
    from loom.planner.search import evaluate, record, search
    from loom.planner.timing import layer_fwd_bwd

    kw = cluster_kw or {}
    opts = Options()
    out = []
    for (P, a, h, nl, t, p, n, B, pub, _pct) in NAR_TABLE1:
        model = gpt(nl, h, a)
        cl = make_cluster("A100-80GB", n, **kw)
        res = search(model, cl, B, 2048, fixed=dict(tp=t, pp=p, cp=1, recompute="full", sp=0,
                                                    zero=0), opts=opts)
        if not len(res["order"]):
            out.append((f"NAR {P}B hw TFLOP/s", float("nan"), pub))
            continue
        out.append((f"NAR {P}B hw TFLOP/s", record(res, res["order"][0])["hw_tflops_per_gpu"], pub))
    for (name, a, h, nl, t, p, n, B, b, tfull, tsel, _mfu, _hfu) in KOR_TABLE3:
        model = gpt(nl, h, a)
        cl = make_cluster("A100-80GB", n, **kw)
        d = n // (t * p)
        L = make_layouts([dict(tp=t, pp=p, dp=d, mbs=b, recompute="full", sp=0, vp=1),
                          dict(tp=t, pp=p, dp=d, mbs=b, recompute="selective", sp=1, vp=1)])
        res = evaluate(model, L, B, 2048, cl, opts)
        out.append((f"KOR {name} full s", float(res["time_iteration"][0]), tfull))
        out.append((f"KOR {name} sp+sel s", float(res["time_iteration"][1]), tsel))
    model = gpt(48, 6144, 64)
    cl = make_cluster("A100-80GB", 8, **kw)
    modes = [("baseline", "none", 0, 7.7, 11.9), ("sp", "none", 1, 7.2, 11.8),
             ("full", "full", 0, 7.7, 19.5), ("selective", "selective", 0, 7.7, 13.2),
             ("sel+sp", "selective", 1, 7.2, 13.1)]
    L = make_layouts([dict(tp=8, mbs=4, recompute=r, sp=sp) for (_, r, sp, _, _) in modes])
    fwd, bwd = layer_fwd_bwd(model, 2048, L, cl, opts)
    for i, (name, _, _, f_ms, b_ms) in enumerate(modes):
        out.append((f"KOR t4 {name} fwd ms", float(fwd[i] * 1e3), f_ms))
        out.append((f"KOR t4 {name} bwd ms", float(bwd[i] * 1e3), b_ms))
    return out


def fit_loss(params) -> float:
    e, h0, k = params
    pts = validation_points(dict(gemm_efficiency=e, gemm_half_dim=h0, mem_traffic=k))
    errs = [math.log(pred / pub) for _, pred, pub in pts if pred == pred]
    return float(np.mean(np.square(errs)))


def fit_compute_model(start=(0.74, 48.0, 2.3), rounds: int = 6) -> tuple:
    """Least-squares fit (coordinate search with shrinking steps) of ``(GEMM_EFFICIENCY,
    GEMM_HALF_DIM, MEM_TRAFFIC)``; returns ``(params, rms_log_error)``. Takes ~a minute."""
    x = list(start)
    steps = [0.04, 64.0, 0.5]
    best = fit_loss(x)
    for _ in range(rounds):
        improved = True
        while improved:
            improved = False
            for i in range(3):
                for sgn in (+1, -1):
                    y = list(x)
                    y[i] = max(1e-3, y[i] + sgn * steps[i])
                    loss = fit_loss(y)
                    if loss < best:
                        best, x, improved = loss, y, True
        steps = [s / 2 for s in steps]
    return tuple(x), math.sqrt(best)


# -- measure this machine -------------------------------------------------------------------------

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


def _allreduce_worker(rank: int, world: int, port: int, sizes: list, repeats: int, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = []
        for nbytes in sizes:
            x = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
            dist.all_reduce(x)
            dist.barrier()
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                dist.all_reduce(x)
                best = min(best, time.perf_counter() - t0)
            out.append(best)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def measure_allreduce(world: int = 2, sizes=(4 << 10, 256 << 10, 4 << 20, 32 << 20),
                      repeats: int = 5) -> tuple[list, list]:
    """All-reduce times (seconds, best of ``repeats``) for message ``sizes`` (bytes) between
    ``world`` local gloo ranks started with ``torch.multiprocessing``."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_allreduce_worker, args=(world, port, list(sizes), repeats, queue),
                       nprocs=world, join=True, start_method="spawn")
    return list(sizes), queue.get()


def fit_alpha_beta(sizes, times, world: int = 2) -> tuple[float, float]:
    """Least squares of ``t = 2 (n-1) alpha + 2 (n-1)/n M / W`` (references.md ring all-reduce);
    returns ``(alpha seconds, W bytes/s)``."""
    n = world
    X = np.stack([np.full(len(sizes), 2.0 * (n - 1)), 2.0 * (n - 1) / n * np.asarray(sizes, float)], 1)
    coef, *_ = np.linalg.lstsq(X, np.asarray(times, float), rcond=None)
    alpha = max(float(coef[0]), 1e-7)
    inv_bw = max(float(coef[1]), 1e-15)
    return alpha, 1.0 / inv_bw


def calibrate_local(path: str | None = "cluster.json", world: int = 2) -> Cluster:
    """Measure this machine and write a cluster JSON (``--cluster FILE``): ``peak_flops`` is the
    measured GEMM FLOP/s with ``gemm_efficiency`` 1.0 (so predictions use the achieved rate),
    intra- and inter-node links both set to the fitted gloo all-reduce alpha and bandwidth (one
    node), ``hbm_bytes`` the physical memory."""
    flops = measure_gemm_flops()
    sizes, times = measure_allreduce(world)
    alpha, bw = fit_alpha_beta(sizes, times, world)
    try:
        mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        mem = 16e9
    cl = make_cluster("A100-80GB", world, world)
    cl = Cluster(gpu="local-cpu", num_gpus=world, gpus_per_node=world, peak_flops=flops,
                 hbm_bytes=mem, hbm_bw=cl.hbm_bw / 100, intra_bw=bw, inter_bw=bw,
                 intra_alpha=alpha, inter_alpha=alpha, gemm_efficiency=1.0,
                 gemm_half_dim=1e-9, mem_traffic=0.0,
                 notes={"allreduce_sizes_bytes": sizes, "allreduce_times_s": times,
                        "method": "torch.matmul fp32 1024^3; gloo all_reduce, 2 ranks"})
    if path:
        cl.save(path)
    return cl
