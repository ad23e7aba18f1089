"""Mixture-of-experts: parity with the single-process run (fp32, dropless and with a capacity
factor; loss, every gradient and the gradient norm for 3 steps; the load-balancing and z
losses in the gradient) at EP=2, TP=2, TP=2 + SP, DP=2, CP=2, EP=2 x TP=2 (+ SP),
EP=2 x DP=2 (d=4), EP=4, EP=2 x PP=2 and EP=2 x CP=2; top-1, top-2, softmax and sigmoid routers, a shared expert;
latent MoE (--moe-latent-size) at TP=2 + SP and, top-1 with --moe-apply-probs-on-input, at
EP=2 x TP=2 + SP (each asserting it ran: :func:`features_ran`); exactly 2 token
all-to-alls forward and 2 backward per MoE layer per micro-batch on the EP group (none at
EP=1); the router losses against hand-computed values; checkpoints that move between EP
sizes; bad layouts refused before any process group starts.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from loom.config import ConfigError, LoomConfig
from loom.models.moe import route
from testkit import run_distributed
from testkit.numerics import PARITY_RTOL
from testkit.config import PARITY_ADAM_EPS, tiny_config

STEPS = 3


def make_cfg(tp=1, ep=1, pp=1, k=2, score="softmax", shared=None, capacity=None,
             layers=2, experts=4, sp=False, cp=1, etp=None, latent=None,
             probs_on_input=False) -> LoomConfig:
    return tiny_config(
        "moe", num_layers=layers, num_experts=experts, moe_router_topk=k,
        moe_router_score_function=score, moe_shared_expert_intermediate_size=shared,
        moe_expert_capacity_factor=capacity, moe_layer_freq=1, moe_latent_size=latent,
        moe_apply_probs_on_input=probs_on_input, moe_router_pre_softmax=probs_on_input,
        moe_token_dispatcher_type="alltoall",  # its all-to-alls counted
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, sequence_parallel=sp,
        context_parallel_size=cp, global_batch_size=8, adam_eps=PARITY_ADAM_EPS,
        adam_beta2=0.95, lr_decay_style="cosine")  # loom's defaults before issue 21, pinned


def features_ran(tr) -> list[str]:
    """What a latent / probabilities-on-input run must show: its latent projections train, and
    the expert input is the latent tokens scaled by the router probabilities (not the tokens
    themselves). Hooks record one forward; empty when nothing is missing."""
    m, missing, seen = tr.cfg.model, [], {}
    layers = [mod for c in tr.model_chunks for mod in c.modules() if hasattr(mod, "dispatcher")]
    if not (m.moe_latent_size or m.moe_apply_probs_on_input) or not layers:
        return missing
    layer = layers[0]

    def keep(name, which):
        def hook(mod, args, out):  # (returns None: the output stays)
            seen.setdefault(name, (out if which == "out" else args[0]).detach().clone())
        return hook
    handles = [layer.dispatcher.register_forward_hook(keep("routed", "in"))]
    if layer.fc1_latent_proj is not None:
        handles.append(layer.fc1_latent_proj.register_forward_hook(keep("latent", "out")))
    else:
        handles.append(layer.router.register_forward_hook(keep("latent", "in")))
    tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples))
    for h in handles:
        h.remove()
    for c in tr.model_chunks:
        c.zero_grad(set_to_none=True)
    if m.moe_latent_size and seen["routed"].shape[-1] != m.moe_latent_size:
        missing.append(f"routed width {seen['routed'].shape[-1]}")
    scaled = not torch.allclose(seen["routed"], seen["latent"])
    if scaled != m.moe_apply_probs_on_input:
        missing.append(f"probabilities on the input: {scaled}")
    return missing


def run_steps(cfg, mesh, steps=STEPS):
    from loom.training.trainer import Trainer
    tr = Trainer(cfg, mesh=mesh)
    out = [features_ran(tr)]
    for _ in range(steps):
        loss = tr.global_loss(tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples)))
        grads = {n: (p.grad.detach().clone(), tr.registry[n])
                 for c in tr.model_chunks for n, p in c.named_parameters()}
        out.append((loss, grads, tr.optimizer_step()))
        tr.consumed_samples += tr.global_batch
    return tr, out[1:], out[0]


def parity(cases) -> list[dict]:
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.registry import local_shard
    world, results = dist.get_world_size(), []
    for case in cases:
        cfg = make_cfg(**case).validate(world)
        ref_cfg = copy.deepcopy(cfg)
        ref_cfg.parallel.tensor_model_parallel_size = 1
        ref_cfg.parallel.pipeline_model_parallel_size = 1
        ref_cfg.parallel.expert_model_parallel_size = 1
        ref_cfg.parallel.expert_tensor_parallel_size = None
        ref_cfg.parallel.sequence_parallel = False
        ref_cfg.parallel.context_parallel_size = 1
        _, ref, _ = run_steps(ref_cfg.validate(1), ParallelMesh.single())
        p = cfg.parallel
        mesh = ParallelMesh.build(tp=p.tensor_model_parallel_size,
                                  pp=p.pipeline_model_parallel_size,
                                  cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                                  etp=p.expert_tensor_parallel_size)
        _, par, missing = run_steps(cfg, mesh)
        errors, compared = list(missing), 0
        for step, ((loss, grads, norm), (rloss, rgrads, rnorm)) in enumerate(zip(par, ref)):
            if not math.isclose(loss, rloss, rel_tol=PARITY_RTOL):
                errors.append(f"step {step}: loss {loss} != {rloss}")
            if not math.isclose(norm, rnorm, rel_tol=PARITY_RTOL):
                errors.append(f"step {step}: grad norm {norm} != {rnorm}")
            for name, (g, meta) in grads.items():
                want = local_shard(rgrads[name][0], meta, *mesh.shard_of(meta))
                compared += 1
                if not torch.allclose(g, want, rtol=PARITY_RTOL,
                                      atol=PARITY_RTOL * want.abs().max().item()):
                    errors.append(f"step {step}: grad {name} max err "
                                  f"{(g - want).abs().max().item():.2e}")
        results.append({"case": case, "errors": errors, "compared": compared})
    return results


def _check(results, n):
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == n
        for r in per_rank:
            assert r["compared"] > 0
            assert not r["errors"], f"rank {rank} {r['case']}: " + "; ".join(r["errors"][:4])


def count_all_to_alls(ep: int) -> dict:
    """Token all-to-alls (float tensors) on the EP group in one MoE layer's forward and
    backward, and the count exchanges (int tensors)."""
    import torch.distributed as dist

    from loom.models import get_family
    from loom.models.family import StageSpec
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_chunk
    from loom.parallel.random import RNGTracker
    mesh = ParallelMesh.build(ep=ep) if ep > 1 else ParallelMesh.single()
    cfg = make_cfg(ep=ep).model
    tracker = RNGTracker(mesh.device)
    tracker.seed(0)
    mlp = build_chunk(get_family("gpt"), cfg, StageSpec([0], False, False), mesh,
                      tracker).layers["0"].mlp
    calls = {"forward": 0, "backward": 0, "counts": 0}
    phase = ["forward"]
    original = dist.all_to_all_single

    def counting(out, inp, *args, **kwargs):
        if inp.is_floating_point():
            calls[phase[0]] += 1
        else:
            calls["counts"] += 1
        return original(out, inp, *args, **kwargs)

    dist.all_to_all_single = counting
    try:
        x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(dist.get_rank()),
                        requires_grad=True)
        y = mlp(x)
        phase[0] = "backward"
        y.sum().backward()
    finally:
        dist.all_to_all_single = original
    return calls


def world2() -> dict:
    cases = [dict(ep=2), dict(ep=2, k=1), dict(ep=2, shared=16, score="sigmoid"),
             dict(ep=2, capacity=1.0), dict(tp=2, shared=16), dict(ep=1),
             dict(tp=2, sp=True, shared=16), dict(cp=2, shared=16), dict(tp=2, etp=1, shared=16),
             dict(tp=2, sp=True, shared=16, latent=16)]
    return {"parity": parity(cases), "a2a2": count_all_to_alls(2), "a2a1": count_all_to_alls(1)}


def world4() -> list:
    return parity([dict(ep=2, tp=2, shared=16), dict(ep=2), dict(ep=4),
                   dict(ep=2, pp=2, layers=4), dict(ep=2, tp=2, sp=True), dict(ep=2, cp=2),
                   dict(ep=2, tp=2, etp=1, sp=True, shared=16),
                   dict(ep=2, tp=2, sp=True, k=1, shared=16, latent=16, probs_on_input=True)])


@pytest.fixture(scope="module")
def results2():
    return run_distributed(2, world2, timeout=600)


def test_parity_two_ranks(results2):
    _check([r["parity"] for r in results2], 10)


def test_parity_four_ranks():
    _check(run_distributed(4, world4, timeout=600), 8)


def test_two_all_to_alls_forward_two_backward(results2):
    for r in results2:
        assert r["a2a2"]["forward"] == 2 and r["a2a2"]["backward"] == 2, r["a2a2"]
        assert r["a2a2"]["counts"] == 1, r["a2a2"]  # the per-expert counts, exchanged first
        assert r["a2a1"] == {"forward": 0, "backward": 0, "counts": 0}


def test_load_balancing_and_z_loss_by_hand():
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    r = route(logits, k=1, aux_coeff=0.5, z_coeff=0.1)
    probs = logits.softmax(-1)
    f = torch.tensor([1, 1, 0, 1]) / 3.0  # expert 0, 1, 3 chosen once each
    assert torch.allclose(r.aux_loss, 0.5 * 4 * (f * probs.mean(0)).sum())
    assert torch.allclose(r.z_loss, 0.1 * torch.logsumexp(logits, -1).pow(2).mean())
    assert r.counts.tolist() == [1, 1, 0, 1]


def test_capacity_drops_the_lowest_weights():
    # 4 tokens all prefer expert 0; E=2, k=1, capacity ceil(1.0 * 4 * 1 / 2) = 2 tokens
    logits = torch.tensor([[3.0, 0.0], [1.0, 0.0], [2.0, 0.0], [4.0, 0.0]])
    r = route(logits, k=1, capacity_factor=1.0)
    assert r.kept.squeeze(1).tolist() == [True, False, False, True]  # the 2 highest weights
    assert int((~r.kept).sum()) == 2 and r.counts.tolist() == [2, 0]
    assert torch.all(r.weights[~r.kept] == 0)


def resume_world(tmp: str) -> dict:
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    world = dist.get_world_size()
    cfg = make_cfg(ep=2).validate(world)
    tr = Trainer(cfg, mesh=ParallelMesh.build(ep=2))
    for _ in range(2):
        tr.train_step()
    tr.save(tmp)
    want = [tr.train_step()["loss"] for _ in range(2)]
    out = {"want": want}
    for name, kw in (("ep1", dict(ep=1)),
                     ("tp2-ep4-etp1", dict(tp=2, ep=4, etp=1))):  # EP over TP x DP ranks
        c = make_cfg(**kw).validate(world)
        t2 = Trainer(c, mesh=ParallelMesh.build(tp=kw.get("tp", 1), ep=kw["ep"],
                                                etp=kw.get("etp")))
        t2.load(tmp)
        if name == "tp2-ep4-etp1":  # saved from Megatron's expert grid, read back at EP 2
            out["grid_ep_tp"] = sorted(r % 2 for r in t2.mesh.ranks["ep"])
            t2.save(tmp + "-grid")
        out[name] = [t2.train_step()["loss"] for _ in range(2)]
    t3 = Trainer(cfg, mesh=ParallelMesh.build(ep=2))
    t3.load(tmp + "-grid")
    out["from-grid"] = [t3.train_step()["loss"] for _ in range(2)]
    return out


def test_checkpoint_moves_between_ep_sizes(tmp_path):
    for r in run_distributed(4, resume_world, str(tmp_path), timeout=600):
        assert r["grid_ep_tp"] == [0, 0, 1, 1], r  # the EP group held both TP ranks
        for ep in ("ep1", "tp2-ep4-etp1", "from-grid"):
            assert all(math.isclose(a, b, rel_tol=PARITY_RTOL) for a, b in zip(r[ep], r["want"])), r


@pytest.mark.parametrize("change,world,flag", [
    (dict(experts=3, ep=2), 2, "--num-experts 3 is not divisible by --expert-model-parallel"),
    (dict(ep=4), 2, "--expert-model-parallel-size 4 must divide the 2 ranks of a pipeline"),
    (dict(tp=2, ep=4, etp=1, pp=2), 4, "--expert-model-parallel-size 4 must divide the 2 ranks"),
    (dict(k=5), 1, "--moe-router-topk 5 must lie in"),
    (dict(tp=2, etp=4), 8, "--expert-tensor-parallel-size 4 must divide --tensor-model-paral"),
    (dict(experts=None, ep=2), 2, "--expert-model-parallel-size needs --num-experts"),
])
def test_bad_moe_layouts_refused(change, world, flag):
    with pytest.raises(ConfigError, match=flag):
        make_cfg(**change).validate(world)


def test_moe_generation_with_cache_matches_recomputation(tmp_path):
    from loom.inference.generate import SamplingConfig, generate
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    model = build_model(get_family("gpt"), make_cfg(shared=16).model, ParallelMesh.single()).eval()
    prompt = [3, 14, 15, 92, 65]
    cached = generate(model, prompt, 5, SamplingConfig(greedy=True))
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(5):
            seq.append(int(model(torch.tensor([seq]))[0, -1, :100].argmax()))
    assert cached == seq[len(prompt):]


def test_moe_metrics_reach_the_log():
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    tr = Trainer(make_cfg(shared=16).validate(1), mesh=ParallelMesh.single())
    rec = tr.train_step()
    assert rec["moe_aux_loss"] > 0 and rec["moe_z_loss"] > 0
    assert rec["moe_load_max"] >= rec["moe_load_min"] and rec["moe_load_imbalance"] >= 1.0
