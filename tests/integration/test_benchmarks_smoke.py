"""The benchmarks keep running as the code under them changes: one step of the reference work
through ``benchmarks/vs_torch_native.py`` on each side (loom and PyTorch-native, 1 rank and the
DP=2 / TP=2 mixes are covered by the benchmark itself) starts from the same weights and data and
reaches the same loss. Catches a benchmark broken by a refactor (it happened: a stale
``GPTModel`` call in ``native_parallel.py``)."""

from __future__ import annotations

from benchmarks import vs_torch_native as bench
from testkit import run_distributed


def test_vs_torch_native_one_step_same_loss():
    layout = bench.LAYOUTS["1"]
    loom = run_distributed(1, bench.run_loom, layout, 1, timeout=600)[0]
    native = run_distributed(1, bench.run_native, layout, 1, timeout=600)[0]
    assert len(loom["losses"]) == len(native["losses"]) == 1
    assert abs(loom["losses"][0] - native["losses"][0]) < 1e-4 * abs(native["losses"][0])


def test_gemm_floor_flops():
    cfg = bench.reference_config(1, 1, 1, False, 8, "1f1b", 1)
    layer = 3 * 256 ** 2 + 256 ** 2 + 2 * 256 * 1024  # QKV, projection, FC1, FC2
    total = 6 * 2048 * (4 * layer + 256 * 8192)
    assert bench.gemm_flops(bench.LAYOUTS["1"], cfg) == (total, total)
    # PP=2 x DP=2: the last stage holds 2 layers and the output layer, 1024 tokens per rank
    assert bench.gemm_flops(bench.LAYOUTS["pp2xdp2"], cfg) == (6 * 1024 * (2 * layer + 256 * 8192),
                                                               total)
    assert bench.gemm_flops(bench.LAYOUTS["tp2"], cfg) == (total / 2, total)  # t splits GEMMs
    # floor: one rank alone at the rate; DP=4 on 2 cores: all the work on 2 cores
    assert bench.gemm_floor_s(bench.LAYOUTS["1"], cfg, 1e11, 2) == total / 1e11
    assert bench.gemm_floor_s(bench.LAYOUTS["dp4"], cfg, 1e11, 2) == total / 2e11
    # PP=4 on 2 cores: the last stage (1 layer + output, all tokens) alone is longer
    last = 6 * 2048 * (layer + 256 * 8192)
    assert bench.gemm_floor_s(bench.LAYOUTS["pp4-1f1b"], cfg, 1e11, 2) == last / 1e11


def test_dp_bound_alone_runs():
    # the no-communication bound: each of 2 ranks trains its own single-process loom on 4 samples
    from benchmarks import dp_bound
    res = run_distributed(2, dp_bound.run_alone, 2, 1, timeout=600)
    assert [len(r["times"]) for r in res] == [1, 1]
