"""The gradient norm's fp64 sum of blocked squares: accurate, and O(tensors) ops, not O(blocks).

``make gpu-check`` profiled on one H200 (benchmarks/gpu_profile.py): 17 K per-block views and a
17 K-tensor ``_foreach_norm`` per step for a 1.1 B-parameter model, ~0.1 s of host time.
"""

import torch
from torch.profiler import ProfilerActivity, profile

from loom.training.distributed_optimizer import NORM_BLOCK, _sum_of_squares


def _grads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sizes = [3 * NORM_BLOCK + 5, NORM_BLOCK, 17, 2_000_003, 1]
    return [torch.randn(n, generator=g) * (1 + i) for i, n in enumerate(sizes)]


def test_sum_of_squares_equals_fp64():
    grads = _grads()
    want = sum(float(x.double().square().sum()) for x in grads)
    got = float(_sum_of_squares(grads, torch.device("cpu")))
    assert abs(got - want) / want < 1e-6
    plain = float(torch.linalg.vector_norm(torch.cat(grads))) ** 2  # unblocked fp32 on the CPU
    assert abs(plain - want) / want > 1e-5, "the blocking is not needed here: the check is void"
    # a 2-D gradient and an empty list
    w = torch.randn(300, 1000, generator=torch.Generator().manual_seed(1))
    assert abs(float(_sum_of_squares([w], torch.device("cpu"))) - float(w.double().square().sum())) \
        < 1e-6 * float(w.double().square().sum())
    assert float(_sum_of_squares([], torch.device("cpu"))) == 0.0


def test_sum_of_squares_ops_do_not_grow_with_blocks():
    grads = _grads()  # 38 blocks in 5 tensors
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _sum_of_squares(grads, torch.device("cpu"))
    views = sum(e.count for e in prof.key_averages() if e.key in ("aten::narrow", "aten::slice",
                                                                 "aten::split"))
    assert views <= 2 * len(grads), f"{views} views for {len(grads)} gradients"
