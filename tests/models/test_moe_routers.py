"""MoE routers (issue 24 item 3) and the parity rows of items 3-4: sigmoid scores with the
aux-loss-free expert bias (--moe-router-enable-expert-bias, --moe-router-bias-update-rate),
--moe-router-load-balancing-type aux_loss|seq_aux_loss|global_aux_loss|none, group-limited
routing (--moe-router-num-groups / --moe-router-group-topk), --moe-router-topk-scaling-factor,
--moe-router-dtype fp32|fp64, both dispatchers (--moe-token-dispatcher-type), --moe-grouped-gemm,
expert linear biases under TP, --moe-shared-expert-overlap and --moe-layer-freq lists.

Parity rows: loss, every gradient and the grad norm equal to the single-process run (rtol 1e-5,
3 steps) at EP=2 and EP=2 x TP=2 + SP, each option asserted active (router outputs recorded);
the expert bias identical on every rank and equal to the single-process bias; the bias in
checkpoints, loaded at EP=1 and EP=4. Single-process: the router against DeepSeek-V3's gate
(transformers' formula), the losses by hand, the bias update by hand, flag parsing and refusals.
The router's noise options: tests/models/test_moe_router_noise.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from loom.config import ConfigError, LoomConfig
from loom.config.model_moe import parse_moe_layer_freq
from loom.models.moe import route
from testkit import run_distributed
from testkit.numerics import PARITY_RTOL
from testkit.config import PARITY_ADAM_EPS, tiny_config

STEPS = 3

# DeepSeek-V3-style: every router option of item 3 at once, allgather + grouped GEMM
DEEPSEEK = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.01, moe_router_num_groups=4,
                moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                moe_router_load_balancing_type="seq_aux_loss", moe_router_dtype="fp64",
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=True,
                moe_shared_expert_intermediate_size=16, moe_layer_freq="[0,1]")
# softmax + micro-batch aux loss, all-to-all with the shared expert overlapped, linear biases,
# per-head QK norms (--qk-layernorm: their gradients are partial over TP)
BIASED = dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_overlap=True,
              moe_shared_expert_intermediate_size=16, disable_bias_linear=False,
              qk_layernorm=True)
NO_BALANCING = dict(moe_router_score_function="sigmoid", moe_router_topk=1,
                    moe_router_load_balancing_type="none",
                    moe_token_dispatcher_type="flex")  # Megatron's DeepEP kernels: alltoall here
GLOBAL_AUX = dict(moe_router_load_balancing_type="global_aux_loss", moe_grouped_gemm=True)


def make_cfg(tp=1, ep=1, sp=False, cp=1, **model) -> LoomConfig:
    return tiny_config("moe", {"num_experts": 8, "moe_router_topk": 4, **model},
                       tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                       sequence_parallel=sp, context_parallel_size=cp, global_batch_size=8,
                       adam_eps=PARITY_ADAM_EPS)


def routers(tr) -> dict:
    return {n: m for c in tr.model_chunks for n, m in c.named_modules()
            if n.endswith("mlp.router")}


def run_steps(cfg, mesh, steps=STEPS, tr=None):
    """Loss, gradients (by name, with their ParamMeta), grad norm and every router's expert
    bias per step; plus what the routers produced (recorded by forward hooks). ``tr``: a
    trainer already built (then ``cfg`` and ``mesh`` are its)."""
    from loom.training.trainer import Trainer
    tr = Trainer(cfg, mesh=mesh) if tr is None else tr
    seen = []
    for r in routers(tr).values():
        r.register_forward_hook(lambda mod, args, out: seen.append(out))
    out = []
    for _ in range(steps):
        loss = tr.global_loss(tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples)))
        grads = {n: (p.grad.detach().clone(), tr.registry[n])
                 for c in tr.model_chunks for n, p in c.named_parameters() if p.grad is not None}
        metrics = dict(tr.last_metrics)
        norm = tr.optimizer_step()
        bias = {n: r.expert_bias.detach().clone() for n, r in routers(tr).items()
                if r.expert_bias is not None}
        out.append((loss, grads, norm, bias, metrics))
        tr.consumed_samples += tr.global_batch
    return tr, out, seen


def activity(cfg, tr, seen, steps) -> list[str]:
    """Which options were demonstrably active in this run (empty list = something was off)."""
    m, missing = cfg.model, []
    r = seen[-1]
    if m.moe_router_dtype == "fp64" and r.weights.dtype != torch.float64:
        missing.append("fp64 router")
    if m.moe_router_topk_scaling_factor and not torch.allclose(
            r.weights.sum(-1), torch.full_like(r.weights[:, 0], m.moe_router_topk_scaling_factor)):
        missing.append("scaling factor")
    if m.moe_router_group_topk:
        per_group = m.num_experts // m.moe_router_num_groups
        groups = [len(set((row // per_group).tolist())) for row in r.experts]
        if max(groups) > m.moe_router_group_topk or max(groups) < 2:
            missing.append("group-limited routing")
    if m.moe_router_enable_expert_bias and not all(b.abs().sum() > 0 for b in steps[-1][3].values()):
        missing.append("expert bias")
    aux = float(steps[0][4].get("moe aux loss", 0.0))
    if (m.moe_router_load_balancing_type == "none") != (aux == 0.0):
        missing.append(f"balancing {m.moe_router_load_balancing_type} (aux {aux})")
    for layer in (mod for c in tr.model_chunks for n, mod in c.named_modules()
                  if n.endswith(".mlp") and hasattr(mod, "router")):
        d = layer.dispatcher
        kind = "allgather" if m.moe_token_dispatcher_type == "allgather" else "alltoall"
        if tr.mesh.ep_size > 1 and getattr(d, "kind", None) != kind:
            missing.append("dispatcher type")
        run = d.run_experts.__name__
        if m.moe_grouped_gemm != (run == "run_experts_grouped") or \
                getattr(layer.experts, "_grouped_fallback_logged", False):
            missing.append(f"grouped GEMM ({run})")
        if m.moe_shared_expert_overlap and tr.mesh.ep_size > 1 and not d.overlap_shared:
            missing.append("shared expert overlap")
    if not m.disable_bias_linear and not any(n.endswith("linear_fc2.bias") for n in steps[0][1]):
        missing.append("expert biases")
    if m.qk_layernorm and not any(n.endswith("k_layernorm.weight") for n in steps[0][1]):
        missing.append("qk layernorm")
    return missing


def reference(case: dict) -> list:
    """The single-process run of ``case`` (computed once, in the test process)."""
    from loom.parallel.mesh import ParallelMesh
    cfg = make_cfg(**{**case, "tp": 1, "ep": 1, "sp": False, "cp": 1}).validate(1)
    return [(loss, {n: g for n, (g, _) in grads.items()}, norm, bias)
            for loss, grads, norm, bias, _ in run_steps(cfg, ParallelMesh.single())[1]]


def parity(cases: list, refs: list) -> list[dict]:
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.registry import local_shard
    world, results = dist.get_world_size(), []
    for case, ref in zip(cases, refs):
        cfg = make_cfg(**case).validate(world)
        p = cfg.parallel
        mesh = ParallelMesh.build(tp=p.tensor_model_parallel_size, cp=p.context_parallel_size,
                                  ep=p.expert_model_parallel_size)
        tr, par, seen = run_steps(cfg, mesh)
        errors, compared = activity(cfg, tr, seen, par), 0
        for step, (a, b) in enumerate(zip(par, ref)):
            (loss, grads, norm, bias, _), (rloss, rgrads, rnorm, rbias) = a, b
            if not math.isclose(loss, rloss, rel_tol=PARITY_RTOL):
                errors.append(f"step {step}: loss {loss} != {rloss}")
            if not math.isclose(norm, rnorm, rel_tol=PARITY_RTOL):
                errors.append(f"step {step}: grad norm {norm} != {rnorm}")
            if set(grads) - set(rgrads):
                errors.append(f"unknown grads {sorted(set(grads) - set(rgrads))}")
            for name, (g, meta) in grads.items():
                want = local_shard(rgrads[name], meta, mesh.tp_rank, mesh.tp_size)
                compared += 1
                if not torch.allclose(g, want, rtol=PARITY_RTOL,
                                      atol=PARITY_RTOL * want.abs().max().item()):
                    errors.append(f"step {step}: grad {name} max err "
                                  f"{(g - want).abs().max().item():.2e}")
            for name, b in bias.items():
                if not torch.allclose(b, rbias[name], rtol=0, atol=1e-7):
                    errors.append(f"step {step}: expert bias {name} {b} != {rbias[name]}")
        biases = {n: b.tolist() for n, b in par[-1][3].items()}
        results.append({"case": case, "errors": errors, "compared": compared, "bias": biases})
    return results


def check(results, n) -> None:
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == n
        for r in per_rank:
            assert r["compared"] > 0
            assert not r["errors"], f"rank {rank} {r['case']}: " + "; ".join(r["errors"][:4])
    for i in range(n):  # the expert bias is identical on every rank
        assert all(per_rank[i]["bias"] == results[0][i]["bias"] for per_rank in results)


def bias_checkpoint(tmp: str) -> dict:
    """Expert bias saved at EP=2 (d=4), loaded at EP=1 and EP=4: same bias, same losses."""
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    world = dist.get_world_size()
    case = dict(DEEPSEEK, moe_token_dispatcher_type="alltoall")
    tr = Trainer(make_cfg(ep=2, **case).validate(world), mesh=ParallelMesh.build(ep=2))
    tr.train_step()  # one step: every bias is +-rate (a second one may flip it back to 0)
    tr.save(tmp)
    saved = {n: r.expert_bias.tolist() for n, r in routers(tr).items()}
    out = {"want": [tr.train_step()["loss"] for _ in range(2)], "saved": saved}
    for ep in (1, 4):
        t2 = Trainer(make_cfg(ep=ep, **case).validate(world), mesh=ParallelMesh.build(ep=ep))
        t2.load(tmp)
        out[f"bias{ep}"] = {n: r.expert_bias.tolist() for n, r in routers(t2).items()}
        out[f"ep{ep}"] = [t2.train_step()["loss"] for _ in range(2)]
    return out


# (case, layouts): EP=2 (x DP=2) and EP=2 x TP=2 + SP; global_aux_loss at TP=2 + SP x CP=2,
# the 4-rank layout with d = 1 (its running load over the step's micro-batches depends on how
# they are split over DP ranks, as in Megatron, so it is 1-rank-identical only at d = 1)
CASES = [dict(ep=2, **DEEPSEEK), dict(ep=2, tp=2, sp=True, **DEEPSEEK), dict(ep=2, **BIASED),
         dict(ep=2, tp=2, sp=True, **BIASED), dict(ep=4, **NO_BALANCING),
         dict(tp=2, sp=True, cp=2, **GLOBAL_AUX)]


def world4(tmp: str, refs: list) -> dict:
    return {"parity": parity(CASES, refs), "ckpt": bias_checkpoint(tmp)}


def test_router_parity_and_bias_checkpoint(tmp_path):
    refs = [reference(case) for case in CASES]
    results = run_distributed(4, world4, str(tmp_path), refs, timeout=600, start_method="fork")
    check([r["parity"] for r in results], len(CASES))
    for r in results:
        c = r["ckpt"]
        assert any(any(v != 0 for v in b) for b in c["saved"].values())
        for ep in (1, 4):
            assert c[f"bias{ep}"] == c["saved"], ep
            assert all(math.isclose(a, b, rel_tol=PARITY_RTOL)
                       for a, b in zip(c[f"ep{ep}"], c["want"]))


# ---------------------------------------------------------------- single process ----------

def deepseek_v3_gate(logits, bias, k, groups, group_topk, scale):
    """DeepSeek-V3's gate as transformers writes it (DeepseekV3TopkRouter.forward, written out
    here: importing its modeling module costs seconds): groups scored by their top-2 biased
    scores, the best ``group_topk`` kept, top-k of the biased scores inside them, weights the
    unbiased scores normalized (+1e-20) and scaled. Returns ``[T, E]`` combine weights."""
    T, E = logits.shape
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(T, groups, E // groups).topk(2, dim=-1)[0].sum(-1)
    keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(group_topk, -1)[1], 1)
    mask = keep.unsqueeze(-1).expand(T, groups, E // groups).reshape(T, E)
    idx = choice.masked_fill(~mask.bool(), float("-inf")).topk(k, dim=-1)[1]
    w = scores.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * scale
    return torch.zeros(T, E).scatter(1, idx, w)


def test_router_matches_the_deepseek_v3_gate():
    """Sigmoid + expert bias + group-limited top-k + scaling factor == DeepSeek-V3's gate."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 16, generator=g)
    bias = torch.randn(16, generator=g) * 0.3
    r = route(logits, 4, "sigmoid", expert_bias=bias, num_groups=4, group_topk=2,
              scaling_factor=2.5)
    got = torch.zeros(64, 16).scatter(1, r.experts, r.weights)
    assert torch.allclose(got, deepseek_v3_gate(logits, bias, 4, 4, 2, 2.5), atol=1e-6)
    no_bias = route(logits, 4, "sigmoid", num_groups=4, group_topk=2)
    assert not torch.equal(no_bias.experts.sort(-1).values, r.experts.sort(-1).values)


