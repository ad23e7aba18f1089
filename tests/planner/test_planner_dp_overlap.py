"""The planner plans the data-parallel overlap the command it prints runs: ``--overlap-grad-reduce``
and ``--overlap-param-gather`` are off by default in loom train (as in Megatron), so a plan that
hides the DP reduce-scatter / all-gather must print them, ``loom plan --dp-overlap off`` plans
them exposed, and the trainer's own prediction (``predict_layout``) follows the run's flags.
Single process, a few seconds."""

from __future__ import annotations

import json

import pytest

from loom.cli import main
from loom.config import LoomConfig
from loom.planner.command import command_config, train_command
from loom.planner.hardware import make_cluster
from loom.planner.layout import Options, make_layouts, param_gather_overlapped
from loom.planner.predict import predict_layout
from loom.planner.presets import get_preset, gpt
from loom.planner.search import record, search
from loom.planner.timing import time_terms
from testkit.config import tiny_config

EXAMPLE = ["plan", "llama3-8b", "--gpu", "H100-80GB", "--num-gpus", "512",
           "--global-batch-size", "256", "--seq-length", "4096"]


def _terms(opts: Options, zero: int, dp: int = 64, m_total: int = 64):
    """time_terms of llama3-8b at t 2, ``dp`` replicas, b 1, ZeRO ``zero`` on H100s."""
    model = get_preset("llama3-8b")
    L = make_layouts(dict(tp=2, pp=1, cp=1, dp=dp, mbs=1, zero=zero, sp=1))
    return time_terms(model, L, m_total, 4096, make_cluster("H100-80GB", 2 * dp), opts)


def test_param_gather_overlap_is_its_own_option():
    """ZeRO-1: with both overlaps off the whole reduce-scatter + all-gather is exposed; turning
    on only the param gather hides part of the all-gather (the first bucket stays); None
    follows overlap_grad_reduce, so a source that states one overlap states both."""
    off = _terms(Options(overlap_grad_reduce=False, overlap_param_gather=False), 1)
    assert float(off["dp_comm"][0]) == pytest.approx(float(off["dp_comm_total"][0]), rel=1e-12)
    ag_on = _terms(Options(overlap_grad_reduce=False, overlap_param_gather=True), 1)
    rs_on = _terms(Options(overlap_grad_reduce=True, overlap_param_gather=False), 1)
    both = _terms(Options(), 1)
    assert float(both["dp_comm"][0]) < float(ag_on["dp_comm"][0]) < float(off["dp_comm"][0])
    assert float(both["dp_comm"][0]) < float(rs_on["dp_comm"][0]) < float(off["dp_comm"][0])
    assert float(ag_on["dp_comm"][0]) > 0  # the first bucket is never hidden
    follows = _terms(Options(overlap_grad_reduce=False), 1)
    assert float(follows["dp_comm"][0]) == float(off["dp_comm"][0])
    assert param_gather_overlapped(Options()) and not param_gather_overlapped(
        Options(overlap_grad_reduce=False))
    # ZeRO-0 has no all-gather: the param-gather option changes nothing there
    z0 = [float(_terms(Options(overlap_param_gather=v), 0)["dp_comm"][0]) for v in (True, False)]
    assert z0[0] == z0[1]


def _expected(rec: dict, opts: Options) -> tuple[bool, bool]:
    """(--overlap-grad-reduce, --overlap-param-gather) the row's timing assumed: a DP x CP
    reduction by loom's gradient buffer (ZeRO 0-2), the distributed optimizer's gather (1-2)."""
    dp = rec["dp"] * rec["cp"] > 1 and rec["zero"] < 3
    return (dp and opts.overlap_grad_reduce,
            dp and rec["zero"] in (1, 2) and param_gather_overlapped(opts))


