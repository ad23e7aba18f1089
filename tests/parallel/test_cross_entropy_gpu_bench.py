"""benchmarks/cross_entropy_gpu.py (the H200 numbers behind the fused loss's chunk rule) cannot
rot on a machine without a GPU: ``--device cpu`` runs every arm on a tiny shape, prints one JSON
line with the plain loop, loom's default chunk and each swept chunk in both GEMM modes, and every
arm's loss and gradients agree with the fp32 reference as closely as the plain bf16 loop's."""

from __future__ import annotations

import json

from benchmarks import cross_entropy_gpu as B


def test_every_arm_runs_on_cpu_and_matches_the_reference(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["x", "--device", "cpu", "--shapes", "96x16x200",
                                     "--chunks", "32", "--repeats", "1"])
    B.main()
    res = json.loads(capsys.readouterr().out.strip())
    assert (res["N"], res["h"], res["V"]) == (96, 16, 200)
    default = res["default_chunk"]
    assert set(res["arms"]) == {"plain", f"loom c{default} default", f"loom16 c{default} default",
                                "loom c32", "loom16 c32"}
    plain = res["arms"]["plain"]
    for name, arm in res["arms"].items():
        assert arm["ms"] > 0 and arm["over_plain"] > 0, name
        for k in ("loss_rel_err", "dx_rel_err", "dw_rel_err"):
            assert arm[k] <= max(2 * plain[k], 1e-2), (name, k, arm[k], plain[k])
