"""``--optimizer muon`` (Megatron-LM d98e8a6's Muon: Megatron-Core's ``TensorParallelMuon`` over
emerging_optimizers 0.3.0; loom/training/muon.py) against its formula, and its parity at TP=2 x
PP=2 x DP=2 on 8 gloo ranks (CPU, fp32, no dropout), one spawned world for every case.

* Newton-Schulz against a direct fp64 implementation of the iteration, for every coefficient set
  (rtol 1e-5 in fp32; ``--muon-fp32-matmul-prec medium`` runs it in bf16: close, not equal).
* One step of a GPT-MoE model against Megatron's update written out here: decoupled weight
  decay, momentum EMA (and Nesterov), the fused QKV split into query, key and value rows, each
  expert's matrices on their own, spectral scale x --muon-extra-scale-factor; AdamW for the
  embeddings, output layer, norms and biases.
* Parity with the single-process run for 3 steps (loss, every gradient, the clipped norm and
  the parameters after the steps, rtol 1e-5) of a GQA + MoE model (4 experts, EP=2 over DP,
  expert weights split over TP): the plain optimizer and the distributed optimizer (ZeRO-1 with
  --overlap-grad-reduce and --overlap-param-gather, ``--optimizer dist_muon``: matrices split
  over the DP shards are summed by one all-reduce before orthogonalization). Newton-Schulz runs
  in fp32 (``--muon-fp32-matmul-prec high``): in bf16 the last-bit differences of a gradient
  summed in another order move some elements by a bf16 ulp (~4e-3), not a parity question.
* The ZeRO-1 run's Muon momentum and Adam states, saved by parameter name, load into one plain
  process and equal the single-process run's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from loom.config import LoomConfig, ModelConfig
from loom.training.muon import COEFFICIENTS, MuonSettings, newton_schulz
from testkit import run_distributed

from parity_helpers import trainer_steps
from testkit.numerics import PARITY_RTOL, rel_err
from testkit.config import tiny_config, tiny_model

STEPS = 3


# -- the formula -----------------------------------------------------------------------------------

def ns_reference(x: torch.Tensor, steps: int, kind: str) -> torch.Tensor:
    """The Newton-Schulz iteration as written: X = x / ||x||_F (of x^T when it has more rows
    than columns), then X <- a X + b (X X^T) X + c (X X^T)^2 X with emerging_optimizers'
    coefficients, in fp64."""
    sets = COEFFICIENTS[kind]
    repeat_last = kind in ("polar_express", "cans", "deepseekv4")
    t = x.shape[-2] > x.shape[-1]
    X = (x.mT if t else x).double()
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-7)
    for i in range(steps):
        a, b, c = sets[min(i, len(sets) - 1)] if repeat_last else sets[i % len(sets)]
        A = X @ X.mT
        X = a * X + b * (A @ X) + c * (A @ (A @ X))
    return (X.mT if t else X).float()


@pytest.mark.parametrize("kind", sorted(COEFFICIENTS))
def test_newton_schulz_is_the_iteration(kind):
    g = torch.Generator().manual_seed(0)
    for shape in ((12, 20), (20, 12), (3, 8, 6)):
        x = torch.randn(*shape, generator=g)
        want = ns_reference(x, 7, kind)
        got = newton_schulz(x, 7, kind, bf16=False)
        assert rel_err(got, want) < PARITY_RTOL, (kind, shape)


def test_newton_schulz_in_bf16_under_medium_precision():
    """Megatron's default (``--muon-fp32-matmul-prec medium``, quintic, 5 steps): the iterations
    run in bf16 (the result differs from fp32's by bf16 rounding) and still orthogonalize (the
    singular values land in quintic's band around 1, like fp32's)."""
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(0))
    full, half = newton_schulz(x, 5, bf16=False), newton_schulz(x, 5, bf16=True)
    err = rel_err(half, full)
    assert 1e-4 < err < 0.1, err
    for out in (full, half):
        sv = torch.linalg.svdvals(out)
        assert 0.6 < float(sv.min()) and float(sv.max()) < 1.3, sv


def _tiny_moe(**kw) -> ModelConfig:
    return tiny_model("llama", dict(group_query_attention=True, ffn_hidden_size=48,
                                    vocab_size=300, padded_vocab_size=384, num_experts=4,
                                    moe_router_topk=2, moe_ffn_hidden_size=24), kw)


def _megatron_muon_update(w, g, buf, name, meta, s: MuonSettings, lr, wd):
    """Megatron's step of one Muon-managed matrix, written out: returns (new weight, new
    momentum)."""
    w = w - lr * wd * w
    buf = s.momentum * buf + (1 - s.momentum) * g
    u = (1 - s.momentum) * g + s.momentum * buf if s.nesterov else buf
    rows = list(meta.shard.segments) if name.endswith("linear_qkv.weight") else [u.shape[0]]
    parts = []
    for part in u.split(rows):
        scale = max(part.shape) ** 0.5 * s.extra_scale  # spectral
        parts.append(ns_reference(part, s.steps, s.coefficients) * scale)
    return w - lr * torch.cat(parts), buf


@pytest.mark.parametrize("nesterov", [False, True])
def test_one_step_is_megatrons_update(nesterov):
    """Every parameter after two steps of ``build_optimizer``'s Muon equals Megatron's update
    computed here (Muon on the 2-D weights but the embedding and output layer: QKV split, router,
    each expert; AdamW with its weight-decay groups for the rest)."""
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    from loom.parallel.registry import named_parameters
    from loom.training.optimizer import build_optimizer
    cfg = LoomConfig(model=_tiny_moe())
    t = cfg.training
    t.optimizer, t.lr, t.weight_decay, t.muon_nesterov = "muon", 0.02, 0.1, nesterov
    t.muon_extra_scale_factor, t.muon_fp32_matmul_prec = 0.2, "high"
    t.micro_batch_size, t.train_iters = 2, 5
    cfg = cfg.validate(1)
    model = build_model(get_family("gpt"), cfg.model, ParallelMesh.single(), seed=5)
    opt = build_optimizer(model, cfg.training, model_cfg=cfg.model)
    s = MuonSettings.of(cfg.training)
    named = list(named_parameters([model]))
    muon = {n for n, p, _ in named if p.ndim == 2 and "embedding" not in n and
            n != "output_layer.weight"}
    assert {n for g in opt.param_groups if g["muon"] for n, p, _ in named
            if any(p is q for q in g["params"])} == muon
    assert any(".experts.3.linear_fc1" in n for n in muon) and any("router" in n for n in muon)
    ref = {n: p.detach().clone() for n, p, _ in named}
    adam = torch.optim.AdamW([{"params": [ref[n] for n, p, _ in named if n not in muon and
                                          p.ndim >= 2], "weight_decay": 0.1},
                              {"params": [ref[n] for n, p, _ in named if n not in muon and
                                          p.ndim < 2], "weight_decay": 0.0}],
                             lr=0.02, betas=(0.9, 0.999), eps=1e-8)
    bufs = {n: torch.zeros_like(ref[n]) for n in muon}
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        for n, p, meta in named:
            p.grad = torch.randn(p.shape, generator=gen)
            ref[n].grad = p.grad.clone()
            if n in muon:
                ref[n], bufs[n] = _megatron_muon_update(ref[n], p.grad, bufs[n], n, meta, s,
                                                        0.02, 0.1)
        opt.step()
        adam.step()
    for n, p, _ in named:
        err = rel_err(p, ref[n])
        assert err < PARITY_RTOL, (n, err)
        if n in muon:
            got = opt.state[p]["momentum_buffer"]
            assert rel_err(got, bufs[n]) < PARITY_RTOL, n


def test_refusals():
    from loom.errors import ConfigError
    for change, words in ((dict(fp16=True), "--optimizer muon with --fp16"),
                          (dict(zero_stage=3), "use --use-distributed-optimizer")):
        cfg = LoomConfig(model=_tiny_moe())
        t = cfg.training
        t.optimizer, t.lr, t.micro_batch_size, t.train_iters = "muon", 1e-3, 2, 5
        for k, v in change.items():
            setattr(t, k, v)
        with pytest.raises(ConfigError, match=words):
            cfg.validate(2 if change.get("zero_stage") else 1)
    cfg = LoomConfig(model=_tiny_moe())
    cfg.training.optimizer, cfg.training.lr = "dist_muon", 1e-3
    cfg.training.micro_batch_size, cfg.training.train_iters = 2, 5
    t = cfg.validate(1).training  # Megatron's old spelling: muon + the distributed optimizer
    assert (t.optimizer, t.use_distributed_optimizer) == ("muon", True)


# -- parity at TP=2 x PP=2 x DP=2 ------------------------------------------------------------------

def make_cfg(world: int, tp: int = 2, pp: int = 2, optimizer: str = "muon", og: bool = False,
             opg: bool = False) -> LoomConfig:
    return tiny_config(
        model=_tiny_moe(), tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=2 if world // (tp * pp) >= 2 else 1,
        overlap_grad_reduce=og, ddp_bucket_size=6_000,  # matrices across bucket shards
        optimizer=optimizer, overlap_param_gather=opg, muon_fp32_matmul_prec="high",
        muon_nesterov=True, muon_extra_scale_factor=0.2, weight_decay=0.1, train_iters=10,
        lr=0.01, clip_grad=0.5, global_batch_size=2 * 2 * (world // (tp * pp)),
        log_interval=10**9, no_progress_bar=True, world=world)


def single(cfg: LoomConfig) -> LoomConfig:
    ref = copy.deepcopy(cfg)
    p, t = ref.parallel, ref.training
    p.tensor_model_parallel_size = p.pipeline_model_parallel_size = 1
    p.expert_model_parallel_size, p.overlap_grad_reduce = 1, False
    t.zero_stage, t.use_distributed_optimizer, t.overlap_param_gather = 0, False, False
    return ref.validate(1)


_REF: dict = {}


def reference(cfg: LoomConfig, steps: int = STEPS) -> dict:
    key = (repr(single(cfg)), steps)
    if key not in _REF:
        from loom.parallel.mesh import ParallelMesh
        from loom.training.optimizer import optimizer_state_by_name
        from loom.training.trainer import Trainer
        tr = Trainer(single(cfg), mesh=ParallelMesh.single())
        params = dict(tr.model_chunks[0].named_parameters())
        run = trainer_steps(tr, steps)
        out = {"loss": [s[0] for s in run], "norm": [s[2] for s in run],
               "grads": [{n: g for n, (g, _) in s[1].items()} for s in run]}
        out["params"] = {n: q.detach().clone() for n, q in params.items()}
        out["states"] = optimizer_state_by_name(tr.optimizer, params)
        _REF[key] = out
    return _REF[key]


def parity_case(ref: dict, save: str | None = None, **kw) -> dict:
    import torch.distributed as dist

    from loom.parallel.grad_buffer import flat_buffers
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.registry import local_shard
    from loom.training.optimizer import local_optimizer
    from loom.training.step import finish_param_gather, grad_getter
    from loom.training.trainer import Trainer
    cfg = make_cfg(dist.get_world_size(), **kw)
    tr = Trainer(cfg, mesh=ParallelMesh.build(tp=2, pp=2, ep=2))
    owner = {id(q): r for r in flat_buffers(tr.reducers) for q in r.params}
    grad_of = grad_getter(tr.reducers)
    out = {"loss": 0.0, "grad": 0.0, "norm": 0.0, "param": 0.0, "compared": 0}

    def want(t: torch.Tensor, name: str) -> torch.Tensor:
        return local_shard(t, tr.registry[name], tr.mesh.tp_rank, tr.mesh.tp_size)
    for step in range(STEPS):
        loss = tr.global_loss(tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples)))
        out["loss"] = max(out["loss"], abs(loss - ref["loss"][step]) / abs(ref["loss"][step]))
        for chunk in tr.model_chunks:
            for name, q in chunk.named_parameters():
                lo, hi = owner[id(q)].shard_range(q)
                got = grad_of(q).reshape(-1)
                w = want(ref["grads"][step][name], name).reshape(-1)[lo:hi]
                out["grad"] = max(out["grad"], rel_err(got, w))
                out["compared"] += 1
        norm = tr.optimizer_step()
        out["norm"] = max(out["norm"], abs(norm - ref["norm"][step]) / ref["norm"][step])
        tr.consumed_samples += tr.global_batch
    finish_param_gather(tr.optimizer)
    for chunk in tr.model_chunks:
        for name, q in chunk.named_parameters():
            out["param"] = max(out["param"], rel_err(q.detach(), want(ref["params"][name], name)))
    inner = local_optimizer(tr.optimizer)
    out["optimizer"] = (type(tr.optimizer).__name__, type(inner).__name__)
    muon = [q for g in inner.param_groups if g["muon"] for q in g["params"] if q.numel()]
    out["muon_tensors"] = len(muon)
    out["momentum_norm"] = sum(float(inner.state[q]["momentum_buffer"].norm()) for q in muon)
    out["split"] = sum(len(owner[id(q)].shard_owners(q)) > 1 for c in tr.model_chunks
                       for q in c.parameters())
    if save:
        tr.iteration = STEPS
        tr.save(save)
    return out


def world8(save: str) -> dict:
    ref = reference(make_cfg(8))
    return {"muon": parity_case(ref),
            "dist_muon": parity_case(ref, save, optimizer="dist_muon", og=True, opg=True)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("muon") / "ckpt")
    return run_distributed(8, world8, path, timeout=900, start_method="fork"), path


@pytest.mark.parametrize("case, kind", [("muon", "Muon"), ("dist_muon", "DistributedOptimizer")])
def test_muon_parity_at_tp2_pp2_dp2(results, case, kind):
    for r in results[0]:
        c = r[case]
        assert c["optimizer"] == (kind, "Muon") and c["muon_tensors"] > 0, c
        assert c["momentum_norm"] > 0, c
        assert c["compared"] > 0 and c["loss"] < PARITY_RTOL and c["grad"] < PARITY_RTOL, c
        assert c["norm"] < PARITY_RTOL and c["param"] < PARITY_RTOL, c
    assert any(r["dist_muon"]["split"] for r in results[0])  # a matrix over two DP shards


def test_muon_states_saved_sharded_load_on_one_rank(results):
    """Muon's momentum and AdamW's states by name: the ZeRO-1 TP2 x PP2 x DP2 save, loaded by one
    plain process, equal the single-process run's after the same 3 steps."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.optimizer import optimizer_state_by_name
    from loom.training.trainer import Trainer
    _, path = results
    cfg = single(make_cfg(8))
    ref = reference(make_cfg(8))
    cfg.checkpoint.load = path
    tr = Trainer(cfg.validate(1), mesh=ParallelMesh.single())
    assert tr.iteration == STEPS
    params = dict(tr.model_chunks[0].named_parameters())
    loaded = optimizer_state_by_name(tr.optimizer, params)
    assert set(loaded) == set(ref["states"])
    kinds = set()
    for name, st in loaded.items():
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            if key in ref["states"][name]:
                kinds.add(key)
                assert rel_err(st[key], ref["states"][name][key]) < PARITY_RTOL, (name, key)
        assert rel_err(params[name].detach(), ref["params"][name]) < PARITY_RTOL, name
    assert kinds == {"momentum_buffer", "exp_avg", "exp_avg_sq"}