@pytest.mark.parametrize("overlap", [True, False])
def test_every_ranked_row_command_carries_the_overlap_it_was_planned_with(overlap):
    """For the ranked rows of two searches (every ZeRO stage among them), the config loom train
    builds from the printed command (command_config: validated as loom train would) has exactly
    the DP overlap the planner timed that row with; and the run's own prediction of that config
    (predict_layout, the trainer's) gives the row's DP time."""
    opts = Options(flash_attention=True, layer_memory="loom", overlap_grad_reduce=overlap,
                   overlap_param_gather=overlap)
    seen = set()
    for model, gpu, n, B, s in ((get_preset("llama3-8b"), "H100-80GB", 512, 256, 4096),
                                (gpt(30, 2048, 16, s=4096), "A100-80GB", 64, 256, 4096)):
        cl = make_cluster(gpu, n)
        res = search(model, cl, B, s, opts=opts)
        order = [int(i) for i in res["order"]]
        firsts = [next(i for i in order if int(res["zero"][i]) == z) for z in range(4)
                  if any(int(res["zero"][i]) == z for i in order)]
        for i in dict.fromkeys(order[:6] + firsts):
            rec = record(res, i)
            text = train_command(rec, model, B, s, n, 8, opts)
            cfg = command_config(text, n)
            assert (cfg.parallel.overlap_grad_reduce, cfg.training.overlap_param_gather) == \
                _expected(rec, opts), text
            seen.add(rec["zero"])
            if rec["pp"] == 1 and rec["recompute"] != "full":  # layout_of reads these alone
                pred = predict_layout(cfg, n, cluster=cl)
                assert pred["time_s"]["dp_comm"] == pytest.approx(
                    rec["time_terms_s"]["dp_comm"], rel=1e-9, abs=1e-12)
    assert seen >= {1, 2, 3}


def _plan_json(argv, capsys) -> dict:
    with pytest.raises(SystemExit) as e:
        main(argv + ["--json", "--top", "5"])
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    return json.loads(out)


