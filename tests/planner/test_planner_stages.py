"""Uneven pipeline stages, the nothing-fits / no-layout-divides messages and the CLI refusals of
issue 16. Hand-computed values; every search here runs in well under a second."""

from __future__ import annotations

import numpy as np
import pytest

from loom.config import LoomConfig
from loom.planner.diagnose import explain_no_layout, explain_nothing_fits
from loom.planner.hardware import make_cluster
from loom.planner.layout import Options, make_layouts
from loom.planner.stage_table import stage_layers
from loom.planner.memory import layer_params, memory_terms, stage_params
from loom.planner.presets import get_preset, gpt
from loom.planner.search import enumerate_layouts, evaluate, record, search
from loom.planner.stages import accounted_split, describe_split, given_split, uneven_splits
from loom.planner.timing import layer_times, time_terms


def test_uneven_split_candidates():
    # Llama 3 405B: 126 layers on 16 stages -> middle 8, first + last 14
    assert uneven_splits(126, 16) == [(6, 8), (7, 7), (8, 6)]
    assert uneven_splits(96, 8) == [(0, 0)]  # divisible: the even split only
    assert uneven_splits(5, 2) == [(2, 3), (3, 2)]
    assert uneven_splits(100, 16) == [(1, 1)]  # middle 7 x 14 = 98, 2 left
    assert uneven_splits(8, 16) == []  # more stages than layers
    for L, p in [(126, 16), (126, 32), (61, 4), (100, 16), (37, 5)]:
        for lf, ll in uneven_splits(L, p):
            mid = (L - lf - ll) / (p - 2)
            assert mid == int(mid) and min(lf, ll, mid) >= 1
            assert max(lf, ll) <= mid + 1


def test_given_and_accounted_splits():
    assert accounted_split(126, 16, True, True) == (7, 7)  # (126 + 2) / 16 = 8
    assert accounted_split(127, 16, True, False) == (7, 8)
    assert accounted_split(126, 16, True, False) is None  # 127 not divisible by 16
    assert given_split(126, 16, 7, 7) == (7, 7)
    assert given_split(126, 16, 6, None) == (6, 8)  # 120 over 15 stages = 8
    assert given_split(126, 16, 7, None) is None  # 119 over 15 does not divide
    assert given_split(96, 8, 12, None) == (0, 0)  # that is the even split
    assert describe_split(126, 16, 7, 7) == "7+14x8+7"
    assert describe_split(96, 8, 0, 0) == "8x12"


def test_stage_layers_and_params_by_hand():
    m = get_preset("llama3-405b")
    L = make_layouts([dict(tp=8, pp=16, lf=7, ll=7), dict(tp=8, pp=16, lf=0, ll=0),
                      dict(tp=8, pp=2, lf=60, ll=66)])
    lf, lm, ll = stage_layers(126, L)
    # lf = ll = 0 with p not dividing L: the balanced split 7 + 14 x 8 + 7 (stage_table)
    assert lf.tolist() == [7, 7, 60] and ll.tolist() == [7, 7, 66]
    assert lm[0] == 8 and lm[1] == 8
    sh, rep = layer_params(m)
    P = stage_params(m, L, 8192)
    per_layer = sh / 8 + rep
    Vp = 129024  # 128256 padded to a multiple of 128 x t = 1024: 126 x 1024
    assert P["first"][0] == pytest.approx(7 * per_layer + Vp * 16384 / 8)
    assert P["middle"][0] == pytest.approx(8 * per_layer)
    assert P["last"][0] == pytest.approx(7 * per_layer + 16384 + Vp * 16384 / 8)


def test_uneven_stage_time_is_the_slowest_stage():
    """7 + 14 x 8 + 7: one micro-batch takes max(first, middle, last) stage time, each the sum of
    its layers (+ embedding all-reduce on the first, output layer on the last)."""
    m = get_preset("llama3-405b")
    cl = make_cluster("H100-80GB", 8192)
    L = make_layouts(dict(tp=8, pp=16, dp=64, mbs=1, lf=7, ll=7, sp=1, recompute="none"))
    tt = time_terms(m, L, 2048, 8192, cl, Options(flash_attention=True))
    lt = layer_times(m, 8192, L, cl, Options(flash_attention=True))
    layer = 3 * (lt["gemm"] + lt["attn"]) + 3 * lt["elem"] + lt["tp_fwd"] + lt["tp_bwd"]
    mid = 8 * layer
    assert tt["microbatch_time"][0] >= mid[0] * (1 - 1e-12)
    # the last stage's 7 layers + output layer are cheaper than 8 layers, so the middle decides
    assert tt["microbatch_time"][0] == pytest.approx(mid[0])
    m32 = 32 * 1  # micro-batches: B / (b d) = 2048 / 64
    assert tt["compute"][0] == pytest.approx(m32 * 8 * 3 * (lt["gemm"][0] + lt["attn"][0]))
    assert tt["pp_bubble"][0] == pytest.approx(15 * mid[0])


