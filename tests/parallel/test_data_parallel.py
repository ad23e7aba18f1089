"""GradBuffer: bucketed DP all-reduce without per-step zeroing.

In a spawned 2-rank world with 3 micro-batches (no_sync on the first two) and an unused
parameter, every gradient equals the DP average of the summed micro-batch gradients (computed
by hand), the unused parameter gets zeros, gradients live in the bucket buffers, and with the
default bucket size the first bucket's all-reduce is launched while backward still has
gradients to produce (overlap). zero_grad only drops the references: a step after it gives
the same gradients again (no stale accumulation). One rank: plain autograd tensors, no buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from loom.parallel.grad_buffer import GradBuffer, default_bucket_size
from testkit import run_distributed
from testkit.numerics import rel_err


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)], nn.Linear(512, 4))


def data(rank: int, j: int) -> torch.Tensor:
    return torch.randn(4, 512, generator=torch.Generator().manual_seed(10 * rank + j))


def expected_grads(model: nn.Module, world: int, m: int) -> list[torch.Tensor]:
    ref = [torch.zeros_like(p) for p in model.parameters()]
    for r in range(world):
        for j in range(m):
            model.zero_grad()
            model(data(r, j)).square().mean().backward()
            for acc, p in zip(ref, model.parameters()):
                acc += p.grad / world
    model.zero_grad()
    return ref


def reducer_case() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    unused = nn.Parameter(torch.ones(3))
    params = list(model.parameters()) + [unused]
    ref = expected_grads(model, world, 3)
    group = dist.new_group(list(range(world)))
    reducer = GradBuffer(params, group)  # default bucket size
    events = []
    launch = reducer._launch
    reducer._launch = lambda b: (events.append(("launch", reducer.buckets.index(b))), launch(b))
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: events.append(("grad", 0)))
    out = {"n_buckets": len(reducer.buckets), "errors": [], "none_after_zero": None}
    for step in range(2):
        events.clear()
        for j in range(3):
            ctx = reducer.no_sync() if j < 2 else torch.enable_grad()
            with ctx:
                model(data(rank, j)).square().mean().backward()
        reducer.finish_grad_sync()
        err = max(rel_err(p.grad, r)
                  for p, r in zip(model.parameters(), ref))
        out["errors"].append(err)
        out["unused_zero"] = bool(torch.equal(unused.grad, torch.zeros(3)))
        bufs = {b.buffer.data_ptr(): b.buffer for b in reducer.buckets}
        out["in_buffers"] = all(any(b.data_ptr() <= p.grad.data_ptr() < b.data_ptr() + b.numel() * 4
                                    for b in bufs.values()) for p in params)
        last_grad = max(i for i, e in enumerate(events) if e[0] == "grad")
        first_launch = min(i for i, e in enumerate(events) if e[0] == "launch")
        out["overlap"] = first_launch < last_grad
        reducer.zero_grad()
        out["none_after_zero"] = all(p.grad is None for p in params)
    return out


def test_reducer_average_accumulation_unused_and_overlap():
    for res in run_distributed(2, reducer_case):
        assert res["n_buckets"] >= 2, res
        assert max(res["errors"]) < 1e-6, res
        assert res["unused_zero"] and res["in_buffers"] and res["overlap"], res
        assert res["none_after_zero"], res


def test_single_rank_keeps_autograd_tensors():
    model = make_model()
    unused = nn.Parameter(torch.ones(3))
    params = list(model.parameters()) + [unused]
    ref = expected_grads(model, 1, 2)
    reducer = GradBuffer(params, None)
    assert reducer.buckets == [] and all(p.grad is None for p in params)
    for step in range(2):
        for j in range(2):
            with reducer.no_sync() if j == 0 else torch.enable_grad():
                model(data(0, j)).square().mean().backward()
        reducer.finish_grad_sync()
        for p, r in zip(model.parameters(), ref):
            assert torch.allclose(p.grad, r, rtol=1e-6, atol=1e-7)
        assert torch.equal(unused.grad, torch.zeros(3))
        reducer.zero_grad()


def test_default_bucket_size_rule():
    assert default_bucket_size(7_300_000, 2) == 1_825_000  # P / 4
    assert default_bucket_size(1_000_000, 2) == 500_000  # floor 250 000 d
    assert default_bucket_size(1_000_000, 8) == 2_000_000
    assert default_bucket_size(10**10, 4) == 40_000_000  # Megatron's cap
