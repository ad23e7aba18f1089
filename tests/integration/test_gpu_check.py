"""``benchmarks/gpu_check.py`` (``make gpu-check``) cannot rot on a machine without a GPU.

- Without CUDA it prints one line and exits 0.
- Its own estimate of its run time on an H100 (steps x the planner's step time + allowances)
  stays within the six minutes of issue 48.
- The whole script runs on CPU on a tiny model (``--device cpu --sizes tiny``: the same code
  as on the GPU, compilation through Dynamo's ``eager`` backend), in a subprocess that cannot
  import the packages the GPU machine lacks (wandb, megatron-core, lm-eval) nor the ones loom
  imports lazily (TensorBoard, tqdm), and so does ``loom train``: both speed parts alternate
  loom and the plain loop, the five planner rows are written with a config that rebuilds the
  same prediction, the table is printed. (PyYAML, which ``loom.config`` imports, is on the GPU
  machine.)
- The micro-batch search, an arm running out of memory, the junit reader and the CUDA tier's
  SDPA-backend reader, on made-up inputs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check as gc

ROOT = Path(__file__).resolve().parents[2]
NOT_ON_THE_GPU_IMAGE = ("wandb", "megatron", "lm_eval")  # /work/.library/device/KINDS.md
LAZY_IN_LOOM = ("tensorboard", "tqdm")
RUN = """
import sys
BLOCKED = set(sys.argv[1].split(","))
for name in BLOCKED:  # as if not installed: import raises, importlib.util.find_spec gives None
    sys.modules[name] = None
