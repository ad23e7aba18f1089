"""Causal attention per SDPA backend, measured against the planner's attention time (issue 47):
which kernel a run gets decides its attention's speed, and the held-out NeMo rows
(:mod:`benchmarks.planner_sources.dgxc`) say the planner prices FlashAttention-2 right and
cuDNN's Hopper kernel about 2x slow (docs/planner.md, "DGX Cloud"). This measures it on the GPU
at hand, as ``make gpu-check``'s ``attention`` part.

For each shape ``(b, heads, s, d)`` and each backend of ``torch.nn.attention.SDPBackend``
(flash, cuDNN, memory-efficient, math, and the default choice with none forced, which is what
loom's ``scaled_dot_product_attention`` gets, named by the dispatcher's own pick): forward +
backward of
``scaled_dot_product_attention(q, k, v, is_causal=True)`` on ``[b, heads, s, d]`` tensors
(bf16 on CUDA, fp32 on CPU), ``warmup`` untimed then the median of ``iters`` timed
(synchronized), or ``unavailable: <reason>`` where the backend cannot run the case. Beside each:
the planner's time for the same work, forward + 2 x forward for the backward
(:func:`loom.planner.timing.layer_times`' convention), the forward being the non-causal score
FLOPs ``4 b heads s^2 d`` at :func:`loom.planner.primitives.attention_efficiency` (what it
ships), and half of that (``Options.causal_skip``, the kernel skipping the masked blocks).

    python -m benchmarks.attention_kernels [--device cuda] [--gpu H100-80GB]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.nn.functional as F

BACKENDS = ("default", "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
FULL_SHAPES = ((4, 16, 2048, 128), (1, 16, 4096, 128), (1, 16, 8192, 128))
TINY_SHAPES = ((1, 2, 64, 16), (1, 2, 128, 16))


def planner_ms(shape: tuple, gpu: str) -> dict:
    """The planner's forward + backward milliseconds of causal attention on ``shape``: every
    block (``shipped``) and the causal half (``causal_skip``)."""
    from loom.planner.hardware import make_cluster
    from loom.planner.primitives import attention_efficiency
    b, heads, s, d = shape
    cl = make_cluster(gpu, 1, 1)
    fwd = 4 * b * heads * s * s * d / (cl.peak_flops * attention_efficiency(d, s, True, cl))
    return {"shipped": 3e3 * fwd, "causal_skip": 1.5e3 * fwd}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_case(shape: tuple, backend: str, device: torch.device, warmup: int,
              iters: int) -> dict:
    """Median forward + backward milliseconds of one case, or ``{"status": "unavailable:
    ..."}``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(shape, generator=gen, device=device, dtype=dtype)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
    ctx = (sdpa_kernel([getattr(SDPBackend, backend)]) if backend != "default"
           else contextlib.nullcontext())
    times = []
    try:
        with ctx:
            for i in range(warmup + iters):
                _sync(device)
                t0 = time.perf_counter()
                step()
                _sync(device)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"status": f"unavailable: {first[:200]}"}
    return {"status": "ok", "ms": 1e3 * statistics.median(times)}


def default_choice(shape: tuple, device: torch.device) -> str:
    """The backend ``scaled_dot_product_attention`` picks for a causal call on ``shape`` with
    none forced (``torch._fused_sdp_choice``, the dispatcher's own choice), by name."""
    from torch.nn.attention import SDPBackend
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.empty(shape, device=device, dtype=dtype)
    try:
        return SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name
    except (RuntimeError, ValueError, AttributeError) as e:  # a private API: say why not
        return f"unknown ({type(e).__name__})"


def measure(device: torch.device, shapes=FULL_SHAPES, gpu: str = "H100-80GB",
            warmup: int = 3, iters: int = 10) -> list[dict]:
    """One row per shape and backend: the shape, the backend, the measured milliseconds (or
    why not), the planner's two times and the measured over each."""
    rows = []
    for shape in shapes:
        plan = planner_ms(shape, gpu)
        for backend in BACKENDS:
            row = {"b": shape[0], "heads": shape[1], "s": shape[2], "d": shape[3],
                   "backend": backend if backend != "default"
                   else f"default ({default_choice(shape, device)})",
                   **time_case(shape, backend, device, warmup, iters),
                   "planner_ms": plan}
            if row["status"] == "ok":
                row["measured_over_planner"] = {k: round(row["ms"] / v, 3)
                                                for k, v in plan.items()}
            rows.append(row)
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gpu", default="H100-80GB", help="the planner's GPU row to compare with")
    ap.add_argument("--tiny", action="store_true", help="the CPU test's small shapes")
    args = ap.parse_args(argv)
    rows = measure(torch.device(args.device), TINY_SHAPES if args.tiny else FULL_SHAPES,
                   args.gpu)
    print(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
