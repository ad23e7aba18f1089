"""MoE models under sequence and context parallelism in the planner: loom's MoE layer's saved
bytes equal its formula on loom's real modules (TP with and without SP, expert TP below t, CP,
a shared expert, a latent MoE with the probabilities on the expert input); the planner's MoE rules equal loom train's validation on a grid; the search
plans MoE with SP (Megatron-Core's rule at t > 1) and CP, its commands carry the flags; the
terms that move with SP and CP against hand-computed values; EP 2 and 4 measured on 4 real
gloo ranks. ~4 s single-process, ~4 s for the spawned world."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import pathlib

import numpy as np
import pytest
import torch

from benchmarks.layer_memory import (layer_saved_bytes, measure_in_worlds, moe_ep_layer_saved,
                                     resolve)
from loom.config import ConfigError, LoomConfig, ModelConfig
from loom.planner.activations import activation_bytes_per_layer
from loom.planner.hardware import make_cluster
from loom.planner.layer_bytes import (loom_layer_bytes, loom_layer_terms, loom_moe_mlp_terms)
from loom.planner.layout import Options, make_layouts
from loom.planner.moe import moe_layer_times
from loom.planner.presets import get_preset
from loom.planner.primitives import all_gather_time, all_reduce_time
from loom.planner.search import _moe_rules, enumerate_layouts, sp_options
from testkit import run_distributed
from testkit.config import tiny_model

SHAPES = {"moe-a": (dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                         num_experts=4), 32, 2),
          "moe-b": (dict(hidden_size=96, num_attention_heads=6, ffn_hidden_size=64,
                         num_experts=8, moe_router_topk=3), 24, 1),
          "moe-sh": (dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                          num_experts=4, moe_shared_expert_intermediate_size=64), 32, 2),
          # latent MoE, top-1 with the probabilities on the expert input, a shared expert
          "moe-lp": (dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                          num_experts=4, moe_router_topk=1, moe_latent_size=32,
                          moe_apply_probs_on_input=True,
                          moe_shared_expert_intermediate_size=64), 32, 2)}
# (shape, t, sp, c, expert TP u (None: t), recompute)
CASES = [(n, 1, False, 1, None, None) for n in SHAPES]
CASES += [(n, 2, sp, 1, u, None) for n in SHAPES for sp in (False, True) for u in (None, 1)]
CASES += [(n, 1, False, 2, None, None) for n in SHAPES]
CASES += [(n, 2, True, 2, None, None) for n in ("moe-a", "moe-sh")]
CASES += [("moe-a", 2, True, 1, None, rc) for rc in ("selective", "full")]


def _model(name: str, kind: str = "alltoall") -> tuple[ModelConfig, int, int]:
    kw, s, b = SHAPES[name]
    return resolve(tiny_model("mixtral", vocab_size=128, moe_token_dispatcher_type=kind, **kw),
                   s), s, b


def _predicted(case) -> tuple[float, dict]:
    name, t, sp, c, u, rc = case
    model, s, b = _model(name)
    att = loom_layer_terms(model, s, b, t=t, cp=c, sp=int(sp), elem_bytes=2, device="cpu")
    moe = {k: float(v) for k, v in loom_moe_mlp_terms(model, s, b, t=t, cp=c, etp=u).items()}
    mlp = float(att["mlp"] + att["fc1_input"])
    got = loom_layer_bytes(model, s, b, t=t, cp=c, sp=int(sp), elem_bytes=2, device="cpu")
    if rc == "full":
        return float(got["full"]), moe
    return float(got[rc or "none"]) - mlp + sum(moe.values()), moe


@pytest.fixture(scope="module")
def measured() -> dict:
    """Every case once, the t c > 1 ones in fake worlds of 2 and 4 ranks, torn down after."""
    torch.set_num_threads(1)

    def measure(case):
        name, t, sp, c, u, rc = case
        model, s, b = _model(name)
        return layer_saved_bytes(model, s, b, tp=t, sp=sp, cp=c, etp=u, recompute=rc,
                                 dtype=torch.bfloat16)
    return measure_in_worlds(CASES, lambda case: case[1] * case[3], measure)


def test_moe_layer_formula_equals_saved_bytes_under_tp_sp_cp(measured):
    """loom's MoE layer (bf16, EP 1) at TP 1 and 2, SP off and on, expert TP 2 and 1, CP 2, TP 2
    x CP 2 with SP, selective and full recompute: the attention side of
    :func:`loom_layer_bytes` plus :func:`loom_moe_mlp_terms`, byte for byte. SP moves only the
    attention side (the MoE layer all-gathers its tokens: every TP rank routes all of them);
    CP divides every MoE term by c; TP divides only the experts' and the shared expert's
    hidden activations; u < t shares the pairs."""
    for case in CASES:
        assert _predicted(case)[0] == measured[case], case
    # SP off / on at TP 2: the difference is the attention side's alone
    for name in SHAPES:
        model, s, b = _model(name)
        off, on = (measured[(name, 2, sp, 1, None, None)] for sp in (False, True))
        att = [sum(float(v) for k, v in loom_layer_terms(
            model, s, b, t=2, sp=sp, elem_bytes=2, device="cpu").items()
            if k not in ("mlp", "fc1_input")) for sp in (0, 1)]
        assert off - on == att[0] - att[1] > 0


def test_every_moe_term_is_needed(measured):
    """For each named MoE term, a case where it is non-zero and the formula without it is
    wrong."""
    needed = set()
    for case in CASES:
        if case[5] == "full":
            continue
        total, terms = _predicted(case)
        needed |= {k for k, v in terms.items() if v and total - v != measured[case]}
    assert needed == set(terms)


def test_planner_counts_loom_moe_layer_when_asked():
    """``Options(layer_memory="loom")``: an MoE layer's bytes are loom's (the attention side
    plus :func:`loom_moe_mlp_terms`, CUDA form) at TP, SP, CP, EP 1; the dense layers of the
    same model loom's dense layer; ``"kor"`` keeps Megatron-Core's count."""
    from loom.planner.memory import layer_activation_kinds
    model, s, b = _model("moe-sh")
    model = dataclasses.replace(model, moe_layer_freq=2)  # layers 0 MoE, 1 dense
    rows = [dict(tp=t, sp=sp, cp=c, mbs=b, recompute=rc) for t, sp in ((1, 0), (2, 0), (2, 1))
            for c in (1, 2) for rc in ("none", "selective")]
    L = make_layouts(rows)
    loom = Options(flash_attention=True, layer_memory="loom", moe_load_imbalance=1.3)
    got = layer_activation_kinds(model, s, L, loom)[0]
    for i, r in enumerate(rows):
        dense = loom_layer_bytes(model, s, b, t=r["tp"], cp=r["cp"], sp=r["sp"])[r["recompute"]]
        terms = loom_layer_terms(model, s, b, t=r["tp"], cp=r["cp"], sp=r["sp"])
        moe = dense - terms["mlp"] - terms["fc1_input"] + sum(
            loom_moe_mlp_terms(model, s, b, t=r["tp"], cp=r["cp"]).values())
        assert float(got[0][i]) == pytest.approx(float(dense), rel=1e-12), r
        assert float(got[1][i]) == pytest.approx(float(moe), rel=1e-12), r
    kor = layer_activation_kinds(model, s, L, Options(flash_attention=True))[0]
    want = activation_bytes_per_layer(model, s, L, flash_attention=True, moe_share=1.0)
    assert np.allclose(kor[1], np.where(L["recompute"] == 1, want["selective"], want["none"]))


def test_kor_moe_activations_under_sp_by_hand():
    """Megatron-Core's MoE layer under SP (the ``kor`` count): the router's logits and the
    combine's expert outputs divided by t with the layer's replicated activations (each TP rank
    routes its s/t tokens), the experts' inputs not (gathered over the expert-TP ranks), the
    expert hidden activations by t always; CP divides every token count by c."""
    m = get_preset("mixtral-8x7b")
    s, h, k, E, f, lam = 4096, 4096, 2, 8, 14336, 1.1
    L = make_layouts([dict(tp=4, sp=0), dict(tp=4, sp=1), dict(tp=4, sp=1, cp=2)])
    act = activation_bytes_per_layer(m, s, L, flash_attention=True, moe_share=1.0)
    for i, (sp, c) in enumerate(((0, 1), (1, 1), (1, 2))):
        S = s / c
        repl = S * h * 8 + 2 * S * k * h + 8 * S * E
        gathered = lam * S * k * 2 * h
        split = S * (2 * 4096 + 4 * 1024 + 2 * 4096) + lam * S * k * 6 * f
        want = (repl / 4 if sp else repl) + gathered + split / 4 + 4 * 32 * S / 4
        assert float(act["none"][i]) == pytest.approx(want, rel=1e-12)


def test_moe_layer_times_under_sp_and_cp_by_hand():
    """SP adds one ``[S, h]`` all-gather forward and one backward to the MoE layer's TP time (the
    layer gathers its tokens, keeps its slice of the output without a collective); the
    dispatcher's all-to-all does not change with SP (every TP rank dispatches its u/t of all
    pairs); CP adds the router statistics' two all-reduces over the c ranks."""
    m = get_preset("mixtral-8x7b")
    cl = make_cluster("H100-80GB", 64)
    S, h = 4096.0, 4096
    L = make_layouts([dict(tp=4, dp=16, ep=4, sp=sp, cp=c) for sp, c in ((0, 1), (1, 1), (1, 2))])
    mo = moe_layer_times(m, S, L, cl, 1.1)
    ag = float(all_gather_time(4, 2 * S * h, 360e9, 5e-6))
    assert float(mo["tp_extra"][1] - mo["tp_extra"][0]) == pytest.approx(ag, rel=1e-12)
    assert float(mo["tp_extra_bwd"][0]) == 0 and float(mo["tp_extra_bwd"][1]) == pytest.approx(ag)
    assert float(mo["a2a"][1]) == float(mo["a2a"][0])
    assert float(mo["cp_extra"][1]) == 0.0
    assert float(mo["cp_extra"][2]) == pytest.approx(
        float(all_reduce_time(2, 4 * 9, 360e9, 5e-6) + all_reduce_time(2, 4 * 8, 360e9, 5e-6)))