def test_load_balancing_types_by_hand():
    g = torch.Generator().manual_seed(1)
    s, b, E, k = 5, 3, 4, 2
    logits = torch.randn(s * b, E, generator=g, dtype=torch.float64)
    probs = logits.softmax(-1)
    assert float(route(logits, k, aux_coeff=0.1, balancing="none").aux_loss) == 0.0
    seq = route(logits, k, aux_coeff=0.1, balancing="seq_aux_loss", seq_batch=(s, b)).aux_loss
    per_seq = [route(logits.view(s, b, E)[:, i], k, aux_coeff=0.1).aux_loss for i in range(b)]
    assert torch.allclose(seq, sum(per_seq) / b)
    # global: n over the step's micro-batches so far (here one rank, two micro-batches)
    seen = []

    def load(n):
        seen.append(n)
        return sum(seen) / len(seen), float(s * b)
    route(logits, k, aux_coeff=0.1, balancing="global_aux_loss", global_load=load)
    second = route(logits.flip(0), k, aux_coeff=0.1, balancing="global_aux_loss",
                   global_load=load).aux_loss
    n = (seen[0] + seen[1]) / 2
    want = 0.1 * E / (k * (s * b) ** 2) * (n * probs.flip(0).sum(0)).sum()
    assert torch.allclose(second, want)


