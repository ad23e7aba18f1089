"""``loom plan --calibrate-from RUNS.jsonl`` (issue 47 item 4): a user's measured runs fit the
GEMM efficiency, the element-wise traffic and the memory reserve, how many of the first two by
leave-one-out cross-validation (``calibrate_runs.select_fit``). The runs here are made by the
planner itself on a cluster whose true parameters differ from the shipped ones, so the fit must
recover them and predict a layout it did not see; the rule itself is checked on residuals given
by hand; the 3-shot protocol on two published sources must not end worse than no calibration.
The network fraction (``calibrate_runs.NETWORK``, not a default candidate) is recovered the same
way when asked for.
Single process."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np

import pytest

from loom.config import ConfigError
from loom.planner.calibrate_runs import (BOUNDS, NETWORK, PARAMS, calibrate, candidates,
                                         select_fit)
from loom.planner.hardware import GB, make_cluster
from loom.planner.layout import Options, make_layouts
from loom.planner.measured_runs import read_runs
from loom.planner.presets import gpt
from loom.planner.search import evaluate

MODEL = gpt(8, 1024, 16, s=2048)
LAYOUTS = [dict(tp=1, pp=1, dp=8, mbs=2, recompute="none", zero=1),
           dict(tp=2, pp=1, dp=4, mbs=4, recompute="selective", sp=1),
           dict(tp=2, pp=2, dp=2, mbs=1, recompute="full"),
           dict(tp=1, pp=2, dp=4, mbs=1, recompute="selective", zero=1),
           dict(tp=8, pp=1, dp=1, mbs=4, recompute="full", sp=1),
           dict(tp=4, pp=1, dp=2, mbs=8, recompute="none", sp=1)]  # the held-out one
TRUE = dict(gemm_efficiency=0.55, mem_traffic=4.0)
TRUE_RESERVE = 6e9


def _measured(cl, layouts):
    truth = replace(cl, **TRUE)
    opts = Options(flash_attention=True, reserve_bytes=TRUE_RESERVE)
    out = []
    for lay in layouts:
        e = evaluate(MODEL, make_layouts([lay]), 64, 2048, truth, opts)
        out.append(dict(layout=lay, step_time_s=float(e["time_iteration"][0]),
                        peak_memory_gb=float(e["mem_total"][0] / GB)))
    return out


def test_five_runs_recover_the_parameters_and_predict_a_sixth():
    cl = make_cluster("A100-80GB", 8)
    runs = _measured(cl, LAYOUTS)
    fitted, opts, rep = calibrate(MODEL, cl, runs[:5], 64, 2048, Options(flash_attention=True))
    assert fitted.gemm_efficiency == pytest.approx(TRUE["gemm_efficiency"], rel=1e-3)
    assert fitted.mem_traffic == pytest.approx(TRUE["mem_traffic"], rel=1e-3)
    assert opts.reserve_bytes == pytest.approx(TRUE_RESERVE, rel=1e-6)
    assert rep["median_before"] > 0.05 and rep["median_after"] < 1e-4
    e = evaluate(MODEL, make_layouts([LAYOUTS[5]]), 64, 2048, fitted, opts)
    assert float(e["time_iteration"][0]) == pytest.approx(runs[5]["step_time_s"], rel=1e-3)
    assert float(e["mem_total"][0]) / GB == pytest.approx(runs[5]["peak_memory_gb"], rel=1e-6)
    assert rep["loo"]["gemm_efficiency+mem_traffic"] < 1e-8 < rep["loo"]["gemm_efficiency"]
    # 3 noise-free runs determine e and k too: leave-one-out picks both and nothing is shrunk
    fit3, _, three = calibrate(MODEL, cl, runs[:3], 64, 2048, Options(flash_attention=True))
    assert set(three["fitted"]) == {"gemm_efficiency", "mem_traffic", "reserve_bytes"}
    assert fit3.gemm_efficiency == pytest.approx(TRUE["gemm_efficiency"], rel=1e-3)
    assert fit3.mem_traffic == pytest.approx(TRUE["mem_traffic"], rel=1e-3)
    # the default candidates: no network fraction (calibrate_runs.FREE)
    assert set(three["loo"]) == {"none", "gemm_efficiency", "gemm_efficiency+mem_traffic"}
    assert fit3.dp_net_efficiency == 1.0


# 4 nodes of 8 A100: DP across the nodes (32, 16, 4 and 8 ranks: the hierarchical ring), and
# a last layout without DP (pp 4 x tp 8: TP and pipeline p2p only), which no network fraction moves
NET_LAYOUTS = [dict(tp=1, pp=1, dp=32, mbs=2, recompute="none"),
               dict(tp=2, pp=1, dp=16, mbs=2, recompute="selective", sp=1),
               dict(tp=8, pp=1, dp=4, mbs=4, recompute="none", sp=1),
               dict(tp=4, pp=1, dp=8, mbs=1, recompute="full", sp=1),  # the held-out one
               dict(tp=8, pp=4, dp=1, mbs=1, recompute="none", sp=1)]
TRUE_NET = 0.4


def test_three_runs_recover_the_network_fraction_and_predict_a_fourth():
    """Runs made by the planner on 32 GPUs whose DP collectives get 40% of the inter-node
    bandwidth (shipped e and k), calibrated with the network fraction among the candidates
    (``free=NETWORK``; not the default, docs/planner.md "3-shot calibration"): leave-one-out
    picks it alone (e would only bend the compute to mimic it) and recovers it; a layout it
    did not see is predicted."""
    cl = make_cluster("A100-80GB", 32)
    truth = replace(cl, dp_net_efficiency=TRUE_NET)
    opts = Options(flash_attention=True)
    runs = []
    for lay in NET_LAYOUTS:
        e = evaluate(MODEL, make_layouts([lay]), 64, 2048, truth, opts)
        assert float(e["time_dp_comm"][0]) > 0.1 * float(e["time_iteration"][0]) or \
            lay["dp"] == 1  # the DP step is a visible part of these runs
        runs.append(dict(layout=lay, step_time_s=float(e["time_iteration"][0])))
    fitted, _, rep = calibrate(MODEL, cl, runs[:3], 64, 2048, opts, free=NETWORK)
    assert set(rep["fitted"]) == {"dp_net_efficiency"} and "gemm_efficiency" in rep["kept"]
    assert fitted.dp_net_efficiency == pytest.approx(TRUE_NET, rel=1e-3)
    assert fitted.gemm_efficiency == cl.gemm_efficiency  # e kept (0: the shipped default)
    assert rep["loo"]["dp_net_efficiency"] < 1e-8 < rep["loo"]["gemm_efficiency"]
    assert rep["median_before"] > 0.05 and rep["median_after"] < 1e-4
    for run in runs[3:]:
        e = evaluate(MODEL, make_layouts([run["layout"]]), 64, 2048, fitted, opts)
        assert float(e["time_iteration"][0]) == pytest.approx(run["step_time_s"], rel=1e-3)
    # identifiable: the pp 4 x tp 8 run (no DP) is the same at any network fraction
    no_dp = [evaluate(MODEL, make_layouts([NET_LAYOUTS[4]]), 64, 2048, c, opts)["time_iteration"]
             for c in (cl, truth)]
    assert float(no_dp[0][0]) == float(no_dp[1][0])


def _by_hand(a, b, d, c=None):
    """``log_errors`` of runs whose log error is ``a_i log(e / e0) + b_i log(k / k0) + c_i
    log(net) + d_i`` (``a``, ``b``, ``c``: each run's sensitivity to e, k and the network
    fraction (shipped 1); ``d``: its error at the shipped values)."""
    a, b, d = (np.asarray(v, dtype=float) for v in (a, b, d))
    c = 0 * a if c is None else np.asarray(c, dtype=float)

    def log_errors(v):
        return (a * math.log(v.get("gemm_efficiency", 0.8) / 0.8)
                + b * math.log(v.get("mem_traffic", 2.5) / 2.5)
                + c * math.log(v.get("dp_net_efficiency", 1.0)) + d)
    return log_errors


def test_leave_one_out_keeps_what_predicts_the_left_out_run():
    """The documented rule (calibrate_runs module docstring): the nested candidates none / e /
    e+k with at most n - 1 parameters, the smallest mean squared leave-one-out error, fewer
    parameters on a tie."""
    start = {"gemm_efficiency": 0.8, "mem_traffic": 2.5}
    # every run 10% slow: e explains it; k is not seen by any run (b = 0) and stays at the prior
    r = select_fit(_by_hand([-1, -0.8, -0.9], [0, 0, 0], [0.1, 0.08, 0.09]), start)
    assert r["names"] == ("gemm_efficiency",) and r["values"]["mem_traffic"] == 2.5
    loo = r["loo"]
    assert loo["gemm_efficiency"] == loo["gemm_efficiency+mem_traffic"] < loo["none"]
    assert r["values"]["gemm_efficiency"] == pytest.approx(0.8 * math.exp(0.1), rel=0.02)
    # two runs agree with the shipped values, one is 30% off: a fit would follow it, so none
    r = select_fit(_by_hand([-1, -1, -1], [0.2, 0.3, 0.1], [0, 0, 0.3]), start)
    assert r["names"] == () and r["values"] == start
    assert r["loo"]["none"] < r["loo"]["gemm_efficiency"]
    # LOO by hand for "none" (the errors at the shipped values) and for e (refit on two runs)
    assert r["loo"]["none"] == pytest.approx(0.3 ** 2 / 3)
    assert r["loo"]["gemm_efficiency"] == pytest.approx((0.15 ** 2 + 0.15 ** 2 + 0.3 ** 2) / 3,
                                                        rel=1e-3)
    # two runs: at most one parameter; one run: e alone, not cross-validated
    assert set(select_fit(_by_hand([-1, -1], [1, 1], [0.1, 0.1]), start)["loo"]) == \
        {"none", "gemm_efficiency"}
    one = select_fit(_by_hand([-1], [1], [0.1]), start)
    assert one["names"] == ("gemm_efficiency",) and one["loo"] == {}
    # the bounds: e never above peak
    up = select_fit(_by_hand([-1, -1, -1], [0, 0, 0], [0.5, 0.5, 0.5]), start)
    assert up["values"]["gemm_efficiency"] == pytest.approx(BOUNDS["gemm_efficiency"][1])


def test_leave_one_out_fits_the_network_only_where_it_helps():
    """The network fraction (``free=NETWORK``) joins the candidates (none, e, net, e+k, e+net
    for 3 runs), by the same rule: fitted where the runs' errors follow their DP share, never
    where no run's DP crosses nodes (a tie with "none"), never above the link (<= 1)."""
    start = {"gemm_efficiency": 0.8, "mem_traffic": 2.5, "dp_net_efficiency": 1.0}
    assert candidates(3, PARAMS, NETWORK) == [
        (), ("gemm_efficiency",), ("dp_net_efficiency",), ("gemm_efficiency", "mem_traffic"),
        ("gemm_efficiency", "dp_net_efficiency")]
    # the runs are slow in proportion to their DP share (c: d log(time) / d log(net)), as on a
    # network at half the modelled bandwidth; the run without DP (c = 0) is on time
    c = np.array([-0.3, -0.5, 0.0])
    r = select_fit(_by_hand([-1, -1, -1], [0.2, 0.1, 0.3], -c * math.log(0.5), c), start,
                   free=NETWORK)
    assert r["names"] == ("dp_net_efficiency",)
    assert r["values"]["dp_net_efficiency"] == pytest.approx(0.5, rel=1e-3)
    assert r["loo"]["dp_net_efficiency"] < 1e-8 < r["loo"]["gemm_efficiency"]
    # no run's DP crosses nodes: every candidate with the network fraction ties with the one
    # without it, and the fewer parameters win (the e-only case of the test above)
    r = select_fit(_by_hand([-1, -0.8, -0.9], [0, 0, 0], [0.1, 0.08, 0.09], [0, 0, 0]), start,
                   free=NETWORK)
    assert r["names"] == ("gemm_efficiency",) and r["values"]["dp_net_efficiency"] == 1.0
    assert r["loo"]["dp_net_efficiency"] == r["loo"]["none"]
    # runs faster than the modelled link: the fraction would go above 1, it stops at 1 and so
    # ties with "none"
    net = select_fit(_by_hand([0, 0, 0], [0, 0, 0], [0.1, 0.2, 0.0], [-0.3, -0.5, 0.0]),
                     {"dp_net_efficiency": 1.0}, order=(), free=NETWORK)
    assert net["names"] == () and net["values"]["dp_net_efficiency"] == 1.0
    assert net["loo"]["dp_net_efficiency"] == net["loo"]["none"] == pytest.approx(0.05 / 3)