def test_middle_stage_memory_can_dominate():
    """A first stage with 1 layer: the second stage (p - 1 micro-batches in flight, 1F1B) needs
    the most activation memory; memory_terms reports it as stage 2."""
    m = gpt(40, 2048, 16)
    L = make_layouts([dict(tp=1, pp=4, dp=1, mbs=1, lf=1, ll=1)])
    mem = memory_terms(m, L, 64, 2048, Options())
    assert int(mem["stage"][0]) == 2
    assert float(mem["params_per_gpu"][0]) == pytest.approx(19 * sum(layer_params(m)))


def test_405b_on_16_stages_plans_with_7_14x8_7_or_better():
    m = get_preset("llama3-405b")
    cl = make_cluster("H100-80GB", 8192)
    res = search(m, cl, 2048, 8192, fixed=dict(tp=8, pp=16), opts=Options(flash_attention=True))
    assert len(res["order"]) > 0
    best = record(res, int(res["order"][0]))
    counts = [int(c) for c in best["pipeline_split"].replace("14x8", "+".join(["8"] * 14))
              .split("+")]
    assert sum(counts) == 126 and len(counts) == 16 and max(counts) <= 8
    # the split given explicitly (accounting semantics) is accepted and gives 7+14x8+7
    res2 = search(m, cl, 2048, 8192, fixed=dict(tp=8, pp=16, account_embedding=True,
                                                account_loss=True),
                  opts=Options(flash_attention=True))
    r2 = record(res2, int(res2["order"][0]))
    assert r2["pipeline_split"] == "7+14x8+7"
    assert r2["iteration_time_s"] >= best["iteration_time_s"] * (1 - 1e-12)


