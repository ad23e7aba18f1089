"""Unit tests of the planner's formulas against hand-computed values, the search and the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from loom.config import ConfigError, LoomConfig
from loom.parallel.cross_entropy_cost import default_chunk_tokens
from loom.planner import flops as F
from loom.planner.hardware import GB, Cluster, make_cluster, peak_flops_per_s
from loom.planner.layout import Options, make_layouts
from loom.planner.memory import (activation_bytes_per_layer, inflight_microbatches, layer_params,
                                 memory_terms, model_state_bytes_per_param, padded_vocab,
                                 total_params)
from loom.planner.predict import format_prediction, predict_layout
from loom.planner.presets import get_preset, gpt
from loom.planner.search import enumerate_layouts, evaluate, record, search
from loom.planner.timing import (all_gather_time, all_reduce_time, gemm_efficiency,
                                 hierarchical_all_reduce_time, p2p_time, time_terms)


# -- hardware -------------------------------------------------------------------------------------

def test_peak_flops_by_torch_name():
    assert peak_flops_per_s("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_per_s("NVIDIA A100-SXM4-40GB") == 312e12
    assert peak_flops_per_s("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_per_s("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_per_s("NVIDIA H200") == 989e12
    assert peak_flops_per_s("NVIDIA B200") == 2250e12
    assert peak_flops_per_s("Tesla V100-SXM2-32GB") == 125e12
    assert peak_flops_per_s("cpu") is None
    assert peak_flops_per_s("Some Unknown Accelerator") is None
    assert peak_flops_per_s("") is None


def test_export_parts_are_their_own_entries():
    """H800 / A800 (torch names ``NVIDIA H800``, ``NVIDIA A800-SXM4-80GB``) keep their chip's
    FLOP/s but NVLink at 400 GB/s both ways, ~160 GB/s achieved, not the H100 / A100 entry's
    360 / 240; H20 its own compute (148 TFLOP/s) and 96 GB. H200 is not H20."""
    from loom.planner.hardware import lookup_gpu, sm_count
    h800, a800, h20 = (lookup_gpu(n) for n in ("NVIDIA H800", "NVIDIA A800-SXM4-80GB",
                                                "NVIDIA H20"))
    assert (h800.name, h800.peak_flops, h800.intra_bw) == ("H800", 989e12, 160e9)
    assert (a800.name, a800.peak_flops, a800.intra_bw) == ("A800-80GB", 312e12, 160e9)
    assert (h20.name, h20.peak_flops, h20.hbm_bytes) == ("H20", 148e12, 96 * GB)
    assert lookup_gpu("NVIDIA H200").name == "H200" and lookup_gpu("H100").name == "H100-80GB"
    assert (sm_count("H20"), sm_count("H200"), sm_count("H800")) == (78, 132, 132)
    # a TP 8 all-reduce inside one H800 node takes the longer time the narrower NVLink says
    M = 1e9
    t = {g: float(all_reduce_time(8, M, make_cluster(g, 8).intra_bw, 0.0))
         for g in ("H800", "H100-80GB")}
    assert t["H800"] == pytest.approx(t["H100-80GB"] * 360 / 160, rel=1e-3)


def test_cluster_roundtrip(tmp_path):
    c = make_cluster("H100-80GB", 64, inter_bw=40e9)
    assert c.num_nodes == 8 and c.inter_bw == 40e9 and c.hbm_bytes == 80 * GB
    c.save(tmp_path / "c.json")
    assert Cluster.load(str(tmp_path / "c.json")) == c
    with pytest.raises(ConfigError):
        make_cluster("TPU-v9")


# -- collectives (references.md alpha-beta ring formulas) ----------------------------------------

def test_collective_formulas():
    M, W, a = 1e9, 1e11, 1e-5
    assert all_reduce_time(8, M, W, a) == pytest.approx(2 * 7 / 8 * 0.01 + 14e-5)
    assert all_gather_time(8, M, W, a) == pytest.approx(7 / 8 * 0.01 + 7e-5)
    assert p2p_time(M, W, a) == pytest.approx(0.01 + 1e-5)
    assert all_reduce_time(1, M, W, a) == 0.0
    cl = make_cluster("A100-80GB", 64)
    # one member per node: ring bandwidth across nodes on the NICs, latency of NCCL's tree
    # (2 log2 8 = 6 hops instead of the ring's 14)
    assert hierarchical_all_reduce_time(8, 1, M, cl) == pytest.approx(
        all_reduce_time(8, M, cl.inter_bw, 0.0) + 6 * cl.inter_alpha)
    # all in one node: NVLink only
    assert hierarchical_all_reduce_time(8, 8, M, cl) == pytest.approx(
        all_reduce_time(8, M, cl.intra_bw, cl.intra_alpha))


def test_gemm_efficiency_monotone():
    e = gemm_efficiency(np.array([128, 768, 3072, 1e9]), 1e12)
    assert np.all(np.diff(e) > 0) and e[-1] < 1.0


# -- parameters and FLOPs --------------------------------------------------------------------------

def test_params_match_nar_eq2():
    for (L, h, a) in [(96, 12288, 96), (24, 2304, 24), (128, 25600, 160)]:
        m = gpt(L, h, a)
        s, V = 2048, 51200
        nar = 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))
        assert layer_params(m)[0] + layer_params(m)[1] == 12 * h * h + 13 * h
        assert total_params(m) == pytest.approx(nar + 2 * h)  # + final LayerNorm
    assert total_params(get_preset("llama3-8b")) == pytest.approx(8.03e9, rel=0.01)
    assert total_params(get_preset("llama3-70b")) == pytest.approx(70.6e9, rel=0.01)
    assert total_params(get_preset("llama3-405b")) == pytest.approx(405.9e9, rel=0.01)


def test_flops_conventions():
    m = gpt(96, 12288, 96)
    B, s, L, h, V = 1536, 2048, 96, 12288, 51200
    nar = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    kor = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert F.hardware_flops_per_iteration(m, B, "full") == pytest.approx(nar)
    assert F.model_flops_per_iteration(m, B) == pytest.approx(kor)


def test_padded_vocab():
    assert padded_vocab(gpt(2, 64, 2, V=50257), 1) == 50304
    assert padded_vocab(gpt(2, 64, 2, V=50257), 8) == 51200


# -- memory ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("d,z1,z2,z3", [(1, 120, 120, 120), (4, 52.5, 41.3, 30.0),
                                        (16, 35.6, 21.6, 7.5), (64, 31.4, 16.6, 1.88)])
def test_zero_table1_exact(d, z1, z2, z3):
    """ZERO table 1: 7.5B parameters, model states per GPU in GB, to 0.1 GB."""
    P = 7.5e9
    for stage, expect in ((0, 120), (1, z1), (2, z2), (3, z3)):
        got = sum(x for x in model_state_bytes_per_param(stage, d, grad_bytes=2)) * P / GB
        assert abs(float(got) - expect) <= 0.1, (stage, d, got, expect)


def test_megatron_distributed_optimizer_bytes():
    w, g, o = model_state_bytes_per_param(1, 8, grad_bytes=4)
    assert float(w + g + o) == pytest.approx(6 + 12 / 8)
    assert float(sum(model_state_bytes_per_param(0, 8, grad_bytes=4))) == 18


def test_activation_formulas_kor_table2():
    m = gpt(48, 6144, 64)
    s, b, h, a, t = 2048, 4, 6144, 64, 8
    sbh = s * b * h
    L = make_layouts([dict(tp=t, mbs=b, sp=0), dict(tp=t, mbs=b, sp=1), dict(tp=1, mbs=b)])
    act = activation_bytes_per_layer(m, s, L)
    assert act["none"][0] == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert act["none"][1] == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert act["none"][2] == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert act["selective"][0] == pytest.approx(sbh * (10 + 24 / t))
    assert act["selective"][1] == pytest.approx(34 * sbh / t)
    assert act["full"][0] == pytest.approx(2 * sbh)


def test_inflight_microbatches():
    L = make_layouts([dict(pp=8, vp=1), dict(pp=8, vp=2), dict(pp=1), dict(pp=8, vp=1)])
    got = inflight_microbatches(L, np.array([64, 64, 64, 4]))
    assert got.tolist() == pytest.approx([8, 8 * (1 + 7 / 16), 1, 4])


def test_memory_terms_sum_and_states():
    m = gpt(24, 2304, 24)
    L = make_layouts([dict(tp=1, pp=1, dp=4, mbs=2, recompute="full", zero=0)])
    mem = memory_terms(m, L, 64, 2048, Options(grad_bytes=4))
    parts = ["weights", "gradients", "optimizer", "activations", "embedding_output", "reserve"]
    assert float(sum(mem[k][0] for k in parts)) == pytest.approx(float(mem["total"][0]))
    P = float(mem["params_per_gpu"][0])
    assert P == pytest.approx(total_params(m), rel=1e-3)  # tied, p = 1: everything once
    assert float(mem["weights"][0]) == pytest.approx(2 * P)
    assert float(mem["optimizer"][0]) == pytest.approx(12 * P)
    # full recompute: L x 2sbh + the larger of the two phases that never meet: one recomputed
    # layer (backward, after the loss's saved tensors are consumed) and the fused loss's forward
    # peak, what it saves + one chunk of logits (fp32 + its bf16 copy, [n, V] with n = loom's
    # chunk rule: n V >= S h); the saved part is counted in embedding_output
    act = activation_bytes_per_layer(m, 2048, L)
    S, V = 2 * 2048, float(padded_vocab(m, 1))
    n = default_chunk_tokens(S, 2304, V)
    assert n * V >= S * 2304 and n <= S
    saved = 4 * S * 2304 + 4 * V * 2304 + 4 * S
    assert float(mem["activations"][0]) == pytest.approx(
        24 * 2 * 2048 * 2 * 2304 + max(float(act["none"][0]), saved + 6 * n * V) - saved)
    # what the loss keeps for its backward: dL/dx, dL/dw, log-sum-exp (fp32) + 2 x 2 S h inputs
    # (final norm, output layer) + the embedding's dropout mask (1 B, p = 1)
    assert m.hidden_dropout > 0
    assert float(mem["embedding_output"][0]) == pytest.approx(
        4 * S * 2304 + 4 * V * 2304 + 4 * S + 2 * 2 * S * 2304 + S * 2304)


# -- time ------------------------------------------------------------------------------------------

def test_bubble_fraction_and_flops_consistency():
    m = gpt(96, 12288, 96)
    cl = make_cluster("A100-80GB", 512)
    B = 512
    L = make_layouts([dict(tp=8, pp=8, dp=8, vp=1, mbs=1), dict(tp=8, pp=8, dp=8, vp=4, mbs=1)])
    tt = time_terms(m, L, B, 2048, cl, Options())
    mb = 64  # m = B / (b d)
    assert tt["pp_bubble"][0] == pytest.approx(7 * tt["microbatch_time"][0])
    assert tt["pp_bubble"][1] == pytest.approx(7 / 4 * tt["microbatch_time"][1])
    assert tt["pp_bubble"][0] / (mb * tt["microbatch_time"][0]) == pytest.approx(7 / 64)
    res = evaluate(m, L, B, 2048, cl, Options())
    assert res["tflops_per_gpu"][0] * 1e12 * res["time_iteration"][0] * 512 == pytest.approx(
        F.model_flops_per_iteration(m, B))
    assert res["mfu"][0] == pytest.approx(res["tflops_per_gpu"][0] * 1e12 / cl.peak_flops)


def test_recompute_and_sp_ordering():
    m = gpt(48, 6144, 64)
    cl = make_cluster("A100-80GB", 8)
    L = make_layouts([dict(tp=8, mbs=4, recompute=r, sp=sp)
                      for r, sp in (("none", 0), ("selective", 1), ("full", 0))])
    res = evaluate(m, L, 4, 2048, cl, Options())
    t = res["time_iteration"]
    assert t[0] < t[2] and t[1] < t[2]
    mem = res["mem_activations"]
    assert mem[2] < mem[1] < mem[0]


# -- search ----------------------------------------------------------------------------------------

def test_search_layouts_pass_loom_validation():
    """The command of every sampled layout (:func:`loom.planner.command.train_command`) is one
    loom train's config accepts at that world size, with the searched data-parallel size; a
    split only Megatron's --pipeline-model-parallel-layout expresses (24 layers over 16 stages,
    balanced) is given as that flag, which loom train takes."""
    from loom.planner.command import command_config, loom_takes_layout_string, train_command
    assert loom_takes_layout_string()
    m = gpt(24, 2304, 24)
    cl = make_cluster("A100-80GB", 32)
    L = enumerate_layouts(m, cl, 512, 2048)
    res = evaluate(m, L, 512, 2048, cl)
    idx = np.random.default_rng(0).choice(len(L["tp"]), 200, replace=False)
    needs_layout = 0
    for i in idx:
        rec = record(res, int(i))
        text = train_command(rec, m, 512, 2048, 32, 8)
        if "--pipeline-model-parallel-layout" in text:
            assert 24 % rec["pp"] or rec["vp"] > 1 and len(set(rec["chunk_layers"])) > 1
            needs_layout += 1
        cfg = command_config(text, 32)
        assert cfg.data_parallel_size(32) == rec["dp"]
    assert 0 < needs_layout < len(idx) // 2
    assert np.all(L["tp"] <= 8)
    assert {16.0, 8.0} <= set(L["pp"])  # 24 over 16 stages plans (balanced), 24 over 8 evenly


def test_search_fixed_dims_and_ranking():
    m = get_preset("gpt3-175b")
    cl = make_cluster("A100-80GB", 1024)
    res = search(m, cl, 1536, 2048, fixed=dict(tp=8, pp=2))
    assert len(res["order"]) > 0
    assert np.all(res["tp"] == 8) and np.all(res["pp"] == 2)
    times = res["time_iteration"][res["order"]]
    assert np.all(np.diff(times) >= 0)
    assert np.all(res["mem_total"][res["order"]] <= cl.hbm_bytes)


def test_search_175b_enumerates_the_space():
    """The default search scores every layout of 175B on 1,024 GPUs in one vectorized pass; how
    fast is a benchmark (``python -m benchmarks.planner_search_speed``), not a timed test."""
    m = get_preset("gpt3-175b")
    res = search(m, make_cluster("A100-80GB", 1024), 1536, 2048)
    assert len(res["tp"]) > 10000


# -- predict_layout (loom train --dry-run) ---------------------------------------------------------

def test_predict_layout_matches_search():
    cfg = LoomConfig.from_flat(dict(
        num_layers=96, hidden_size=12288, num_attention_heads=96, vocab_size=51200,
        seq_length=2048, tensor_model_parallel_size=8, pipeline_model_parallel_size=8,
        num_layers_per_virtual_pipeline_stage=3, micro_batch_size=1, global_batch_size=1536,
        recompute_granularity="full", sequence_parallel=True,
        overlap_grad_reduce=True))  # as the search times it: the DP reduction overlapped
    pred = predict_layout(cfg, 1024, "A100-80GB")
    assert pred["layout"]["vp"] == 4 and pred["layout"]["dp"] == 16
    assert set(pred["memory_bytes"]) >= {"weights", "gradients", "optimizer", "activations",
                                         "embedding_output", "reserve", "total"}
    assert pred["time_s"]["iteration"] == pytest.approx(
        sum(v for k, v in pred["time_s"].items() if k != "iteration"))
    res = search(cfg.model, make_cluster("A100-80GB", 1024), 1536, 2048,
                 fixed=dict(tp=8, pp=8, vp=4, mbs=1, recompute="full", sp=1, zero=0),
                 opts=Options(flash_attention=True))
    assert record(res, res["order"][0])["iteration_time_s"] == pytest.approx(
        pred["time_s"]["iteration"])
    text = format_prediction(pred)
    assert "memory per GPU" in text and "MFU" in text


# -- CLI -------------------------------------------------------------------------------------------

def _plan(argv, capsys):
    from loom.cli import main
    with pytest.raises(SystemExit) as e:
        main(["plan"] + argv)
    return e.value.code, capsys.readouterr()


def test_cli_json_and_fixed(capsys):
    code, out = _plan(["gpt3-175b", "--num-gpus", "1024", "--global-batch-size", "1536",
                       "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2",
                       "--json", "--top", "5"], capsys)
    assert code == 0
    doc = json.loads(out.out)
    assert len(doc["layouts"]) == 5
    keys = {"tp", "pp", "dp", "cp", "vp", "micro_batch_size", "recompute", "sequence_parallel",
            "zero", "memory_gb", "iteration_time_s", "tokens_per_s", "tflops_per_gpu",
            "hw_tflops_per_gpu", "mfu"}
    for r in doc["layouts"]:
        assert keys <= set(r) and r["tp"] == 8 and r["pp"] == 2
    assert doc["layouts"][0]["iteration_time_s"] <= doc["layouts"][-1]["iteration_time_s"]


def test_cli_schedule_and_no_sp_fix_their_dimension(capsys):
    """``--pipeline-schedule 1f1b`` plans one chunk per rank, ``interleaved`` more than one (as
    loom train reads them), ``--no-sequence-parallel`` SP off: every row, not just the top."""
    base = ["--num-layers", "12", "--hidden-size", "512", "--num-attention-heads", "8",
            "--seq-length", "1024", "--vocab-size", "50257", "--global-batch-size", "32",
            "--gpu", "H100-80GB", "--num-gpus", "8", "--json", "--top", "1000"]
    rows = {}
    for extra in (["--pipeline-schedule", "1f1b"], ["--pipeline-schedule", "interleaved"],
                  ["--no-sequence-parallel"], []):
        code, out = _plan(base + extra, capsys)
        assert code == 0, out.err
        rows[" ".join(extra)] = json.loads(out.out)["layouts"]
    assert {r["vp"] for r in rows[""]} > {1} and {r["sequence_parallel"] for r in rows[""]} \
        == {False, True}  # searched when not given
    assert {r["vp"] for r in rows["--pipeline-schedule 1f1b"]} == {1}
    inter = rows["--pipeline-schedule interleaved"]
    assert inter and min(r["vp"] for r in inter) > 1 and min(r["pp"] for r in inter) > 1
    assert not any(r["sequence_parallel"] for r in rows["--no-sequence-parallel"])
    code, out = _plan(base + ["--pipeline-schedule", "interleaved",
                              "--pipeline-model-parallel-size", "1"], capsys)
    assert code == 2 and "--pipeline-schedule interleaved needs" in out.err


def test_cli_table_custom_model_and_plot(capsys, tmp_path):
    png = tmp_path / "p.png"
    code, out = _plan(["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads",
                       "32", "--ffn-hidden-size", "11008", "--vocab-size", "32000",
                       "--seq-length", "4096", "--num-gpus", "64", "--gpu", "H100-80GB",
                       "--global-batch-size", "512", "--plot", str(png)], capsys)
    assert code == 0 and "tp pp" in out.out and png.stat().st_size > 1000


def test_cli_cluster_file_and_errors(capsys, tmp_path):
    path = tmp_path / "c.json"
    make_cluster("H200", 16).save(path)
    code, out = _plan(["llama3-8b", "--cluster", str(path), "--global-batch-size", "64",
                       "--json", "--top", "1"], capsys)
    assert code == 0 and json.loads(out.out)["gpu"] == "H200"
    code, out = _plan(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"],
                      capsys)
    assert code == 2 and "--vocab-size" in out.err


def test_calibrate_fit_alpha_beta():
    from loom.planner.calibrate import fit_alpha_beta
    sizes = np.array([1e3, 1e5, 1e7])
    times = 2 * 1 * 5e-5 + 2 * 1 / 2 * sizes / 2e9
    alpha, bw = fit_alpha_beta(sizes, times, 2)
    assert alpha == pytest.approx(5e-5, rel=1e-6) and bw == pytest.approx(2e9, rel=1e-6)


def test_planner_does_not_import_distributed():
    import subprocess
    import sys
    code = ("import sys, loom.planner.cli, loom.planner.search, loom.planner.predict;"
            "print('torch.distributed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_trainer_predicts_the_step_only_when_asked(monkeypatch):
    """Building a trainer runs the cost model only with --planner-cluster (issue 46): without it
    no prediction is made (predict_layout is not called); with a GPU name it is the planner's
    iteration time; a failing prediction is one RuntimeWarning naming the flag, not silence."""
    import loom.training.setup as setup
    cfg = LoomConfig.from_flat(dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                                    vocab_size=128, seq_length=32, micro_batch_size=1,
                                    global_batch_size=8))
    called = []
    real = setup.predict_layout
    monkeypatch.setattr(setup, "predict_layout", lambda *a, **k: called.append(1) or real(*a, **k))
    assert setup.predict_step_time(cfg, 2) is None and not called
    cfg.logging.planner_cluster = "H100-80GB"
    assert setup.predict_step_time(cfg, 2) == pytest.approx(
        predict_layout(cfg, 2, "H100-80GB")["time_s"]["iteration"])
    assert called
    cfg.logging.planner_cluster = "no-such-cluster.json"
    with pytest.warns(RuntimeWarning, match="--planner-cluster no-such-cluster.json: no step-time"):
        assert setup.predict_step_time(cfg, 2) is None