from benchmarks import gpu_check
code = gpu_check.main(sys.argv[2:])
from loom.cli import main
try:  # and `loom train` itself, two steps of a tiny model
    main(["train", "--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size",
          "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
          "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "2", "--device", "cpu"])
except SystemExit as e:
    code = code or e.code
print("imported:", sorted(m for m, mod in sys.modules.items()
                          if mod is not None and m.split(".")[0] in BLOCKED))
sys.exit(code)
"""

def test_without_cuda_one_line_and_exit_0(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.main([]) == 0
    assert capsys.readouterr().out == gc.NO_CUDA + "\n"


def test_own_estimate_fits_six_minutes():
    est = gc.estimate()
    assert gc.BUDGET_S == 360 and est["total"] <= gc.BUDGET_S, est
    # at the planner's largest fitting micro-batch (16 when this was written)
    assert est["gpu"] == "H100-80GB" and est["mbs"] in gc.powers_of_two(gc.FULL.mbs_cap)
    parts = ("startup", "tier", "search", "speed", "rows", "attention", "compile")
    assert math.isclose(est["total"], sum(est[k] for k in parts), abs_tol=0.5)
    # steps x the planner's step time are in it: more steps cost more, by about that much
    more = gc.estimate(replace(gc.FULL, steps=gc.FULL.steps + 4))
    step = gc.predict(gc.loom_flags(gc.FULL, est["mbs"], gc.FULL.seq), "H100-80GB")
    extra = 2 * 2 * gc.FULL.rounds * 4 * step["time_s"]["iteration"]  # speed + compile, 2 arms
    assert math.isclose(more["total"] - est["total"], extra, rel_tol=0.05), (more, est)


def test_whole_script_on_cpu_tiny(tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    argv = ["--device", "cpu", "--sizes", "tiny", "--parts", "speed,rows,attention,compile",
            "--compile-backend", "eager", "--results-dir", str(results), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", RUN,
                           ",".join(NOT_ON_THE_GPU_IMAGE + LAZY_IN_LOOM), *argv],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "imported: []" in proc.stdout and "iteration      2 | loss" in proc.stdout
    res = json.loads((results / "gpu_check_h100-80gb_cpu.json").read_text())
    tiny = gc.TINY
    assert res["micro_batch"]["found"] == tiny.mbs_cap  # nothing runs out of memory on CPU
    for part in ("speed", "compile"):
        sp = res[part]
        assert sp["rounds"] == tiny.rounds and not sp["notes"], sp
        for arm in gc.ARMS:
            a = sp[arm]
            assert len(a["step_times_s"]) == tiny.rounds * tiny.steps, a
            assert abs(a["loss_first"] - math.log(tiny.vocab)) < 0.5, a  # random init, uniform
        assert sp["loom_over_plain_tokens_per_s"] > 0
    assert res["compile"]["dynamo"]["unique_graphs"] > 0  # Dynamo traced the layers
    rows = [json.loads(line) for line in
            (results / "gpu_check_h100-80gb_cpu_runs.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == ["b4 s64 none", "b2 s64 none", "b4 s64 selective",
                                         "b4 s64 full", "b2 s128 none"]
    from loom.config import LoomConfig
    from loom.planner.hardware import make_cluster
    from loom.planner.predict import predict_layout
    for r in rows:
        assert r["status"] == "ok" and r["measured"]["step_time_s"] > 0, r
        # the row rebuilds its run: the same layout, the same prediction
        cfg = LoomConfig.from_flat(r["config"]).validate(r["world_size"])
        p = predict_layout(cfg, r["world_size"], cluster=make_cluster(r["gpu"], 1, 1))
        assert p["layout"] == r["layout"] and p["time_s"]["iteration"] == \
            r["predicted"]["step_time_s"], r["name"]
    assert rows[0]["measured"]["step_times_s"] == res["speed"]["loom"]["step_times_s"]
    assert (out / "gpu_check_h100-80gb_cpu.json").exists()
    table = (out / "gpu_check_h100-80gb_cpu.md").read_text()
    assert table in proc.stdout  # the table is printed last
    for words in ("| speed | loom eager b4 |", "| speed | loom / plain --compile |",
                  "| planner | b4 s64 full |", "| anchor | nanochat",
                  "| attention | MATH b1 a2 s128 d16 |"):
        assert words in table, table
    # causal SDPA per backend: CPU runs the default, flash and math kernels, not the CUDA ones
    att = {(r["s"], r["backend"]): r for r in res["attention"]}
    assert len(att) == len(gc_attention_cases())
    for (s, backend), r in att.items():
        cuda_only = backend in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
        assert r["status"].startswith("unavailable") if cuda_only else r["ms"] > 0, r
        assert r["planner_ms"]["causal_skip"] == pytest.approx(r["planner_ms"]["shipped"] / 2)


def gc_attention_cases() -> list:
    from benchmarks.attention_kernels import BACKENDS, TINY_SHAPES
    return [(shape[2], b) for shape in TINY_SHAPES for b in BACKENDS]


def test_micro_batch_search():
    def under(limit):
        return lambda m: m <= limit
    assert gc.search_micro_batch(under(8), 4, 16) == (8, [(4, True), (8, True), (16, False)])
    assert gc.search_micro_batch(under(2), 8, 16) == (2, [(8, False), (4, False), (2, True)])
    assert gc.search_micro_batch(under(64), 16, 16) == (16, [(16, True)])
    assert gc.search_micro_batch(under(0), 2, 16) == (None, [(2, False), (1, False)])


def fake_arm(limit):
    """An arm that runs out of memory above micro-batch ``limit`` and takes 0.1 s a step."""
    def run(accel, flags, warmup, steps, backend="inductor"):
        if flags["micro_batch_size"] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return {"build_s": 0.1, "warmup_step_s": [0.2] * warmup, "step_times_s": [0.1] * steps,
                "loss_first": 6.0, "loss_last": 5.0, "peak_allocated_bytes": None,
                "peak_reserved_bytes": None}
    return run


def broken(accel, flags, warmup, steps, backend="inductor"):
    raise RuntimeError("Expected all tensors to be on the same device")


def test_an_arm_out_of_memory_halves_its_micro_batch(monkeypatch):
    """The plain arm runs out of memory above b = 2: it runs at 2 in both rounds, loom at 8;
    a failure that is not out-of-memory is reported, not retried."""
    fake = fake_arm
    monkeypatch.setattr(gc, "ARMS", {"loom": fake(64), "plain": fake(2)})
    accel, clock = gc.Accel(torch.device("cpu")), gc.Clock(1e9, gc.estimate(gc.TINY))
    sp = gc.speed(accel, gc.TINY, 8, False, "eager", None, clock, "speed")
    assert sp["loom"]["mbs"] == 8 and sp["plain"]["mbs"] == 2, sp
    assert sp["notes"] == ["plain b8: out of memory, halved", "plain b4: out of memory, halved"]
    assert math.isclose(sp["loom_over_plain_tokens_per_s"], 4.0)

    monkeypatch.setattr(gc, "ARMS", {"loom": broken, "plain": fake(64)})
    sp = gc.speed(accel, gc.TINY, 8, False, "eager", None, clock, "speed")
    assert "same device" in sp["loom"]["error"] and "loom_over_plain_tokens_per_s" not in sp
    assert sp["notes"] == ["loom b8: RuntimeError: Expected all tensors to be on the same device"]


def test_same_shape_ratio_from_the_planner_rows():
    res = {"speed": {"loom": {"mbs": 4, "tokens_per_s": 300.0},
                     "plain": {"mbs": 2, "tokens_per_s": 100.0}},
           "rows": [{"name": "b4 s64 none", "measured": {"tokens_per_s": 300.0}},
                    {"name": "b2 s64 none", "measured": {"tokens_per_s": 150.0}}]}
    gc.same_shape_ratio(res, gc.TINY)
    assert res["speed"]["loom_over_plain_same_mbs"] == 1.5
    res["speed"]["plain"]["mbs"] = 4
    del res["speed"]["loom_over_plain_same_mbs"]
    gc.same_shape_ratio(res, gc.TINY)  # same micro-batch: the A B ratio says it all
    assert "loom_over_plain_same_mbs" not in res["speed"]


def test_loom_failing_still_measures_the_plain_loop(tmp_path, monkeypatch, capsys):
    """loom's micro-batch probe fails (not out of memory): the speed part runs at the
    planner's micro-batch, the plain loop is measured and loom's error is in the table."""
    monkeypatch.setattr(gc, "run_loom", broken)
    monkeypatch.setattr(gc, "ARMS", {"loom": broken, "plain": fake_arm(64)})
    assert gc.main(["--device", "cpu", "--sizes", "tiny", "--parts", "speed",
                    "--results-dir", str(tmp_path), "--out", ""]) == 0
    res = json.loads((tmp_path / "gpu_check_h100-80gb_cpu.json").read_text())
    assert "same device" in res["micro_batch"]["error"] and res["micro_batch"]["found"] is None
    assert "same device" in res["speed"]["loom"]["error"]
    assert res["speed"]["plain"]["mbs"] == gc.TINY.mbs_cap
    assert "| speed | loom eager | RuntimeError: Expected all tensors" in capsys.readouterr().out


def test_read_junit(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text("""<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="test_a" name="test_ok" time="1.0"><properties>
<property name="bf16_max_rel_loss_err" value="0.001" /></properties></testcase>
<testcase classname="test_a" name="test_bad" time="1.0"><failure message="AssertionError: 3 &gt; 2">
long text</failure></testcase>
<testcase classname="test_b" name="test_skip" time="0.0"><skipped type="pytest.skip"
message="gloo refuses on CUDA tensors: send_recv: RuntimeError: no" /></testcase>
</testsuite></testsuites>""")
    got = gc.read_junit(str(xml))
    assert got == [
        {"test": "test_ok", "outcome": "passed", "message": "",
         "properties": {"bf16_max_rel_loss_err": "0.001"}},
        {"test": "test_bad", "outcome": "failed", "message": "AssertionError: 3 > 2",
         "properties": {}},
        {"test": "test_skip", "outcome": "skipped",
         "message": "gloo refuses on CUDA tensors: send_recv: RuntimeError: no", "properties": {}}]


def test_tier_command_runs_the_cuda_folder(tmp_path):
    cmd = gc.tier_command(tmp_path / "t.xml")
    assert cmd[:6] == [sys.executable, "-m", "pytest", "-m", "cuda", "tests/cuda"]
    assert f"--junitxml={tmp_path / 't.xml'}" in cmd and gc.PARTS[0] == "tier"


@pytest.fixture
def cuda_numerics():
    sys.path.insert(0, str(ROOT / "tests" / "cuda"))
    try:
        from cpu_twins import twin
        yield twin("cuda", "test_cuda_numerics")
    finally:
        sys.path.remove(str(ROOT / "tests" / "cuda"))


def test_sdpa_backend_reader(cuda_numerics):
    names = ["aten::mm", "aten::_scaled_dot_product_flash_attention",
             "aten::_scaled_dot_product_flash_attention_backward",
             "aten::_scaled_dot_product_attention_math", "flash_fwd_kernel"]
    assert cuda_numerics.sdpa_backends(names) == {"forward": ["flash", "math"],
                                                  "backward": ["flash"]}
    assert cuda_numerics.sdpa_backends(["aten::_scaled_dot_product_cudnn_attention_backward"]) \
        == {"forward": [], "backward": ["cudnn"]}


def test_docs_gpu_table_equals_the_recorded_run():
    """docs/benchmarks.md's H200 row and README's GPU paragraph quote
    benchmarks/results/gpu_check_h200.json (the committed `make gpu-check` run)."""
    res = json.loads((ROOT / "benchmarks/results/gpu_check_h200.json").read_text())
    row = next(line for line in (ROOT / "docs/benchmarks.md").read_text().splitlines()
               if line.startswith("| H200 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    for col, part in ((3, "speed"), (6, "compile")):
        for off, arm in ((0, "loom"), (1, "plain")):
            a = res[part][arm]
            assert cells[col + off] == f"{a['tokens_per_s']:,.0f} ({100 * a['mfu']:.1f}%)", \
                (cells[col + off], part, arm)
        assert cells[col + 2] == f"{res[part]['loom_over_plain_tokens_per_s']:.3f}"
    errs = [r["error_pct"]["step_time"] for r in res["rows"]]
    assert cells[9].startswith(f"{min(errs):.0f}% to {max(errs):+.0f}%"), (cells[9], errs)
    tier = [t["outcome"] for t in res["tier"]["tests"]]
    assert cells[11] == f"{tier.count('passed')} passed, {tier.count('skipped')} skipped", tier
    readme = (ROOT / "README.md").read_text()
    loom = res["speed"]["loom"]
    assert f"{loom['tokens_per_s']:,.0f} tokens/s at {100 * loom['mfu']:.1f}% MFU" in readme