# -- the rules and the search ---------------------------------------------------------------------

def _loom_accepts(model_kw: dict, t, c, d, u, e, sp, s) -> bool:
    flat = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                vocab_size=128, seq_length=s, num_experts=4, moe_router_topk=2,
                tensor_model_parallel_size=t, context_parallel_size=c,
                expert_model_parallel_size=e, expert_tensor_parallel_size=u,
                sequence_parallel=bool(sp), micro_batch_size=1, global_batch_size=8 * d,
                lr=1e-4, train_iters=1, **model_kw)
    try:
        LoomConfig.from_flat(flat).validate(t * c * d)
    except ConfigError:
        return False
    return True


def test_planner_moe_rules_equal_loom_train_validation():
    """On a grid of (t, c, d, u, e, sp) and MoE variants (a shared expert of width 66, expert
    width 42, a capacity factor, biases, s = 36 not divisible by t c = 8), the planner's allow / refuse
    (:func:`_moe_rules`, :func:`sp_options` and the CP rule ``2c | s``) equals loom train's
    config validation, except the SP-off rows at t > 1, which loom train accepts and the
    planner refuses (Megatron-Core refuses MoE training with TP > 1 without SP; a loom run's
    own layout, ``given`` sp 0, is accepted)."""
    variants = [dict(), dict(moe_shared_expert_intermediate_size=66),
                dict(moe_ffn_hidden_size=42), dict(moe_expert_capacity_factor=1.0),
                dict(disable_bias_linear=False)]
    megatron_only = 0
    for kw, s in [(v, 48) for v in variants] + [(dict(), 36)]:
        model = resolve(ModelConfig.mixtral(num_layers=2, hidden_size=64, num_attention_heads=4,
                                            num_query_groups=4, vocab_size=128, num_experts=4,
                                            **kw), s)
        for t, c, d, u, e, sp in itertools.product((1, 2, 4), (1, 2), (1, 2), (1, 2, 4),
                                                   (1, 2, 4), (0, 1)):
            if u > t or (t == 1 and sp):  # SP at t = 1: nothing to split
                continue
            loom = _loom_accepts(kw, t, c, d, u, e, sp, s)
            eps = _moe_rules(model, t, c, d)
            cp_ok = c == 1 or s % (2 * c) == 0
            planner = cp_ok and eps is not None and (u, e) in eps
            if planner and not sp_options(model, t, c, s, given=sp).count(sp):
                planner = False
            assert planner == loom, (kw, s, t, c, d, u, e, sp)
            searched = planner and sp in sp_options(model, t, c, s)
            if planner and not searched:
                assert t > 1 and sp == 0  # Megatron's rule
                megatron_only += 1
    assert megatron_only > 0
    core = importlib.util.find_spec("megatron.core").submodule_search_locations[0]
    text = pathlib.Path(core, "transformer", "moe", "moe_layer.py").read_text()
    assert "self.attn_tp_group.size() > 1 and not self.config.sequence_parallel" in text