def test_loom_plan_dp_overlap_off_plans_exposed_and_prints_no_flags(capsys):
    """The 512-GPU llama3-8b example: on (default), the chosen tp2 dp256 ZeRO row carries both
    flags and hides most of its DP time; off, no command carries them, and that layout's DP
    time is its whole reduce-scatter + all-gather (several times the overlapped one)."""
    on = _plan_json(EXAMPLE, capsys)
    off = _plan_json(EXAMPLE + ["--dp-overlap", "off"], capsys)
    best = on["layouts"][0]
    assert (best["tp"], best["dp"], best["zero"]) == (2, 256, 2)
    assert "--overlap-grad-reduce" in best["command"] and \
        "--overlap-param-gather" in best["command"]
    for r in off["layouts"]:
        assert "--overlap-" not in r["command"]
    fixed = ["--tensor-model-parallel-size", "2", "--zero-stage", "2", "--micro-batch-size",
             "1", "--context-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    same = _plan_json(EXAMPLE + fixed + ["--dp-overlap", "off"], capsys)["layouts"][0]
    assert same["time_terms_s"]["dp_comm"] > 5 * best["time_terms_s"]["dp_comm"]
    assert same["iteration_time_s"] > best["iteration_time_s"]


def test_dp_overlap_off_with_an_overlap_flag_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(EXAMPLE + ["--dp-overlap", "off", "--overlap-grad-reduce"])
    assert e.value.code == 2
    assert "--dp-overlap off" in capsys.readouterr().err
    # given with on (the default), the flags agree: planned and printed as usual
    doc = _plan_json(EXAMPLE + ["--overlap-grad-reduce"], capsys)
    assert "--overlap-grad-reduce" in doc["layouts"][0]["command"]


def _config(d: int, zero: int, **flags) -> LoomConfig:
    return tiny_config(model=get_preset("llama3-8b"), mock_data=False,
                       tensor_model_parallel_size=2, micro_batch_size=1,
                       global_batch_size=2 * d, lr=1e-4, train_iters=1, zero_stage=zero,
                       overlap_grad_reduce=flags.get("grad", False),
                       overlap_param_gather=flags.get("param", False))


@pytest.mark.parametrize("zero", [0, 1])
def test_predict_layout_follows_the_runs_own_overlap_flags(zero):
    """The trainer's prediction (loom train --dry-run, --planner-cluster) times the run as
    configured: without --overlap-grad-reduce its DP reduction is exposed (more DP time than with
    it) at d > 1; at d = 1 there is none, so the flag changes nothing. ZeRO-1 also reads
    --overlap-param-gather."""
    n = 2 * 64
    plain = predict_layout(_config(64, zero), n, "H100-80GB")
    grad = predict_layout(_config(64, zero, grad=True), n, "H100-80GB")
    assert plain["time_s"]["dp_comm"] > grad["time_s"]["dp_comm"] > 0
    assert not plain["overlap"]["grad_reduce"] and grad["overlap"]["grad_reduce"]
    if zero:
        both = predict_layout(_config(64, zero, grad=True, param=True), n, "H100-80GB")
        assert grad["time_s"]["dp_comm"] > both["time_s"]["dp_comm"]
        assert both["overlap"] == {"grad_reduce": True, "param_gather": True}
    one = [predict_layout(_config(1, zero, grad=g), 2, "H100-80GB")["time_s"]["dp_comm"]
           for g in (False, True)]
    assert one == [0.0, 0.0]


def test_param_gather_starts_with_the_bucket_the_forward_needs_first(monkeypatch):
    """loom's ParamGather launches the buckets' all-gathers in the order the next forward uses
    them (first layer first): one group's collectives run in launch order, so launching the
    backward-ordered buckets first would make the first layer wait for every gather and
    --overlap-param-gather hide nothing. Rank 0 of torch's fake process group (no processes)."""
    from torch import nn
    import torch.distributed as dist
    from benchmarks.layer_memory import fake_world
    from loom.parallel.grad_buffer import GradBuffer
    from loom.training import distributed_optimizer as dopt

    launched = []
    monkeypatch.setattr(dopt, "_all_gather",
                        lambda out, inp, group, async_op: launched.append(out.data_ptr()))
    with fake_world(2):
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        grads = GradBuffer(model.parameters(), dist.group.WORLD, bucket_size=72,
                           reduce_scatter=True)
        gather = dopt.ParamGather(grads)
        assert len(grads.buckets) == 4
        gather.start(async_op=True)
        first = grads.bucket_of(model[0].weight)
        assert launched[0] == gather.buffers[id(first)].data_ptr()
        order = [next(i for i, b in enumerate(grads.buckets)
                      if gather.buffers[id(b)].data_ptr() == ptr) for ptr in launched]
        assert order == [3, 2, 1, 0]
        o = next(o for q, o in zip(first.params, first.offsets) if q is model[0].weight)
        assert model[0].weight.data_ptr() == gather.buffers[id(first)][o:].data_ptr()


@pytest.mark.parametrize("P,d", [(1e6, 2), (100e6, 8), (1e9, 8), (4e9, 256), (20e9, 1024)])
def test_loom_bucket_rule_is_loom_trains(P, d):
    """The trainer's prediction of a run without --ddp-bucket-size uses loom's own bucket size
    (LOOM_BUCKETS, the torch-free copy of grad_buffer.default_bucket_size's constants); with
    it, that size; loom plan prints the Megatron-Core size its plan timed."""
    from loom.parallel.grad_buffer import default_bucket_size
    from loom.planner.command import bucket_flags
    from loom.planner.layout import LOOM_BUCKETS
    from loom.planner.predict import run_options
    from loom.planner.dp_overlap import bucket_elems
    assert float(bucket_elems(d, Options(**LOOM_BUCKETS), P)) == default_bucket_size(int(P), d)
    cfg = _config(d, 1)
    assert run_options(cfg).ddp_bucket_count == 4
    cfg.parallel.ddp_bucket_size = 12345
    assert float(bucket_elems(d, run_options(cfg), P)) == 12345
    rec = dict(dp=d, cp=1, zero=1)
    assert bucket_flags(rec) == ["--ddp-bucket-size", str(int(max(40e6, 1e6 * d)))]
    assert bucket_flags(dict(rec, zero=3)) == [] and bucket_flags(dict(rec, dp=1)) == []
