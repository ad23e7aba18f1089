"""The benchmarks keep running as the code under them changes: one step of the reference work
through ``benchmarks/vs_torch_native.py`` on each side (loom and PyTorch-native, 1 rank and the
DP=2 / TP=2 mixes are covered by the benchmark itself) starts from the same weights and data and
reaches the same loss. Catches a benchmark broken by a refactor (it happened: a stale
``GPTModel`` call in ``native_parallel.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

from loom.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import vs_torch_native as bench  # noqa: E402


def test_vs_torch_native_one_step_same_loss():
    layout = bench.LAYOUTS["1"]
    loom = run_distributed(1, bench.run_loom, layout, 1, timeout=600)[0]
    native = run_distributed(1, bench.run_native, layout, 1, timeout=600)[0]
    assert len(loom["losses"]) == len(native["losses"]) == 1
    assert abs(loom["losses"][0] - native["losses"][0]) < 1e-4 * abs(native["losses"][0])


def test_gemm_floor_flops():
    # 1 rank: 2048 tokens x (4 layers x (3h^2 + h^2 + 2hf) + hV) weights x 6 FLOPs
    cfg = bench.reference_config(1, 1, 1, False, 8, "1f1b", 1)
    weights = 4 * (3 * 256 ** 2 + 256 ** 2 + 2 * 256 * 1024) + 256 * 8192
    assert bench.gemm_flops_per_rank(bench.LAYOUTS["1"], cfg) == 6 * 2048 * weights
    # PP=2 x DP=2: the last stage holds 2 layers and the output layer, 1024 tokens per rank
    last = 2 * (3 * 256 ** 2 + 256 ** 2 + 2 * 256 * 1024) + 256 * 8192
    assert bench.gemm_flops_per_rank(bench.LAYOUTS["pp2xdp2"], cfg) == 6 * 1024 * last
    # TP=2 splits every GEMM in two
    assert bench.gemm_flops_per_rank(bench.LAYOUTS["tp2"], cfg) == 6 * 2048 * weights / 2