def test_moe_search_plans_sp_and_cp():
    """Mixtral 8x7B on 64 H100: every t > 1 row has SP on and no t = 1 row does, CP 2-64 rows
    exist, EP spans CP ranks (u e dividing t c d, e > d at u = t); with a capacity factor
    (tokens dropped per sequence shard) no CP."""
    m = get_preset("mixtral-8x7b")
    lay = enumerate_layouts(m, make_cluster("H100-80GB", 64), 1024, 4096, variants=False)
    t, c, sp = lay["tp"], lay["cp"], lay["sp"]
    assert np.all(sp[t > 1] == 1) and np.all(sp[t == 1] == 0) and (t > 1).any()
    assert set(c) == {1, 2, 4, 8, 16, 32, 64}
    assert np.all((t * c * lay["dp"]) % (lay["etp"] * lay["ep"]) == 0)
    assert ((lay["ep"] > lay["dp"]) & (lay["etp"] == t)).any()  # EP over DP x CP ranks
    capped = dataclasses.replace(m, moe_expert_capacity_factor=1.0)
    assert set(enumerate_layouts(capped, make_cluster("H100-80GB", 16), 64, 4096,
                                 variants=False)["cp"]) == {1}


def test_loom_train_runs_without_sp_are_still_predicted():
    """A loom train MoE run at TP 2 without SP (which loom accepts; Megatron-Core does not) and
    one with SP and CP 2: ``predict_layout`` evaluates each at its own layout."""
    from loom.planner.predict import predict_layout
    for sp, cp in ((False, 1), (True, 2)):
        cfg = LoomConfig.from_flat(dict(
            num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=1024,
            seq_length=256, num_experts=4, moe_router_topk=2, tensor_model_parallel_size=2,
            sequence_parallel=sp, context_parallel_size=cp, expert_model_parallel_size=2,
            micro_batch_size=2, global_batch_size=16, normalization="RMSNorm", swiglu=True))
        pred = predict_layout(cfg, 8, "H100-80GB")
        assert (pred["layout"]["sp"], pred["layout"]["cp"]) == (int(sp), cp)
        assert pred["time_s"]["ep_comm"] > 0


