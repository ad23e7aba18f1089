"""The loss path on one CUDA GPU: output GEMM + cross-entropy, forward and backward, in bf16
autocast as a training step runs it, per chunk size and per way of forming the fp32 gradients.

Arms, alternated A B A B (``--repeats`` rounds, median ms, CUDA-synchronized wall time):
- ``plain``: ``F.linear`` under autocast, ``F.cross_entropy`` on the fp32 logits (the loop of
  ``benchmarks/plain_llama.py``);
- ``loom c<N>``: :func:`loom.parallel.cross_entropy.linear_cross_entropy` with ``chunk_tokens``
  N (``default``: :func:`loom.parallel.cross_entropy_cost.default_chunk_tokens`);
- ``loom16 c<N>``: the same with the 16-bit GEMM outputs copied or added into fp32 (the code
  before ``FP32_OUT_GEMM``: ``FP32_OUT_GEMM`` off for that arm).
Peak: ``torch.cuda.max_memory_allocated`` over the call less the memory held before it (inputs
and weight not counted). Error: each arm's loss and gradients against an fp32 reference of the
same inputs (``F.linear`` + ``F.cross_entropy`` without autocast), max relative to the
reference's largest magnitude.

    python3 -m benchmarks.cross_entropy_gpu [--shapes 16384x4096x128256 ...] [--chunks 2048 ...]

Prints one JSON line per shape (N tokens x h x V).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F

from loom.parallel import cross_entropy as ce
from loom.parallel.cross_entropy_cost import default_chunk_tokens

SHAPES = ("16384x4096x128256", "32768x2048x32000", "32768x1024x50304")


def plain(x, w, y):
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = F.linear(x, w)
    loss = F.cross_entropy(logits.float(), y)
    loss.backward()
    return loss.detach()


def loom(x, w, y, chunk, fp32_out=True):
    with mock.patch.object(ce, "FP32_OUT_GEMM", ce.FP32_OUT_GEMM and fp32_out):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            loss = ce.linear_cross_entropy(x, w, y, group=None, vocab_start=0,
                                           vocab_size=w.shape[0], chunk_tokens=chunk).mean()
        loss.backward()
    return loss.detach()


def reference(x, w, y):
    x, w = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(F.linear(x, w), y)
    loss.backward()
    return loss.detach(), x.grad, w.grad


def run_arm(fn, x, w, y):
    x.grad = w.grad = None
    cuda = x.is_cuda
    if cuda:
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = fn(x, w, y)
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - held if cuda else 0
    return time.perf_counter() - t0, peak, loss


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--chunks", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (no peak memory)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    for shape in args.shapes:
        n, h, v = map(int, shape.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, h, device=dev, generator=g).requires_grad_(True)
        w = (0.02 * torch.randn(v, h, device=dev, generator=g)).requires_grad_(True)
        y = torch.randint(0, v, (n,), device=dev, generator=g)
        ref = reference(x, w, y)
        default = default_chunk_tokens(n, h, v)
        arms = {"plain": plain}
        for c in [None, *args.chunks]:
            name = f"c{c or default}{'' if c else ' default'}"
            arms[f"loom {name}"] = lambda a, b, t, c=c: loom(a, b, t, c)
            arms[f"loom16 {name}"] = lambda a, b, t, c=c: loom(a, b, t, c, fp32_out=False)
        times = {k: [] for k in arms}
        res = {"N": n, "h": h, "V": v, "default_chunk": default, "fp32_out_gemm": ce.FP32_OUT_GEMM,
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
               "arms": {}}
        for r in range(args.repeats + 1):  # round 0: warm-up, not timed
            for k, fn in arms.items():
                dt, peak, loss = run_arm(fn, x, w, y)
                if r == 0:
                    res["arms"][k] = {
                        "peak_MiB": round(peak / 2**20), "loss_rel_err": rel(loss, ref[0]),
                        "dx_rel_err": rel(x.grad, ref[1]), "dw_rel_err": rel(w.grad, ref[2])}
                else:
                    times[k].append(dt)
        for k, t in times.items():
            res["arms"][k]["ms"] = round(1e3 * statistics.median(t), 2)
        base = res["arms"]["plain"]["ms"]
        for k in arms:
            res["arms"][k]["over_plain"] = round(res["arms"][k]["ms"] / base, 3)
        print(json.dumps(res), flush=True)
        del x, w, y, ref
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