def test_uneven_layouts_pass_loom_validation():
    m = get_preset("llama3-405b")
    cl = make_cluster("H100-80GB", 8192)
    L = enumerate_layouts(m, cl, 2048, 8192, fixed=dict(tp=8, pp=16, mbs=1))
    rows = np.nonzero((L["lf"] > 0) & (L["vp"] == 1))[0]  # with v > 1: the layout string
    assert len(rows) > 0 and np.any((L["lf"] > 0) & (L["vp"] > 1))
    for i in rows[:: max(1, len(rows) // 10)]:
        cfg = LoomConfig.from_flat(dict(
            num_layers=126, hidden_size=16384, num_attention_heads=128, num_query_groups=8,
            group_query_attention=True, ffn_hidden_size=53248, swiglu=True, vocab_size=128256,
            seq_length=8192, tensor_model_parallel_size=8, pipeline_model_parallel_size=16,
            context_parallel_size=int(L["cp"][i]), micro_batch_size=1, global_batch_size=2048,
            decoder_first_pipeline_num_layers=int(L["lf"][i]),
            decoder_last_pipeline_num_layers=int(L["ll"][i]), lr=3e-4, train_iters=1))
        cfg = cfg.validate(8192)
        assert cfg.data_parallel_size(8192) == int(L["dp"][i])


def test_nothing_fits_names_term_overflow_and_change():
    m = get_preset("gpt3-175b")
    cl = make_cluster("A100-80GB", 64)
    fixed = dict(recompute="none")
    res = search(m, cl, 64, 2048, fixed=fixed, opts=Options(max_zero_stage=1))
    assert len(res["tp"]) > 0 and len(res["order"]) == 0
    msg = explain_nothing_fits(m, cl, 64, 2048, fixed, Options(max_zero_stage=1), res)
    i = int(res["mem_total"].argmin())
    over = res["mem_total"][i] / 1e9 - 80
    assert f"{over:.1f} GB too much" in msg
    assert "largest term is" in msg and "cheapest change:" in msg
    assert "--recompute-granularity full" in msg  # no new GPUs needed: recompute first


def test_nothing_fits_with_a_given_layout_releases_it_with_the_pp_size():
    """A given --pipeline-model-parallel-layout is p x v stages: when the cheapest change is to
    release the fixed PP size, its layout goes with it (it used to fail on the layout)."""
    m = get_preset("gpt3-175b")
    cl = make_cluster("A100-80GB", 64)
    fixed = dict(pp=2, zero=1, recompute="full", layout="Et*47|t*49L")
    res = search(m, cl, 64, 2048, fixed=fixed, opts=Options(max_zero_stage=1))
    assert len(res["tp"]) > 0 and len(res["order"]) == 0
    msg = explain_nothing_fits(m, cl, 64, 2048, fixed, Options(max_zero_stage=1), res)
    assert "drop --pipeline-model-parallel-size 2" in msg, msg


def test_no_layout_divides_is_a_different_message():
    m = gpt(24, 2304, 24)
    cl = make_cluster("A100-80GB", 32)
    fixed = dict(tp=5)
    assert len(enumerate_layouts(m, cl, 512, 2048, fixed)["tp"]) == 0
    msg = explain_no_layout(m, cl, 512, 2048, fixed, Options())
    assert msg.startswith("no layout divides") and "--tensor-model-parallel-size 5" in msg
    msg = explain_no_layout(m, cl, 7, 2048, {}, Options())  # B = 7 on 32 GPUs: only d = 1
    assert "no layout divides" in msg
    res = evaluate(m, enumerate_layouts(m, cl, 512, 2048), 512, 2048, cl)
    assert res["fits"].any()


# -- CLI (issue 16) -----------------------------------------------------------------------------

def _plan(argv, capsys):
    from loom.cli import main
    with pytest.raises(SystemExit) as e:
        main(["plan"] + argv)
    return e.value.code, capsys.readouterr()


def test_cli_refuses_zero_gpus(capsys):
    code, out = _plan(["gpt3-175b", "--num-gpus", "0"], capsys)
    assert code == 2 and "--num-gpus 0" in out.err and "Traceback" not in out.err
    assert out.err.count("\n") == 1


def test_cli_refuses_heads_not_dividing_hidden(capsys):
    code, out = _plan(["--num-layers", "4", "--hidden-size", "1000", "--num-attention-heads", "3",
                       "--vocab-size", "1000", "--num-gpus", "8"], capsys)
    assert code == 2 and "--num-attention-heads 3" in out.err and "--hidden-size 1000" in out.err
    assert out.err.count("\n") == 1 and out.out == ""


def test_cli_no_abbreviations(capsys):
    from loom.cli import main
    with pytest.raises(SystemExit) as e:
        main(["plan", "gpt3-175b", "--num-gpu", "64"])
    assert e.value.code == 2 and "--num-gpu" in capsys.readouterr().err


def test_cli_uneven_405b_and_breakdown(capsys, tmp_path):
    png = tmp_path / "b.png"
    code, out = _plan(["llama3-405b", "--gpu", "H100-80GB", "--num-gpus", "8192",
                       "--global-batch-size", "2048", "--tensor-model-parallel-size", "8",
                       "--pipeline-model-parallel-size", "16",
                       "--decoder-first-pipeline-num-layers", "7",
                       "--decoder-last-pipeline-num-layers", "7", "--top", "3",
                       "--plot-breakdown", str(png)], capsys)
    assert code == 0, out.err
    assert "split 7+14x8+7" in out.out and "breakdown of one iteration" in out.out
    assert png.stat().st_size > 1000


def test_predict_layout_reads_uneven_stages():
    from loom.planner.predict import predict_layout
    cfg = LoomConfig.from_flat(dict(
        num_layers=126, hidden_size=16384, num_attention_heads=128, num_query_groups=8,
        group_query_attention=True, ffn_hidden_size=53248, swiglu=True, vocab_size=128256,
        seq_length=8192, tensor_model_parallel_size=8, pipeline_model_parallel_size=16,
        decoder_first_pipeline_num_layers=6, micro_batch_size=1, global_batch_size=2048,
        sequence_parallel=True, recompute_granularity="full"))
    pred = predict_layout(cfg, 8192, "H100-80GB")
    assert pred["layout"]["lf"] == 6 and pred["layout"]["ll"] == 8  # 120 left = 15 x 8
    assert pred["time_s"]["iteration"] == pytest.approx(
        sum(v for k, v in pred["time_s"].items() if k != "iteration"))


def test_405b_at_128k_plans_with_context_parallelism():
    """Llama 3 405B, s = 131,072 on 16,384 H100 (B = 128, 16M tokens): without CP only layouts
    with few micro-batches fit (m <= 4, mostly bubble); the best layout uses c >= 16 and is more
    than 3x faster than the best c = 1 layout."""
    import dataclasses
    m = dataclasses.replace(get_preset("llama3-405b"), seq_length=131072,
                            max_position_embeddings=131072)
    res = search(m, make_cluster("H100-80GB", 16384), 128, 131072,
                 opts=Options(flash_attention=True))
    assert len(res["order"]) > 0
    best = record(res, int(res["order"][0]))
    no_cp = [i for i in res["order"] if res["cp"][i] == 1]
    assert res["time_iteration"][no_cp[0]] > 3 * best["iteration_time_s"]
    assert best["memory_gb"] <= 80 and best["cp"] >= 16
    assert best["pp"] == 1 or 126 % best["pp"] == 0 or best["first_stage_layers"] > 0
