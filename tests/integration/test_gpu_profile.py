"""``benchmarks/gpu_profile.py`` (where the GPU rows disagree) cannot rot without a GPU: its
allocator-trace replay on made-up traces, and the whole script on CPU at the tiny size (the
profile part; the memory part needs CUDA's allocator and is skipped there)."""

from __future__ import annotations

import json

from benchmarks import gpu_profile as gp

LOOM = "/x/loom/models/mlp.py"


def _ev(action, addr, size, file=LOOM, line=1):
    return {"action": action, "addr": addr, "size": size,
            "frames": [{"filename": "/torch/nn/functional.py", "line": 9, "name": "linear"},
                       {"filename": file, "line": line, "name": "forward"}]}


def test_live_at_peak_groups_what_is_alive_at_the_peak():
    trace = [_ev("alloc", 1, 100, line=1), _ev("alloc", 2, 50, line=2),
             _ev("free_requested", 1, 100), _ev("free_completed", 1, 100),
             _ev("alloc", 3, 30, line=3), _ev("alloc", 4, 200, line=1),  # peak: 50 + 30 + 200
             _ev("free_requested", 4, 200), _ev("alloc", 5, 10, file="/elsewhere/x.py")]
    got = gp.live_at_peak(trace)
    assert got["peak_bytes_in_step"] == 280 and got["peak_event"] == 5
    assert got["groups"] == [{"where": "loom/models/mlp.py:1 forward", "bytes": 200, "count": 1},
                             {"where": "loom/models/mlp.py:2 forward", "bytes": 50, "count": 1},
                             {"where": "loom/models/mlp.py:3 forward", "bytes": 30, "count": 1}]
    # a frame outside loom is named by the innermost frame; none at all by "?"
    assert gp.where([{"filename": "/a/b.py", "line": 3, "name": "f"}]) == "/a/b.py:3 f"
    assert gp.where([]) == "?"
    # a free of an address allocated before the trace began changes nothing
    assert gp.live_at_peak([_ev("free_requested", 9, 70), _ev("alloc", 1, 5)])[
        "peak_bytes_in_step"] == 5


def test_profile_on_cpu_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert gp.main(["--device", "cpu", "--sizes", "tiny", "--steps", "1", "--out",
                    str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gpu_profile_cpu.json").read_text())
    for arm in ("loom", "plain"):
        prof = res["profile"][arm]
        assert prof["wall_s_per_step"] > 0 and prof["top_device"], prof
        assert any(r["op"] == "aten::mm" for r in prof["top_device"]), prof["top_device"][:5]
    assert res["memory"] == []  # no CUDA allocator