def test_router_dtype_fp64_and_sigmoid_top1_unnormalized():
    from loom.models.moe_router import TopKRouter
    cfg = make_cfg(moe_router_dtype="fp64", moe_router_score_function="sigmoid",
                   moe_router_topk=1).validate(1).model
    router = TopKRouter(cfg)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
    x = torch.randn(6, 32)
    r = router(x, (3, 2))
    assert r.weights.dtype == torch.float64
    want = torch.nn.functional.linear(x.double(), router.weight.double()).sigmoid().max(-1).values
    assert torch.allclose(r.weights[:, 0], want)  # k = 1: the sigmoid score itself (Megatron)


def test_expert_bias_update_by_hand():
    """b += rate * sign(mean(n) - n), n the step's kept assignments; counted once per forward
    (not in evaluation), reset after the update."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    cfg = make_cfg(**{**DEEPSEEK, "moe_layer_freq": "1"}).validate(1)
    tr = Trainer(cfg, mesh=ParallelMesh.single())
    tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples))
    n = {name: r.tokens_per_expert.clone() for name, r in routers(tr).items()}
    assert all(int(v.sum()) == 8 * 8 * 4 for v in n.values())  # B s k assignments
    tr.optimizer_step()
    for name, r in routers(tr).items():
        want = 0.01 * torch.sign(n[name].mean() - n[name])
        assert torch.allclose(r.expert_bias, want) and r.tokens_per_expert is None
    tr.evaluate(1)
    assert all(r.tokens_per_expert is None for r in routers(tr).values())


def test_moe_layer_freq_list_expressions():
    assert parse_moe_layer_freq("([0]*3+[1]*58)", 61) == [0] * 3 + [1] * 58
    assert parse_moe_layer_freq("[1,0,1]", 3) == [1, 0, 1]
    assert parse_moe_layer_freq(2, 4) == [1, 0, 1, 0] == parse_moe_layer_freq("2", 4)
    assert parse_moe_layer_freq("([1]*3+[0]*2)*2", 10) == ([1] * 3 + [0] * 2) * 2
    for bad in ("__import__('os').getcwd()", "[1,2,1]", "[1]*x", "[1,0]", "0"):
        with pytest.raises(ConfigError, match="--moe-layer-freq"):
            parse_moe_layer_freq(bad, 3)
    cfg = make_cfg(num_layers=3, moe_layer_freq="[0]+[1]*2").validate(1)
    assert [cfg.model.is_moe_layer(i) for i in range(3)] == [False, True, True]


@pytest.mark.parametrize("change,flag", [
    (dict(moe_router_num_groups=4), "--moe-router-group-topk"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "--moe-router-num-groups 3"),
    (dict(moe_shared_expert_overlap=True), "--moe-shared-expert-overlap needs"),
    (dict(moe_layer_freq="[1]"), "--moe-layer-freq"),
    (dict(moe_apply_probs_on_input=True), "--moe-apply-probs-on-input works with top-1"),
    (dict(moe_latent_size=16, moe_shared_expert_overlap=True, moe_token_dispatcher_type="alltoall",
          moe_shared_expert_intermediate_size=16), "--moe-latent-size with --moe-shared-expert-o"),
    (dict(moe_input_jitter_eps=0.0), "--moe-input-jitter-eps"),
    (dict(moe_latent_size=0), "--moe-latent-size"),
])
def test_bad_router_flags_refused(change, flag):
    with pytest.raises(ConfigError, match=flag) as e:
        make_cfg(**change).validate(1)
    assert "\n" not in str(e.value)  # one line


def _global_aux_run(method=None, layers=1, replay: bool = True):
    """3 steps of a 4-micro-batch global_aux_loss run, with full recomputation (``method``
    uniform or block, ``layers`` per group) or none; the router's replay switched off with
    ``replay`` False (the recomputation then reads its micro-batch alone: the behaviour before
    the replay). Returns the steps and the routers' ``replay_mode`` at each forward."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    cfg = make_cfg(**GLOBAL_AUX)
    if method:
        cfg.training.recompute_granularity, cfg.training.recompute_method = "full", method
        cfg.training.recompute_num_layers = layers
    cfg = cfg.validate(1)
    assert cfg.derived.num_microbatches == 4
    tr = Trainer(cfg, mesh=ParallelMesh.single())
    modes = []
    for r in routers(tr).values():
        r.register_forward_hook(lambda mod, args, out: modes.append(mod.replay_mode))
        if not replay:
            r.replayed = lambda compute: compute()
    _, steps, _ = run_steps(cfg, None, tr=tr)
    return steps, modes


