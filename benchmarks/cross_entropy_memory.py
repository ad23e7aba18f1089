"""Peak memory and time of the loss path (output GEMM + cross-entropy, forward and backward), before
(``F.linear`` then ``vocab_parallel_cross_entropy`` on the full logits, with the ``[s, b] -> [b, s]``
transpose the model does) and after (:func:`loom.parallel.cross_entropy.linear_cross_entropy`).

Peak memory: ``torch.profiler`` with ``profile_memory=True`` records every CPU allocation and free
with the running "Total Allocated"; the peak is its maximum over the region minus its value at the
start (so the inputs and the weight, allocated before, are not counted; the weight's gradient
is). Time: forward + backward, the two paths alternated A B A B, median of ``--repeats``.
TP = 1, fp32, the reference work's micro-batch (s 256, b 8, h 256). Prints one JSON line per V.

``--chunk-sweep N [N ...]``: also time ``linear_cross_entropy`` forward + backward with
``chunk_tokens`` = each N (and the default rule), alternated, median of ``--repeats``
(``sweep_ms`` in the JSON line).

    OMP_NUM_THREADS=1 python -m benchmarks.cross_entropy_memory [--vocab 8192 131072]
        [--chunk-sweep 128 256 512 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from loom.parallel.cross_entropy import default_chunk_tokens, linear_cross_entropy
from loom.parallel.mesh import ParallelMesh
from loom.parallel.tensor import vocab_parallel_cross_entropy


def before(x, w, target, vocab_size):
    logits = torch.nn.functional.linear(x, w).transpose(0, 1)  # [b, s, V], as GPTModel does
    loss = vocab_parallel_cross_entropy(logits, target.t(), ParallelMesh.single(), vocab_size)
    loss.mean().backward()
    return loss.detach()


def after(x, w, target, vocab_size):
    loss = linear_cross_entropy(x, w, target, group=None, vocab_start=0, vocab_size=vocab_size)
    loss.mean().backward()
    return loss.detach().t()


def peak_bytes(fn, *args) -> int:
    import json as js
    import os
    import tempfile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e["args"] for e in js.load(f)["traceEvents"] if e.get("name") == "[memory]"
                      and e["args"].get("Device Type") == 0]
    finally:
        os.unlink(path)
    if not events:
        return 0
    start = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - start


def chunk_sweep(x, w, target, vocab_size, chunks, repeats) -> dict:
    """Median ms of ``linear_cross_entropy`` forward + backward per chunk size (None = the
    default rule), the sizes alternated."""
    times = {c: [] for c in [None, *chunks]}
    for _ in range(repeats):
        for c in times:
            x.grad = w.grad = None
            t0 = time.perf_counter()
            linear_cross_entropy(x, w, target, group=None, vocab_start=0, vocab_size=vocab_size,
                                 chunk_tokens=c).mean().backward()
            times[c].append(time.perf_counter() - t0)
    return {str(c or "default"): round(1e3 * statistics.median(t), 1) for c, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, nargs="+", default=[8192, 131072])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-sweep", type=int, nargs="*", default=[])
    args = ap.parse_args()
    s, b, h = args.seq, args.batch, args.hidden
    for v in args.vocab:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(v, h, generator=g).mul_(0.02).requires_grad_(True)
        x = torch.randn(s, b, h, generator=g).requires_grad_(True)
        target = torch.randint(0, v, (s, b), generator=g)
        res = {"V": v, "s": s, "b": b, "h": h,
               "chunk_tokens": default_chunk_tokens(s * b, h, v),
               "full_logits_MiB": s * b * v * 4 / 2**20}
        losses, grads = {}, {}
        for name, fn in (("before", before), ("after", after)):
            x.grad = w.grad = None
            res[f"{name}_peak_MiB"] = round(peak_bytes(fn, x, w, target, v) / 2**20, 1)
            x.grad = w.grad = None
            losses[name] = fn(x, w, target, v)
            grads[name] = (x.grad.clone(), w.grad.clone())
        res["max_loss_diff"] = float((losses["before"] - losses["after"]).abs().max())
        res["max_grad_diff"] = max(float((a - c).abs().max())
                                   for a, c in zip(grads["before"], grads["after"]))
        times = {"before": [], "after": []}
        for _ in range(args.repeats):
            for name, fn in (("before", before), ("after", after)):
                x.grad = w.grad = None
                t0 = time.perf_counter()
                fn(x, w, target, v)
                times[name].append(time.perf_counter() - t0)
        for name in times:
            res[f"{name}_ms"] = round(1e3 * statistics.median(times[name]), 1)
        res["peak_ratio"] = round(res["after_peak_MiB"] / res["before_peak_MiB"], 3)
        if args.chunk_sweep:
            res["sweep_ms"] = chunk_sweep(x, w, target, v, args.chunk_sweep, args.repeats)
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
