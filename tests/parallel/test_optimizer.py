"""Optimizer: the global gradient norm and clipping across TP x PP (and DP), and fused AdamW.

The norm every rank computes equals ``torch.nn.utils.get_total_norm`` on the gathered logical
gradients (each element once: TP shards concatenated, TP-replicated parameters once, the pipeline
duplicate of the tied embedding never, DP replicas once), at TP=2 x PP=2 and TP=2 x DP=2 in one
spawned 4-rank world; clipping scales every gradient (duplicates included) to the bound and
leaves them bitwise untouched below it. Single process: the norm of a 2 M-element gradient is
accurate to 1e-6 (fp64 reference), and ``build_optimizer`` picks fused AdamW on CPU, whose step
equals the per-tensor reference.
"""

from __future__ import annotations

import torch
from torch import nn

from loom.config import TrainingConfig
from loom.parallel.mesh import ParallelMesh
from loom.parallel.registry import ParamMeta, ShardSpec, local_shard
from testkit import run_distributed
from loom.training.optimizer import build_optimizer, clip_grad_norm, global_grad_norm

BIG = 1 << 20  # elements per TP shard of the big parameter: long fp32 reductions


def logical_grads(stage: int, last: bool) -> list[tuple[str, torch.Tensor, object]]:
    """The full gradients of pipeline stage ``stage``: (name, full tensor, ShardSpec or None,
    or "dup" for the last stage's copy of the tied embedding)."""
    g = torch.Generator().manual_seed(100 + stage)
    out = [("col", torch.randn(8, 6, generator=g), ShardSpec(0)),
           ("row", torch.randn(6, 8, generator=g), ShardSpec(1)),
           ("big", torch.randn(2 * BIG, generator=g) * 1e-2, ShardSpec(0)),
           ("norm", torch.randn(6, generator=g), None)]
    if last:
        out.append(("dup", torch.randn(10, 6, generator=g) * 5, "dup"))
    return out


def local_params(mesh: ParallelMesh) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(this rank's parameters, those whose gradient the registry counts in the norm)."""
    params, counted = [], []
    for name, full, spec in logical_grads(mesh.pp_rank, mesh.is_last_stage):
        meta = ParamMeta(tuple(full.shape), None, shard=None if spec in (None, "dup") else spec,
                         duplicate=spec == "dup")
        shard = local_shard(full, meta, mesh.tp_rank, mesh.tp_size)
        p = nn.Parameter(torch.zeros_like(shard))
        p.grad = shard.clone()
        params.append(p)
        if meta.counts_for_norm(mesh.tp_rank):
            counted.append(p)
    return params, counted


def reference_norm(pp: int) -> float:
    grads = [full.double() for stage in range(pp)
             for _, full, spec in logical_grads(stage, stage == pp - 1) if spec != "dup"]
    return float(torch.nn.utils.get_total_norm(grads))


def mesh_case(tp: int, pp: int) -> dict:
    mesh = ParallelMesh.build(tp=tp, pp=pp)
    params, counted = local_params(mesh)
    before = [p.grad.clone() for p in params]
    norm = float(global_grad_norm(counted, mesh))
    # no clipping below the bound: bitwise unchanged
    unclipped = clip_grad_norm(params, 2 * norm, mesh, counted)
    untouched = all(torch.equal(p.grad, b) for p, b in zip(params, before))
    # clipping to half the norm: every gradient scaled by the same factor, then norm == bound
    clipped = clip_grad_norm(params, norm / 2, mesh, counted)
    ratios = [float((p.grad / b).mean()) for p, b in zip(params, before)]
    after = float(global_grad_norm(counted, mesh))
    return {"norm": norm, "unclipped": unclipped, "untouched": untouched, "clipped": clipped,
            "ratios": ratios, "after": after, "pp_size": pp}


def world() -> dict:
    return {"tp2pp2": mesh_case(2, 2), "tp2dp2": mesh_case(2, 1)}


def test_global_norm_equals_get_total_norm_on_gathered_grads():
    results = run_distributed(4, world)
    for case in ("tp2pp2", "tp2dp2"):
        ref = reference_norm(results[0][case]["pp_size"])
        for r in results:
            c = r[case]
            assert abs(c["norm"] - ref) / ref < 1e-6, (case, c["norm"], ref)
            assert c["unclipped"] == c["norm"] and c["untouched"], case
            assert abs(c["clipped"] - ref) / ref < 1e-6
            assert max(c["ratios"]) - min(c["ratios"]) < 1e-6, c["ratios"]  # dup included
            assert abs(c["ratios"][0] - 0.5) < 1e-6
            assert abs(c["after"] - ref / 2) / (ref / 2) < 1e-5


def test_norm_of_large_gradient_is_accurate():
    g = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.zeros(2048, 1024))
    p.grad = torch.randn(2048, 1024, generator=g)
    exact = float(p.grad.double().norm())
    norm = float(global_grad_norm([p], ParallelMesh.single()))
    assert abs(norm - exact) / exact < 1e-6, (norm, exact)


def test_build_optimizer_fused_adamw_matches_reference():
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    cfg = TrainingConfig()
    cfg.lr, cfg.weight_decay = 1e-2, 0.1
    opt = build_optimizer(model, cfg)
    assert all(group["fused"] for group in opt.param_groups)
    ref_model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    ref_model.load_state_dict(model.state_dict())
    decay = [p for n, p in ref_model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in ref_model.named_parameters() if p.ndim < 2]
    ref = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-2,
                            betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                            foreach=False)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    initial = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), initial))
