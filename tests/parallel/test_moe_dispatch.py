"""MoE dispatchers and experts (issue 24 item 4): --moe-grouped-gemm equals the per-expert loop
(forward and every gradient, with linear biases and empty experts) and falls back, logged
once, where grouped_mm cannot run; at EP=2 the allgather and alltoall dispatchers give the same
outputs and gradients (and allgather sends no token all-to-all); --moe-shared-expert-overlap
computes the shared expert while the dispatch all-to-all is in flight (ordering records).
The training parity rows of both dispatchers and grouped GEMM are in
tests/models/test_moe_routers.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from loom.models.moe import ExpertMLP, run_experts, run_experts_grouped
from testkit import count_collectives, run_distributed
from testkit.config import MEGATRON_DROPOUT, tiny_model


def experts(n: int, h: int, f: int, bias: bool, seed: int = 0) -> nn.ModuleDict:
    torch.manual_seed(seed)
    mods = nn.ModuleDict({str(i): ExpertMLP(h, f, True, bias) for i in range(n)})
    with torch.no_grad():
        for p in mods.parameters():
            p.normal_(0, 0.3)
    return mods


def grads_of(fn, ex, x, ids):
    x = x.clone().requires_grad_(True)
    out = fn(x, ids, ex, 4)
    (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
    g = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
         for n, p in ex.named_parameters()}
    ex.zero_grad()
    return out.detach(), x.grad, g


def test_grouped_gemm_equals_per_expert_loop():
    for bias in (False, True):
        ex = experts(4, 16, 8, bias)
        ex = nn.ModuleDict({str(4 + i): ex[str(i)] for i in range(4)})  # global ids 4..7
        ids = torch.tensor([4, 4, 4, 6, 6, 7, 7, 7, 7, 7])  # expert 5 gets no token
        x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
        want, gx_want, gw_want = grads_of(run_experts, ex, x, ids)
        got, gx, gw = grads_of(run_experts_grouped, ex, x, ids)
        assert not getattr(ex, "_grouped_fallback_logged", False)  # grouped_mm really ran
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        assert torch.allclose(gx, gx_want, rtol=1e-5, atol=1e-5)
        for n in gw_want:
            assert torch.allclose(gw[n], gw_want[n], rtol=1e-5, atol=1e-5), n
        assert gw["5.linear_fc1.weight"].abs().sum() == 0


def test_grouped_gemm_fallback_is_logged_once(caplog):
    ex = experts(2, 6, 3, False)  # 6 fp32 features = 24 bytes: not 16-byte aligned
    ids = torch.tensor([0, 1, 1])
    x = torch.randn(3, 6)
    with caplog.at_level(logging.WARNING, logger="loom.models.moe"):
        a = run_experts_grouped(x, ids, ex)
        run_experts_grouped(x, ids, ex)
    assert torch.allclose(a, run_experts(x, ids, ex))
    hits = [r for r in caplog.records if "grouped GEMM fallback: per-expert loop" in r.message]
    assert len(hits) == 1 and "16-byte" in hits[0].message


def moe_layer(kind: str, overlap: bool):
    from loom.models import get_family
    from loom.models.family import StageSpec
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_chunk
    from loom.parallel.random import RNGTracker
    cfg = tiny_model("llama", MEGATRON_DROPOUT, num_layers=1, num_query_groups=None,
                     seq_length=8, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                     moe_shared_expert_intermediate_size=16, moe_token_dispatcher_type=kind,
                     moe_shared_expert_overlap=overlap, moe_aux_loss_coeff=0.01)
    mesh = ParallelMesh.build(ep=2)
    tracker = RNGTracker(mesh.device)
    tracker.seed(0)
    return build_chunk(get_family("gpt"), cfg, StageSpec([0], False, False), mesh,
                       tracker).layers["0"].mlp


def dispatch_world() -> dict:
    """Runs the three variants on this rank and compares them here (tensors stay in the rank)."""
    import torch.distributed as dist
    runs = {}
    for kind, overlap in (("alltoall", False), ("allgather", False), ("alltoall", True)):
        mlp = moe_layer(kind, overlap)
        mlp.dispatcher.trace = []
        x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(dist.get_rank()),
                        requires_grad=True)
        with count_collectives() as calls:
            y = mlp(x)
            (y * y).sum().backward()
        runs[f"{kind}{'+overlap' if overlap else ''}"] = {
            "y": y.detach(), "gx": x.grad,
            "grads": {n: p.grad.clone() for n, p in mlp.named_parameters()
                      if p.grad is not None},
            "all_to_all": sum(1 for c in calls if c["op"] == "all_to_all"),
            "trace": list(mlp.dispatcher.trace)}
    ref, errors = runs["alltoall"], []
    for name in ("allgather", "alltoall+overlap"):
        got = runs[name]
        pairs = [("y", got["y"], ref["y"]), ("input grad", got["gx"], ref["gx"])]
        if set(got["grads"]) != set(ref["grads"]) or len(ref["grads"]) < 5:
            errors.append(f"{name}: gradients of {sorted(got['grads'])}")
        pairs += [(n, got["grads"][n], g) for n, g in ref["grads"].items() if n in got["grads"]]
        errors += [f"{name}: {what} differs by {(a - b).abs().max().item():.2e}"
                   for what, a, b in pairs if not torch.allclose(a, b, rtol=1e-5, atol=1e-6)]
    return {"errors": errors, "a2a": {k: v["all_to_all"] for k, v in runs.items()},
            "traces": {k: v["trace"] for k, v in runs.items()}}


def test_dispatchers_agree_and_overlap_ordering():
    for r in run_distributed(2, dispatch_world, timeout=300, start_method="fork"):
        assert not r["errors"], r["errors"][:4]
        assert r["a2a"]["allgather"] == 0 and r["a2a"]["alltoall"] > 0, r["a2a"]
        trace = r["traces"]["alltoall+overlap"]
        assert [t.split(" (")[0] for t in trace] == [
            "dispatch all-to-all started", "shared expert done", "dispatch all-to-all waited"]
        assert r["traces"]["alltoall"] == []  # without the flag: the shared expert runs later


def test_planner_models_the_dispatcher_and_grouped_gemm():
    """The planner's dispatcher term: allgather = the mean of an all-gather of the EP group's
    tokens and a reduce-scatter of its [e S k, h] outputs (ring, one node here), alltoall the
    pairs' all-to-all; --moe-grouped-gemm runs the expert GEMM at the efficiency of all rows."""
    import dataclasses

    from loom.planner.hardware import make_cluster
    from loom.planner.layout import make_layouts
    from loom.planner.moe import all_to_all_time, dispatch_time, moe_layer_times
    from loom.planner.presets import get_preset
    cl = make_cluster("H100-80GB", 8)
    e, S, k, h = 8, 4096, 8, 2048
    ag = dispatch_time("allgather", e, 8, S * k * h, S * h, cl)
    ring = lambda n_bytes: 7 / 8 * n_bytes / cl.intra_bw + 7 * cl.intra_alpha  # noqa: E731
    assert float(ag) == pytest.approx((ring(2 * e * S * h) + ring(2 * e * S * k * h)) / 2)
    a2a = dispatch_time("alltoall", e, 8, S * k * h, S * h, cl)
    assert float(a2a) == pytest.approx(float(all_to_all_time(e, 8, 2 * S * k * h, cl)))
    assert float(ag) / float(a2a) == pytest.approx(e * (1 + 1 / k) / 2, rel=0.1)  # + latency
    m = get_preset("qwen3-30b-a3b")
    lay = make_layouts(dict(tp=1, dp=8, ep=8, mbs=1))
    per_expert = moe_layer_times(m, 4096, lay, cl, 1.1)["gemm"]
    grouped = moe_layer_times(dataclasses.replace(m, moe_grouped_gemm=True), 4096, lay, cl,
                              1.1)["gemm"]
    assert float(grouped[0]) < float(per_expert[0])