def test_global_aux_loss_with_recomputation_parity():
    """Parity row: --recompute-granularity full with global_aux_loss (a load running over the
    step's micro-batches) gives the loss and every gradient of the run without recomputation
    (fp32, rtol 1e-5, 3 steps): the recomputed forward replays the load of its first run.
    Uniform groups of 2 layers (the second layer's router runs inside the first's checkpoint)
    and block. Active: every router forward was recorded once and replayed once, the global aux
    loss is in the metrics; without the replay the gradients differ (the check can fail)."""
    plain, plain_modes = _global_aux_run()
    assert set(plain_modes) == {None} and float(plain[0][4]["moe aux loss"]) > 0
    for method, layers in (("uniform", 2), ("block", 2)):
        again, modes = _global_aux_run(method, layers)
        assert modes.count("record") == modes.count("replay") == len(plain_modes) > 0
        for (l0, g0, n0, _, m0), (l1, g1, n1, _, m1) in zip(plain, again):
            assert math.isclose(l0, l1, rel_tol=PARITY_RTOL) \
                and math.isclose(n0, n1, rel_tol=PARITY_RTOL)
            assert float(m1["moe aux loss"]) == pytest.approx(float(m0["moe aux loss"]),
                                                              rel=PARITY_RTOL)
            assert g0.keys() == g1.keys()
            for name, (g, _) in g0.items():
                torch.testing.assert_close(g1[name][0], g, rtol=PARITY_RTOL, atol=1e-7, msg=name)
    unreplayed, _ = _global_aux_run("uniform", 2, replay=False)
    router_grads = [n for n in plain[0][1] if n.endswith("router.weight")]
    assert len(router_grads) == 2 and any(
        not torch.allclose(unreplayed[0][1][n][0], plain[0][1][n][0], rtol=PARITY_RTOL, atol=1e-7)
        for n in router_grads)


