"""The held-out DGX Cloud source (benchmarks/planner_sources/dgxc.py, issue 47): NeMo 24.09 /
24.11 step seconds on 8-2,304 H100 at each recipe's layout, in no fit set. What is asserted is
what the source shows (docs/planner.md, "DGX Cloud"), so that a model change that moves it fails
here:

* the weak-scaling trend of every recipe (step seconds on the most GPUs over the fewest) is
  reproduced within 5% (issue 47 item 3's question, on a source of today's software);
* every full-depth row fits in 80 GB at its published settings (Nemotron-4 340B on 128 GPUs
  once its recipe's bf16 optimizer states are priced, as the precision-aware optimizer's);
* the error splits by attention kernel: the flash-attn rows are within 6% as shipped; the cuDNN
  rows are 8-26% too slow, and within 9% once the kernel skips the causal half
  (``Options.causal_skip``, ``loom plan --attention cudnn``, off by default; its rate is the
  H200 profile's cuDNN kernel time within 5%);
* the search with nothing fixed covers every published layout, and finds it within 10% of its
  best (issue 47 item 2);
* three of its rows calibrate the rest to <= 5% median (the 3-shot protocol).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.planner_sources import dgxc
from loom.planner.constants import FIT_SETS, SHIPPED, fitted_cluster
from loom.planner.layout import Options, make_layouts
from loom.planner.presets import PRESETS
from loom.planner.timing import layer_times


@pytest.fixture(scope="module")
def rows():
    return dgxc.table()


def test_source_is_held_out_and_rows_are_the_readmes():
    assert all(dgxc.SOURCE not in srcs for srcs in FIT_SETS.values())
    assert len(dgxc.ROWS) == 35 and set(r[0] for r in dgxc.ROWS) == set(dgxc.RECIPES)
    # weak scaling: the same per-GPU work on every full-depth row of a recipe
    for name, r in dgxc.RECIPES.items():
        per_replica = {B * r.tp * (p or r.pp) * r.cp // n
                       for nm, n, B, _, layers, p in dgxc.ROWS if nm == name and layers is None}
        assert len(per_replica) == 1, name


def test_weak_scaling_trend_is_reproduced_within_5_percent():
    tr = dgxc.trends()
    assert set(tr) == set(dgxc.RECIPES)
    for name, t in tr.items():
        assert t["published"] > 1.0, name  # every recipe slows down with the GPU count
        assert abs(t["error"]) <= 0.05, (name, t)


def test_published_settings_fit(rows):
    over = [(r["recipe"], r["gpus"]) for r in rows if not r["fits"]]
    assert over == [], over
    r340 = next(r for r in rows if r["recipe"] == "nemotron4-340b" and r["gpus"] == 128)
    assert 70 < r340["memory_gb"] < 80  # its bf16 optimizer states priced (91.5 GB as fp32)
    r405 = next(r for r in rows if r["recipe"] == "llama3.1-405b" and r["gpus"] == 576)
    assert r405["fits"] and r405["memory_gb"] < 80  # Llama 3.1 405B at TP8 PP9 CP2 VP7


def test_error_splits_by_attention_kernel(rows):
    s = dgxc.summary(rows)
    assert s["flash-attn"]["shipped"]["worst"] <= 0.06, s
    cudnn = [r for r in rows if r["cudnn_attention"]]
    assert all(r["error"] > 0.07 for r in cudnn)  # every cuDNN row predicted too slow
    assert s["cuDNN attention"]["shipped"]["median"] >= 0.10, s
    assert s["cuDNN attention"]["causal_skip"]["median"] <= 0.03, s
    assert s["cuDNN attention"]["causal_skip"]["worst"] <= 0.09, s
    assert statistics.median(abs(r["error"]) for r in rows) == pytest.approx(
        s["all"]["shipped"]["median"], abs=1e-4)


def test_causal_skip_halves_the_fused_attention_only():
    cl = fitted_cluster("H100-80GB", 8)
    L = make_layouts(dict(tp=1, pp=1, cp=1, dp=1, mbs=1, recompute="none", sp=0))
    gpt = PRESETS["llama3-8b"]()
    base = layer_times(gpt, 8192, L, cl, Options(flash_attention=True))
    skip = layer_times(gpt, 8192, L, cl, Options(flash_attention=True, causal_skip=True))
    assert float(skip["attn"][0]) == pytest.approx(float(base["attn"][0]) / 2)
    assert np.allclose(skip["gemm"], base["gemm"]) and np.allclose(skip["elem"], base["elem"])
    unfused = Options(flash_attention=False)
    assert float(layer_times(gpt, 8192, L, cl, replace(unfused, causal_skip=True))["attn"][0]) \
        == pytest.approx(float(layer_times(gpt, 8192, L, cl, unfused)["attn"][0]))


def test_published_layouts_are_near_the_search_s_best():
    """Issue 47 item 2: the default search (nothing fixed, the recipe's software) covers every
    published layout, and each is within 10% of the search's best in the model (the 340B on 128
    GPUs only once its bf16 optimizer states are priced: with fp32 states it fitted only with
    full recompute, +28%)."""
    got = dgxc.published_rank()
    for name, r in got.items():
        assert r["rank"] is not None, (name, r)
        assert r["published_recompute"] == "none" and 0 <= r["over_best"] <= 0.10, (name, r)


def test_grok1_moe_row():
    """The one held-out MoE row (Grok-1 on 512 H100, 15.933 s): +22% at its recipe's software,
    the compute term alone as long as the published step; loom's all-gather dispatcher and the
    default imbalance are slower (docs/planner.md, MoE)."""
    r = dgxc.grok1_record()
    err = r["iteration_time_s"] / dgxc.GROK1["published_s"] - 1
    assert 0.15 <= err <= 0.30 and r["fits"], err
    assert r["time_terms_s"]["compute"] == pytest.approx(dgxc.GROK1["published_s"], rel=0.05)
    assert dgxc.grok1_record(dispatcher="allgather")["iteration_time_s"] > 1.2 * r[
        "iteration_time_s"]
    assert dgxc.grok1_record(capacity=None)["iteration_time_s"] > r["iteration_time_s"]


def test_three_rows_calibrate_the_rest():
    from benchmarks.planner_sources.three_shot import calibrate_source
    r = calibrate_source(dgxc.SOURCE, SHIPPED)
    assert r["before"]["median"] > 0.10 and r["after"]["median"] <= 0.05, r
    assert "hopper_gemm_efficiency" in r["params"]


def test_the_cudnn_rate_is_the_h200_profile_s_cudnn_kernel_time():
    """``loom plan --attention cudnn`` (``Options.causal_skip``) against a measurement the
    planner was not fitted on: torch.profiler's cuDNN attention kernels in loom's b 8, s 2048
    step on an H200 (benchmarks/results/gpu_profile_h200.json, 16 layers, 16 heads of d 128:
    ``aten::_cudnn_attention_forward`` 4.37 ms + ``_backward`` 15.69 ms). The causal-half rate
    is within 5% of them; every block at the fused rate (``fused``, the default) is 94% slow."""
    import json
    from pathlib import Path
    from benchmarks.attention_kernels import planner_ms
    prof = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results" /
                       "gpu_profile_h200.json").read_text())
    ops = {r["op"]: r["device_s_per_step"] for r in prof["profile"]["loom"]["top_device"]}
    measured = 1e3 * (ops["aten::_cudnn_attention_forward"] +
                      ops["aten::_cudnn_attention_backward"])
    sz = prof["sizes"]
    layers = sz["num_layers"]
    shape = (8, sz["heads"], sz["seq"], sz["hidden_size"] // sz["heads"])  # the b 8 row
    plan = {k: layers * v for k, v in planner_ms(shape, "H200").items()}
    assert plan["causal_skip"] == pytest.approx(measured, rel=0.05), (plan, measured)
    assert plan["shipped"] > 1.8 * measured


def test_plan_takes_the_cudnn_rate(capsys):
    from loom.cli import main
    argv = ["plan", "llama3-8b", "--gpu", "H100-80GB", "--num-gpus", "8", "--seq-length", "8192",
            "--global-batch-size", "64", "--top", "1", "--json"]
    out = {}
    for kernel in ("fused", "cudnn"):
        with pytest.raises(SystemExit) as e:
            main(argv + ["--attention", kernel])
        assert not e.value.code
        out[kernel] = json.loads(capsys.readouterr().out)
    fused, cudnn = (out[k]["layouts"][0]["time_terms_s"]["compute"] for k in ("fused", "cudnn"))
    assert cudnn < fused