# (shape, dispatcher, e, t, expert TP u (None: t), sp) on 4 gloo ranks (d = 4 / t)
EP_CASES = [(n, kind, e, t, u, sp) for n in SHAPES for kind in ("alltoall", "allgather")
            for e, t, u, sp in ((4, 1, None, False), (2, 2, None, True))]
EP_CASES += [(n, kind, e, 2, 1, sp) for kind in ("alltoall", "allgather")
             for n, e, sp in (("moe-a", 4, True), ("moe-b", 2, False))]


def _ep_world(cases) -> dict:
    """Each EP case on this rank (:func:`benchmarks.layer_memory.moe_ep_layer_saved`), and
    whether the gloo reduce-scatter's output owns its storage (as NCCL's does)."""
    import torch.distributed as dist
    from loom.parallel.sequence import reduce_scatter_dim0
    torch.set_num_threads(1)
    out = reduce_scatter_dim0(torch.ones(8, 3), dist.group.WORLD)
    own = out.untyped_storage().nbytes() == out.numel() * out.element_size() and out.shape[0] == 2
    got = [moe_ep_layer_saved(*_model(n, kind), ep=e, tp=t, etp=u, sp=sp, dtype=torch.bfloat16)
           for n, kind, e, t, u, sp in cases]
    return {"own": own, "got": got}