def test_cli_plans_with_the_calibration_and_refuses_a_bad_line(tmp_path, capsys):
    from loom.cli import main
    cl = make_cluster("A100-80GB", 8)
    f = tmp_path / "runs.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in _measured(cl, LAYOUTS[:5])) + "\n")
    argv = ["plan", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--seq-length", "2048", "--vocab-size", "51200", "--num-gpus", "8",
            "--global-batch-size", "64", "--calibrate-from", str(f)]
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr().out
    assert e.value.code == 0 and f"calibrated from 5 runs of {f}: gemm_efficiency" in out
    assert "mem_traffic 2.49 -> 4" in out and "reserve 2 -> 6 GB" in out
    with pytest.raises(SystemExit):
        main(argv + ["--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["calibration"]["fitted"]["gemm_efficiency"][1] == pytest.approx(0.55, rel=1e-3)
    f.write_text('{"layout": {"tp": 2, "dp": 4, "pipeline": 2}, "step_time_s": 1}\n')
    with pytest.raises(ConfigError, match=r"runs.jsonl:1: unknown layout key\(s\) \['pipeline'\]"):
        read_runs(str(f))


MARGIN = 0.005  # a calibration may cost at most half a point of median error


@pytest.mark.parametrize("source", ["LF-A100", "MegaScale"])
def test_three_shot_is_not_worse_than_no_calibration(source):
    """benchmarks/planner_sources/three_shot.py on two sources in no fit set (so the shipped
    constants are their held-out ones: this is the protocol itself), first/middle/last rows:
    the calibrated median of the other rows is at most ``MARGIN`` above the uncalibrated one.
    The rule before (e alone, always) fails this on LF-A100 (2.9% -> 10.6%: its first row, 30B
    at s = 8192, is its worst, +30%); on MegaScale (uniformly over-predicted) the calibration
    must help: 9.6% -> 2.8%."""
    from benchmarks.planner_sources.fit import source_points
    from benchmarks.planner_sources.three_shot import calibrate_source
    from loom.planner.constants import SHIPPED
    r = calibrate_source(source, SHIPPED)
    assert len(r["shots"]) == 3 and r["after"]["n"] == len(source_points(source, SHIPPED)) - 3
    assert r["after"]["median"] <= r["before"]["median"] + MARGIN
    if source == "LF-A100":
        assert r["params"] == {}  # leave-one-out keeps the shipped constants
        assert calibrate_source(source, SHIPPED, old=True)["after"]["median"] > \
            r["before"]["median"] + 0.05
    else:
        assert set(r["params"]) == {"gemm_efficiency"} and r["after"]["median"] <= 0.05


def _log_run(path, cfg, world: int, step_times: list, reserved: float = 0.0) -> None:
    """``loom train --log-json``'s records of one run (MetricsLogger's header and train lines;
    ``reserved``: a CUDA run's ``peak_memory_reserved_bytes``, growing to it)."""
    from loom.training.metrics import MetricsLogger
    log = MetricsLogger(True, str(path), None, len(step_times), False, config=cfg.to_flat(),
                        world_size=world, timestamps=False)
    for i, t in enumerate(step_times, 1):
        log.log(dict(iteration=i, loss=3.0, lr=1e-4, grad_norm=1.0, tokens_per_s=1.0,
                     tflops_per_rank=1.0, mfu=None, step_time_s=t, peak_memory_bytes=1,
                     **({"peak_memory_reserved_bytes": reserved * i / len(step_times)}
                        if reserved else {})))
    log.close()


def test_loom_train_logs_calibrate_like_runs_files(tmp_path, capsys):
    """``--calibrate-from`` takes a ``loom train --log-json`` file (runs appended to one file):
    each run's layout from its own config and world size, its step time the median after the
    first step, its own DP overlap, buckets and optimizer; three such runs made by the planner
    under a slower cluster recover its GEMM efficiency. A run of another model, or a header
    without the world size, is refused naming the line."""
    from loom.planner.predict import layout_of, run_options
    from testkit.config import tiny_config
    world, cl = 8, make_cluster("A100-80GB", 8)
    shape = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256,
                 max_position_embeddings=256, vocab_size=1024, ffn_hidden_size=1024,
                 num_query_groups=8)
    flags = [dict(tensor_model_parallel_size=2, micro_batch_size=2),
             dict(pipeline_model_parallel_size=2, micro_batch_size=1, overlap_grad_reduce=True),
             dict(tensor_model_parallel_size=4, sequence_parallel=True, micro_batch_size=4,
                  recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=1)]
    cfgs = [tiny_config("llama", **shape, global_batch_size=32, **f).validate(world)
            for f in flags]
    model = cfgs[0].model
    slow = replace(cl, gemm_efficiency=0.4)
    path = tmp_path / "runs.jsonl"
    truths = []
    for cfg in cfgs:
        e = evaluate(model, make_layouts([layout_of(cfg, world)]), 32, 256, slow,
                     run_options(cfg))
        t = float(e["time_iteration"][0])
        truths.append(t)
        reserved = float(e["mem_total"][0] - e["mem_reserve"][0]) * 1.05 + 3e9  # as on a GPU
        _log_run(path, cfg, world, [10 * t, t, t], reserved)  # the first step: left out
    from loom.planner.measured_runs import RUN_OPTIONS
    for cfg in cfgs:  # every option a run fixes travels with it
        own = run_options(cfg)
        assert replace(Options(), **{k: getattr(own, k) for k in RUN_OPTIONS}) == own
    runs = read_runs(str(path))
    assert [r["step_time_s"] for r in runs] == pytest.approx(truths, rel=1e-12)
    assert [r["layout"]["tp"] for r in runs] == [2, 1, 4] and runs[1]["layout"]["pp"] == 2
    assert runs[1]["options"]["overlap_grad_reduce"] and not runs[0]["options"][
        "overlap_grad_reduce"]
    # the reserved peak (the last, largest record) where every rank holds the same: not PP
    assert ["peak_memory_gb" in r for r in runs] == [True, False, True]
    fitted, fitted_opts, rep = calibrate(model, cl, runs, 32, 256, Options(flash_attention=True))
    assert fitted.gemm_efficiency == pytest.approx(0.4, rel=1e-6) and rep["median_after"] < 1e-6
    assert fitted_opts.reserve_bytes == pytest.approx(3e9, rel=1e-6)  # 1.05 = 1 + the fraction
    assert set(rep["fitted"]) == {"gemm_efficiency", "reserve_bytes"}  # e alone: k is kept
    other = tiny_config("llama", **{**shape, "hidden_size": 512}).validate(world).model
    with pytest.raises(ConfigError, match=r"runs.jsonl: run 1 \(.*\): its model has hidden_size"):
        calibrate(other, cl, runs, 32, 256, Options(flash_attention=True))
    old = tmp_path / "old.jsonl"
    rec = json.loads(path.read_text().splitlines()[0])
    rec.pop("world_size")
    old.write_text(json.dumps(rec) + "\n")
    old.write_text(old.read_text() + path.read_text().splitlines()[1] + "\n")  # + a step
    with pytest.raises(ConfigError, match=r"old.jsonl: run 1 \(.*\) has no world_size"):
        read_runs(str(old))


def test_a_real_loom_train_log_is_read(tmp_path, capsys):
    """The file a real (single-rank) loom train writes: one run, its layout and step time;
    ``loom plan --calibrate-from`` plans with it."""
    import statistics
    import torch
    from loom.cli import main
    from loom.config.run_log import read_run_log
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    from testkit.config import tiny_config
    log = tmp_path / "log.jsonl"
    cfg = tiny_config("llama", log_json=str(log), train_iters=3, log_interval=1,
                      eval_iters=0).validate(1)
    Trainer(cfg, mesh=ParallelMesh.single(torch.device("cpu"))).train()
    runs = read_runs(str(log))
    steps = [r["step_time_s"] for r in read_run_log(str(log))[0]["train"]]
    assert len(runs) == 1 and runs[0]["num_gpus"] == 1 and runs[0]["layout"]["dp"] == 1
    assert runs[0]["step_time_s"] == pytest.approx(statistics.median(steps[1:]))
    m = cfg.model
    with pytest.raises(SystemExit) as e:
        main(["plan", "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
              "--num-attention-heads", str(m.num_attention_heads),
              "--num-query-groups", str(m.num_kv_groups), "--ffn-hidden-size", str(m.ffn_size),
              "--vocab-size", str(m.vocab_size), "--seq-length", str(m.seq_length),
              "--global-batch-size", str(runs[0]["global_batch_size"]), "--num-gpus", "1",
              "--calibrate-from", str(log), "--top", "1"])
    out = capsys.readouterr()
    assert e.value.code == 0 and f"calibrated from 1 runs of {log}" in out.out, out.err