def test_rerun_restores_the_routers_running_load():
    """Megatron's rerun state machine (loom/training/rerun.py) reruns an iteration from the
    routers' loads at its start: with global_aux_loss and the aux-loss-free bias, a transient
    fault injected into every validated iteration (spike check, non-fatal) leaves the losses
    and expert biases of the run without it (a load counted twice would change the average)."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    runs = []
    for ft in ({}, dict(no_check_for_nan_in_loss_and_grad=True, check_for_spiky_loss=True,
                        error_injection_rate=1)):
        cfg = make_cfg(**GLOBAL_AUX, moe_router_score_function="sigmoid",
                       moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)
        cfg.training.train_iters, cfg.logging.eval_iters = 3, 0
        for k, v in ft.items():
            setattr(cfg.fault_tolerance, k, v)
        tr = Trainer(cfg.validate(1), mesh=ParallelMesh.single())
        losses = [r["loss"] for r in tr.train()]
        runs.append((losses, [r.expert_bias.clone() for r in routers(tr).values()],
                     tr.rerun.reruns))
    (l0, b0, n0), (l1, b1, n1) = runs
    assert (n0, n1) == (0, 2) and l0 == l1 and len(b0) == 2
    assert all(torch.equal(a, b) and a.abs().sum() > 0 for a, b in zip(b0, b1))


def test_expert_bias_accepted_under_zero3():
    """FSDP2 keeps the bias whole (tests/parallel/test_fsdp.py: parity with EP and a bias)."""
    cfg = make_cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    cfg.training.zero_stage = 3
    assert cfg.validate(1).model.moe_router_enable_expert_bias


def test_force_load_balancing_randomizes_logits_straight_through():
    """--moe-router-force-load-balancing (benchmarks): N(0, 1) logits, so the load spreads
    whatever the router weights, and the router still gets the straight-through gradient."""
    from loom.models.moe_router import TopKRouter
    cfg = make_cfg(moe_router_force_load_balancing=True).validate(1).model
    router = TopKRouter(cfg)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0] = 1.0  # without the flag every token would pick expert 0 first
    torch.manual_seed(0)
    x = torch.ones(256, 32)
    r = router(x, (256, 1))
    assert int(r.counts.min()) > 0 and int(r.counts.max()) < 256
    r.weights.sum().backward()
    assert router.weight.grad is not None


@pytest.mark.parametrize("k", [1, 2, 4])
def test_sinkhorn_routing_matches_megatron_core(k):
    """--moe-router-load-balancing-type sinkhorn against Megatron-Core's own
    ``TopKRouter.sinkhorn_load_balancing`` (megatron-core 0.16.1, the same code as d98e8a6):
    in training the experts of the Sinkhorn-balanced assignment, in evaluation the top k of
    the scores; the weights sigmoid (k = 1) or softmax scores, unnormalized. Experts equal,
    weights and the logits' gradient equal; training picks differ from the plain top k (the
    balancing ran), and the balanced matrix's rows and columns sum to 1/T and 1/E."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter as MegatronRouter

    from loom.models.moe_router import sinkhorn
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(64, 8, generator=g) * 2 + torch.linspace(0, 3, 8)  # skewed load
    picks = {}
    for training in (True, False):
        fake = SimpleNamespace(topk=k, training=training,
                               config=SimpleNamespace(moe_aux_loss_coeff=0))
        ref_in = logits.clone().requires_grad_(True)
        ref_w, ref_map = MegatronRouter.sinkhorn_load_balancing(fake, ref_in)
        got_in = logits.clone().requires_grad_(True)
        r = route(got_in, k, balancing="sinkhorn", training=training)
        got_w = torch.zeros(64, 8).scatter(1, r.experts, r.weights)
        assert torch.equal(torch.zeros(64, 8, dtype=torch.bool).scatter(1, r.experts, True),
                           ref_map)
        torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=0)
        upstream = torch.randn(64, 8, generator=g)
        (ref_w * upstream).sum().backward()
        (got_w * upstream).sum().backward()
        torch.testing.assert_close(got_in.grad, ref_in.grad, rtol=1e-6, atol=1e-9)
        assert float(r.aux_loss) == 0.0
        picks[training] = ref_map
    assert not torch.equal(picks[True], picks[False])  # the balanced assignment differs
    balanced = sinkhorn(logits)
    torch.testing.assert_close(balanced, moe_utils.sinkhorn(logits), rtol=1e-6, atol=0)
    torch.testing.assert_close(balanced.sum(0), torch.full((8,), 1 / 8), rtol=1e-3, atol=0)
    torch.testing.assert_close(balanced.sum(1), torch.full((64,), 1 / 64), rtol=1e-2, atol=0)


def test_sinkhorn_router_module_follows_train_and_eval():
    """The router module picks the balanced experts in training and the plain top k in
    evaluation (Megatron's ``self.training``); the z-loss still applies."""
    from loom.models.moe_router import TopKRouter
    cfg = make_cfg(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0,
                   moe_router_topk=2).validate(1).model
    router = TopKRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.2)
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(0)) + 1.0
    train = router(x, (48, 1))
    router.eval()
    evaluation = router(x, (48, 1))
    assert not torch.equal(train.experts, evaluation.experts)
    assert train.counts.max() < evaluation.counts.max()  # balanced: a flatter load
    assert float(train.z_loss.detach()) > 0


@pytest.mark.parametrize("change,flag", [
    (dict(moe_aux_loss_coeff=0.01), "--moe-aux-loss-coeff"),
    (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function"),
    (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=2), "--moe-router-num-groups"),
    (dict(moe_router_topk_scaling_factor=2.0), "--moe-router-topk-scaling-factor"),
])
def test_sinkhorn_refuses_what_it_would_ignore(change, flag):
    kw = dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0)
    with pytest.raises(ConfigError, match=flag):
        make_cfg(**{**kw, **change}).validate(1)