def test_the_harness_fails_another_optimizer():
    """A harness that can fail: Adam instead of Muon, or Muon without the QKV split, moves the
    parameters far outside the tolerance."""
    a = reference(make_cfg(8), steps=1)
    for change in (dict(optimizer="adam"), dict(muon_split_qkv=False)):
        cfg = make_cfg(8)
        for k, v in change.items():
            setattr(cfg.training, k, v)
        b = reference(cfg, steps=1)
        assert max(rel_err(b["params"][n], a["params"][n]) for n in a["params"]) > 100 * PARITY_RTOL


def test_muon_resumes_from_megatrons_torch_dist_format(tmp_path):
    """``--ckpt-format torch_dist`` (the corpus' Muon cases save it): Muon's momentum, with
    AdamW's states, is written as Megatron's model-space ``optimizer.state.momentum_buffer.*``
    and restored by a resume, equal to the saved run's."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.optimizer import optimizer_state_by_name
    from loom.training.trainer import Trainer
    cfg = single(make_cfg(1, tp=1, pp=1))
    cfg.training.ckpt_format = "torch_dist"
    tr = Trainer(cfg.validate(1), mesh=ParallelMesh.single())
    for _ in range(2):
        tr.train_step()
    tr.save(str(tmp_path))
    params = dict(tr.model_chunks[0].named_parameters())
    saved = optimizer_state_by_name(tr.optimizer, params)
    cfg.checkpoint.load = str(tmp_path)
    back = Trainer(cfg.validate(1), mesh=ParallelMesh.single())
    loaded = optimizer_state_by_name(back.optimizer, dict(back.model_chunks[0].named_parameters()))
    assert back.iteration == 2 and set(loaded) == set(saved)
    kinds = {k for st in loaded.values() for k in st}
    assert {"momentum_buffer", "exp_avg", "exp_avg_sq"} <= kinds
    for name, st in saved.items():
        for key, value in st.items():
            if torch.is_tensor(value) and value.ndim:
                assert torch.equal(loaded[name][key], value), (name, key)