def test_moe_layer_formula_equals_saved_bytes_at_ep():
    """EP > 1, measured on 4 real gloo ranks (the fake process group cannot: the exchanged
    counts and gathered routing are data): every rank's MoE layer saves exactly the attention
    side of :func:`loom_layer_bytes` plus :func:`loom_moe_mlp_terms` at ``imbalance`` = the
    rows its experts ran over the mean ``S k u / t``, for both dispatchers, EP 4 and 2, TP 2
    with SP and expert TP 1, a shared expert, top-3 of 8. Each rank draws its own tokens, so
    the loads differ and the formula at ``imbalance`` 1 is wrong on some rank. ~10 s."""
    ranks = run_distributed(4, _ep_world, EP_CASES, start_method="fork")
    assert all(r["own"] for r in ranks)  # without it gloo's all-gather dispatch keeps e x more
    off_balance = 0
    for i, (name, kind, e, t, u, sp) in enumerate(EP_CASES):
        model, s, b = _model(name, kind)
        att = loom_layer_terms(model, s, b, t=t, sp=int(sp), elem_bytes=2, device="cpu")
        dense = float(loom_layer_bytes(model, s, b, t=t, sp=int(sp), elem_bytes=2,
                                       device="cpu")["none"] - att["mlp"] - att["fc1_input"])
        for rank in ranks:
            got = rank["got"][i]
            lam = got["rows"] / (s * b * model.moe_router_topk * (u or t) / t)

            def predicted(imbalance):
                return dense + sum(float(v) for v in loom_moe_mlp_terms(
                    model, s, b, t=t, etp=u, ep=e, imbalance=imbalance).values())
            assert predicted(lam) == got["bytes"], (EP_CASES[i], lam)
            off_balance += predicted(1.0) != got["bytes"]
    assert off_balance >= len(EP_CASES)


def test_loom_moe_dispatch_terms_at_ep_by_hand():
    """EP > 1 (measured on real ranks in test_moe_layer_formula_equals_saved_bytes_at_ep): the
    busiest rank's received rows are lambda times the mean; all-to-all keeps the received and
    the returned rows, all-gather only the picked ones. EP 1 is the measured form."""
    model, s, b = _model("moe-a")
    S, k, h, e = s * b, 2, 64, 2
    lam = 1.1
    a2a = loom_moe_mlp_terms(dataclasses.replace(model, moe_token_dispatcher_type="alltoall"),
                             s, b, ep=4, imbalance=lam)
    one = loom_moe_mlp_terms(model, s, b, ep=1, imbalance=lam)
    assert float(a2a["dispatch"]) == pytest.approx((2 * lam + 1) * e * S * k * h + 16 * S * k
                                                   + 8 * lam * S * k)
    assert float(a2a["experts"]) == pytest.approx(lam * float(one["experts"]))
    assert float(one["dispatch"]) == 2 * e * S * k * h + 16 * S * k
    ag = loom_moe_mlp_terms(dataclasses.replace(model, moe_token_dispatcher_type="allgather"),
                            s, b, ep=4, imbalance=lam)
    assert float(ag["dispatch"]) == pytest.approx(2 * lam * e * S * k * h + 16 * lam * S * k)
