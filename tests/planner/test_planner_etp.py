"""Expert tensor parallelism (``--expert-tensor-parallel-size`` u, layout key ``etp``) in the
planner: per-rank model states equal to loom's real model counted on the meta device, the
terms that move with u against hand-computed values (loom/planner/moe.py module docstring), the
search space (Megatron's expert grid, every u loom accepts), fixing u from ``loom plan`` and the
printed commands, and u = t leaving the MoE search as it was. Single process, ~5 s."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from loom.planner.command import command_config, train_command
from loom.planner.hardware import make_cluster
from loom.planner.layout import Options, make_layouts
from loom.planner.memory import memory_terms
from loom.planner.moe import expert_dp, moe_layer_times
from loom.planner.predict import layout_of
from loom.planner.presets import get_preset
from loom.planner.primitives import gemm_efficiency
from loom.planner.search import enumerate_layouts, record, search
from loom.planner.timing import time_terms
from testkit.config import tiny_config, tiny_model

H100 = make_cluster("H100-80GB", 64)


def _tiny_moe_cfg(etp: int, model_kw: dict | None = None, **kw):
    model = tiny_model("llama", num_layers=2, hidden_size=64, num_attention_heads=4,
                       num_query_groups=2, group_query_attention=True, ffn_hidden_size=128,
                       seq_length=32, vocab_size=1000, num_experts=4, moe_ffn_hidden_size=64,
                       moe_router_topk=2, **(model_kw or {}))
    return tiny_config(model=model, world=4, **{
        "tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
        "expert_tensor_parallel_size": etp, "micro_batch_size": 1, "global_batch_size": 8,
        "lr": 3e-4, "train_iters": 10, "bf16": True, **kw})


@pytest.mark.parametrize("etp", [1, 2])
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_model_states_per_rank_equal_the_meta_device_count(etp, zero):
    """TP 2 x EP 2 on 4 ranks (d 2), expert TP 1 and 2, ZeRO 0, 1 (distributed optimizer) and 3
    (FSDP2): the planner's weight, gradient and optimizer bytes per rank equal loom's real model
    built on the meta device under a fake process group (loom/planner/meta_count.py), on every
    rank; the expert-DP size too (4 / (u e)). At u = 1 each rank holds E/e = 2 whole experts:
    twice the expert parameters of u = 2."""
    from loom.planner.meta_count import count_rank_states
    cfg = _tiny_moe_cfg(etp, zero_stage=zero)
    L = make_layouts(layout_of(cfg, 4))
    assert float(L["etp"][0]) == etp and float(L["ep"][0]) == 2
    mt = memory_terms(cfg.model, L, 8, 32, Options(flash_attention=True))
    for rank in range(4):
        got = count_rank_states(cfg, 4, rank)
        assert got["edp"] == float(expert_dp(L)[0]) == 4 // (etp * 2) and got["zero"] == zero
        if zero < 3:  # FSDP2 counts its shards: dense over d c, experts over the expert DP
            assert got["params"] == float(mt["params_per_gpu"][0])
        for term in ("weights", "gradients", "optimizer"):
            assert got[f"{term}_bytes"] == float(mt[term][0]), (etp, zero, rank, term)
    if zero < 3:  # layers x E/e x SwiGLU 3 h f_e / u
        assert got["expert_params"] == 2 * 2 * 3 * 64 * 64 // etp


@pytest.mark.parametrize("etp", [1, 2])
def test_latent_moe_states_per_rank_equal_the_meta_device_count(etp):
    """--moe-latent-size 16 (h 64) with a shared expert and linear biases, TP 2 x EP 2, ZeRO
    1: the planner's parameters and bytes per rank equal loom's real model on the meta device
    (the replicated projections h L + L h + L + h per layer, the experts on L-wide rows);
    the total against the plain MoE by hand, and the MoE MLP's FLOPs per token by hand."""
    from loom.planner.memory import total_params
    from loom.planner.meta_count import count_rank_states
    from loom.planner.moe import moe_mlp_flops_per_token
    latent = dict(moe_latent_size=16, moe_shared_expert_intermediate_size=32,
                  disable_bias_linear=False)
    cfg = _tiny_moe_cfg(etp, latent, use_distributed_optimizer=True)
    L = make_layouts(layout_of(cfg, 4))
    mt = memory_terms(cfg.model, L, 8, 32, Options(flash_attention=True))
    for rank in range(4):
        got = count_rank_states(cfg, 4, rank)
        assert got["params"] == float(mt["params_per_gpu"][0]), (etp, rank)
        for term in ("weights", "gradients", "optimizer"):
            assert got[f"{term}_bytes"] == float(mt[term][0]), (etp, rank, term)
    assert got["expert_params"] == 2 * 2 * (3 * 16 * 64 // etp + 2 * 64 // etp + 16)
    plain = _tiny_moe_cfg(etp, dict(latent, moe_latent_size=None)).model
    h, lat, f, E = 64, 16, 64, 4  # per layer: projections, experts' rows L instead of h
    per_layer = 2 * h * lat + lat + h + E * (3 * f * (lat - h) + (lat - h))
    assert total_params(cfg.model) - total_params(plain) == 2 * per_layer
    assert moe_mlp_flops_per_token(cfg.model) == 2 * 6 * lat * f + 6 * h * 32 + 2 * h * E \
        + 4 * h * lat


def test_expert_tp_terms_by_hand():
    """Mixtral 8x7B, t 8, d 8, e 8, b 1, s 4096, alltoall; u 1 against u 8 (moe.py docstring):
    expert weights per GPU x8; the expert GEMM FLOPs per rank equal, on 1/8 of the rows at 8x
    the width; the all-to-all moves the rank's own pairs, 1/8 of the bytes, its EP ranks now
    1 apart (8 in the node, NVLink only); the expert-DP group t d / (u e) = 8 instead of 1;
    no change to the TP all-reduce."""
    m = dataclasses.replace(get_preset("mixtral-8x7b"), moe_token_dispatcher_type="alltoall")
    cl = make_cluster("H100-80GB", 512)
    lay = make_layouts([dict(tp=8, dp=8, ep=8, mbs=1, etp=u) for u in (8, 1)] + [dict(
        tp=8, dp=8, ep=8, mbs=1)])
    mt = memory_terms(m, lay, 64, 4096, Options(flash_attention=True))
    experts = 32 * 8 * 3 * 4096 * 14336
    dense = float(mt["params_per_gpu"][0]) - experts / 64
    assert float(mt["params_per_gpu"][1]) == pytest.approx(dense + experts / 8)
    assert float(mt["params_per_gpu"][2]) == float(mt["params_per_gpu"][0])  # etp absent = t
    assert list(expert_dp(lay)) == [1.0, 8.0, 1.0]
    S, k, h = 4096, 2, 4096
    mo = moe_layer_times(m, S, lay, cl, 1.1)
    assert float(mo["tokens_per_expert"][1]) == pytest.approx(S * k * 8 / 8 / 8)  # S k e u/(t E)
    assert float(mo["tokens_per_expert"][0]) == pytest.approx(S * k * 8 / 8)
    assert float(mo["tp_extra"][0]) == float(mo["tp_extra"][1])
    nbytes = 2 * S * k * h / 8  # u / t of the pairs, bf16; 8 EP ranks in the node
    want = 7 / 8 * nbytes / cl.intra_bw + 7 * cl.intra_alpha
    assert float(mo["a2a"][1]) == pytest.approx(want, rel=1e-12)
    assert float(mo["a2a"][0]) > 8 * float(mo["a2a"][1])  # u = 8: 8x the bytes, across nodes
    # compute: the same FLOPs lambda S k 6 h f_e / t per rank, at the efficiency of u/t of the
    # rows per expert and t/u times the width (h 4096 < f_e: width min(h, f_e) / u)
    pk = cl.peak_flops
    router = 2 * h * 8 * S / (pk * gemm_efficiency(min(h, 8), S, cl))
    for i, u in ((0, 8), (1, 1)):
        rows = S * k * 8 * u / 8 / 8  # S k e u / (t E), one GEMM per expert
        want = 1.1 * S * k * 6 * h * 14336 / 8 / (pk * gemm_efficiency(4096 / u, rows, cl))
        assert float(mo["gemm"][i]) == pytest.approx(want + router, rel=1e-12)
    tt = time_terms(m, lay, 64, 4096, cl, Options(flash_attention=True))
    assert float(tt["ep_comm"][1]) < float(tt["ep_comm"][0])
    assert float(tt["tp_comm"][1]) == float(tt["tp_comm"][0])


def test_search_covers_every_expert_tp_loom_accepts():
    """Mixtral on 64 H100: every u dividing t appears at t = 8 (1, 2, 4, 8), every row is on
    Megatron's expert grid (u | t, u e | t c d, e | E), EP larger than c d exists only with
    u < t (EP across the TP ranks), and a dense model has no expert grid (etp 0, recorded as
    t)."""
    m = get_preset("mixtral-8x7b")
    lay = enumerate_layouts(m, H100, 1024, 4096)
    t, d, u, e, c = lay["tp"], lay["dp"], lay["etp"], lay["ep"], lay["cp"]
    assert set(u[t == 8]) == {1, 2, 4, 8} and set(u[t == 2]) == {1, 2}
    assert np.all(t % u == 0) and np.all((t * c * d) % (u * e) == 0) and np.all(8 % e == 0)
    assert np.any(e > c * d) and np.all(u[e > c * d] < t[e > c * d])
    assert np.any((t == 8) & (d == 1) & (u == 1) & (e == 8))  # EP 8 inside one TP 8 group
    dense = enumerate_layouts(get_preset("llama3-8b"), make_cluster("H100-80GB", 8), 64, 4096,
                              variants=False)
    assert np.all(dense["etp"] == 0)
    res = search(get_preset("llama3-8b"), make_cluster("H100-80GB", 8), 64, 4096,
                 fixed=dict(tp=2, pp=1, recompute="full"), opts=Options(flash_attention=True))
    assert record(res, int(res["order"][0]))["etp"] == 2


def test_expert_tp_equal_to_tp_leaves_the_moe_search_as_it_was(monkeypatch):
    """With the search held to u = t (the planner before expert TP) the mixtral-8x7b search of
    test_planner_mamba.py::test_moe_search_unchanged gives its sums of before expert TP, bit for
    bit (a change to the time or memory model moves both tests: re-record them together, this
    one from the same search with ``_moe_rules`` held to u = t as below).
    Re-recorded when the interleaved schedule's warm-up at m = p became Megatron-Core's
    (Options.legacy_interleaved_warmup=True, the old rule, gives the previous sums again).
    Re-recorded when the search added ZeRO 1-3 with EP > 1 (loom train and Megatron-Core run
    the distributed optimizer with expert parallelism; the old search kept EP > 1 at ZeRO 0).
    Re-recorded when MoE models were searched with SP and CP (held to c = 1 and SP off: 6553
    layouts, 2756 fitting, 96461.3935082132 s, 969537630203732.5 B again). Held to the
    allgather dispatcher (``disp``), the one searched before the dispatcher was. Memory
    re-recorded with the mamba test when the output stage held the larger of the loss's
    forward peak and a recomputed layer's working memory (was 14784 fitting,
    3544352904919768.5 B)."""
    import loom.planner.search as S
    rules = S._moe_rules
    monkeypatch.setattr(S, "_moe_rules", lambda model, t, c, d: None if rules(model, t, c, d)
                        is None else [(u, e) for u, e in rules(model, t, c, d) if u == t])
    res = S.search(get_preset("mixtral-8x7b"), H100, 512, 4096, dict(zb=0, disp="allgather"),
                   Options(flash_attention=True, max_zero_stage=3))
    assert len(res["tp"]) == 29208 and len(res["order"]) == 14800
    assert float(res["time_iteration"].sum()) == pytest.approx(653776.5978292045, rel=1e-12)
    assert float(res["mem_total"].sum()) == pytest.approx(3541529178157536.0, rel=1e-12)


def test_every_moe_row_prints_a_command_loom_accepts():
    """A small MoE model on 16 A100: the fastest fitting row of every (t, u, e, ZeRO, PP > 1)
    the search ranks with CP 1 (132 of them: u < t with ZeRO 0-3 and with EP up to 8 across
    the TP ranks among them, EP > 1 with the distributed optimizer and FSDP2 too; 133 while
    MoE rows at t > 1 ran without SP), and of every (t, c, e) with CP > 1 (EP over CP ranks
    among them), prints a command loom train's config accepts, carrying
    --expert-tensor-parallel-size exactly when u != t, --sequence-parallel exactly at t > 1
    (Megatron-Core refuses MoE with TP > 1 without SP) and the row's --context-parallel-size;
    the config's expert grid, SP and CP are the row's."""
    m = dataclasses.replace(get_preset("mixtral-8x7b"), num_layers=8, hidden_size=1024,
                            num_attention_heads=16, num_query_groups=4, ffn_hidden_size=2048,
                            moe_ffn_hidden_size=2048, seq_length=2048,
                            max_position_embeddings=2048)
    cl = make_cluster("A100-80GB", 16)
    res = search(m, cl, 64, 2048, opts=Options(flash_attention=True))
    picks, cp_picks = {}, {}
    for i in res["order"]:
        if res["cp"][i] > 1:
            cp_picks.setdefault(tuple(int(res[k][i]) for k in ("tp", "cp", "ep")), int(i))
            continue
        key = tuple(int(res[k][i]) for k in ("tp", "etp", "ep", "zero")) + (res["pp"][i] > 1,)
        picks.setdefault(key, int(i))
    assert len(picks) == 132 and {(4, 1, 8, 0), (2, 1, 1, 3), (2, 2, 2, 1), (1, 1, 8, 3)} <= \
        {k[:4] for k in picks}
    assert len(cp_picks) > 20 and {(1, 2, 8), (2, 4, 8), (4, 4, 1)} <= set(cp_picks)
    for i in list(picks.values()) + list(cp_picks.values()):
        rec = record(res, i)
        text = train_command(rec, m, 64, 2048, 16, 8)
        assert ("--expert-tensor-parallel-size" in text) == (rec["etp"] != rec["tp"])
        assert ("--sequence-parallel" in text) == rec["sequence_parallel"] == (rec["tp"] > 1)
        assert f"--context-parallel-size {rec['cp']} " in text
        cfg = command_config(text, 16)
        p = cfg.parallel
        assert (p.expert_tensor_parallel_size or p.tensor_model_parallel_size) == rec["etp"]
        assert p.expert_model_parallel_size == rec["ep"] and cfg.data_parallel_size(16) == rec["dp"]
        assert p.sequence_parallel == rec["sequence_parallel"]
        assert p.context_parallel_size == rec["cp"]


def test_cli_fixes_expert_tp(capsys):
    """``loom plan --expert-tensor-parallel-size 1`` holds u = 1 on every row, says so in the
    table and the command; a dense model ignores it (loom train does); a u not dividing the
    given t is refused (exit 2, naming both flags)."""
    from loom.cli import main
    args = ["mixtral-8x7b", "--gpu", "H100-80GB", "--num-gpus", "64",
            "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    with pytest.raises(SystemExit) as e:
        main(["plan", *args, "--json", "--top", "5"])
    doc = json.loads(capsys.readouterr().out)
    assert e.value.code == 0 and {r["etp"] for r in doc["layouts"]} == {1}
    with pytest.raises(SystemExit) as e:
        main(["plan", *args, "--top", "3"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "  etp 1" in out and "--expert-tensor-parallel-size 1" in out
    with pytest.raises(SystemExit) as e:
        main(["plan", "llama3-8b", "--gpu", "H100-80GB", "--num-gpus", "8",
              "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
              "--json", "--top", "1"])
    doc = json.loads(capsys.readouterr().out)
    assert e.value.code == 0 and doc["layouts"][0]["etp"] == 2
    with pytest.raises(SystemExit) as e:
        main(["plan", *args[:-1], "4"])
    assert e.value.code == 2 and "must divide --tensor-model-parallel-size 2" in \
        capsys.readouterr().err
