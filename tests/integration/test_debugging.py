"""Artifacts a debugging user asks for, one process each (issue 42 items 3-5, issue 45):

* ``--profile --use-pytorch-profiler`` writes a torch.profiler Chrome trace of iterations
  ``--profile-step-start`` .. ``--profile-step-end`` - 1 to ``torch_profile/`` beside
  ``--tensorboard-dir`` (Megatron's place), or ``./torch_profile`` without one; the test reads it.
* ``--timing-log-level`` 1 and 2 print Megatron's timers of loom's phases at each
  ``--log-interval``, write them to ``--log-json`` and (``--log-timers-to-tensorboard``)
  TensorBoard; level 0 keeps no timer in the step (no synchronization added).
* ``--record-memory-history``, ``--profile`` (nsys) and ``--log-memory-to-tensorboard`` on CPU:
  one line each saying what they need, and no file; on CUDA the snapshot is dumped (skipped
  without CUDA).
* ``--deterministic-mode``: two runs give bitwise-equal losses, with
  ``torch.use_deterministic_algorithms`` on and ``CUBLAS_WORKSPACE_CONFIG`` set.
* Resuming: the schedule (now with ``--weight-decay`` and the resolved warm-up) from the
  checkpoint under ``--use-checkpoint-opt_param-scheduler``, from the flags under
  ``--override-opt_param-scheduler`` (Megatron's spellings), refused without either; a
  checkpoint of another ``--optimizer`` refused unless ``--no-load-optim``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os

import pytest
import torch

from loom.cli import main
from loom.errors import ConfigError

BASE = ["train", "--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size",
        "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--lr", "1e-3", "--no-progress-bar", "--eval-iters", "1", "--hidden-dropout", "0.0",
        "--attention-dropout", "0.0"]


def train(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(BASE + argv)
    out = capsys.readouterr()
    assert e.value.code == 0, out.out + out.err
    return out.out + out.err


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)


def profiled_steps(path) -> set[str]:
    """The ``ProfilerStep#N`` spans of a gzipped Chrome trace (valid JSON, or this raises)."""
    with gzip.open(path, "rt") as fh:
        trace = json.load(fh)
    events = trace["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the step's ops
    return {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}


def test_pytorch_profiler_trace_of_the_asked_iterations(tmp_path, capsys):
    tb = tmp_path / "run" / "tb"
    out = train(["--train-iters", "5", "--profile", "--use-pytorch-profiler",
                 "--profile-step-start", "2", "--profile-step-end", "4", "--tensorboard-dir",
                 str(tb)], capsys)
    trace = tmp_path / "run" / "torch_profile" / "rank-0.json.gz"  # Megatron's tb/../
    assert "wrote torch.profiler traces of iterations 2-3" in out, out
    assert profiled_steps(trace) == {"ProfilerStep#2", "ProfilerStep#3"}
    from loom.training.debug import profile_dir
    assert profile_dir(None) == "torch_profile"  # no --tensorboard-dir: ./torch_profile
    assert profile_dir(str(tb)) == str(tmp_path / "run" / "torch_profile")
    out = train(["--train-iters", "3", "--profile", "--use-pytorch-profiler"], capsys)
    assert "iterations 10-11 are not in this run (iterations 1-3): nothing profiled" in out


def test_timers_per_level_in_the_log_json_and_tensorboard(tmp_path, capsys):
    log, tb = tmp_path / "log.jsonl", tmp_path / "tb"
    out = train(["--train-iters", "4", "--log-interval", "2", "--timing-log-level", "2",
                 "--log-json", str(log), "--tensorboard-dir", str(tb),
                 "--log-timers-to-tensorboard", "--timing-log-option", "max"], capsys)
    assert out.count("max time across ranks (ms):") >= 2, out
    for name in ("forward-backward", "all-grads-sync", "optimizer-inner-step", "optimizer ",
                 "batch-generator", "forward-compute", "backward-compute", "evaluate"):
        assert f"    {name}" in out, (name, out)
    timers = [json.loads(x) for x in log.read_text().splitlines()
              if json.loads(x)["kind"] == "timers"]
    assert [t["iteration"] for t in timers] == [2, 4]
    assert timers[0]["ms"]["forward-backward"]["max"] >= \
        timers[0]["ms"]["forward-compute"]["max"] > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"forward-backward-time", "backward-compute-time", "iteration-time"} <= set(tags)
    assert [e.step for e in acc.Scalars("optimizer-time")] == [2, 4]
    out = train(["--train-iters", "2", "--timing-log-level", "1"], capsys)
    assert "    forward-backward" in out and "forward-compute" not in out


def test_level_zero_adds_no_synchronization_to_a_step(monkeypatch):
    """At level 0 no timer of the step runs (the iteration time is the trainer's own); at
    level 1 each kept timer synchronizes the device at its start and stop, as Megatron's."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.cli import add_arguments, prepare
    from loom.training.timers import Timers
    from loom.training.trainer import Trainer
    counts = {"sync": 0}
    monkeypatch.setattr(Timers, "sync", lambda self: counts.__setitem__("sync",
                                                                        counts["sync"] + 1))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for level, want in (("0", 0), ("1", 2 * 6)):  # fb, grads, embedding, optimizer, clip, step
        counts["sync"] = 0
        cfg = prepare(parser.parse_args(BASE[1:] + ["--train-iters", "2", "--timing-log-level",
                                                    level]))
        tr = Trainer(cfg, mesh=ParallelMesh.single())
        tr.train_step()
        assert counts["sync"] == want, (level, counts)
        assert set(tr.debug.timers.elapsed) == (set() if level == "0" else {
            "forward-backward", "all-grads-sync", "embedding-grads-all-reduce", "optimizer",
            "optimizer-clip-main-grad", "optimizer-inner-step"})


def test_cuda_outputs_on_cpu_say_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = train(["--train-iters", "2", "--device", "cpu", "--record-memory-history",
                 "--memory-snapshot-path", "snap.pickle", "--log-memory-to-tensorboard",
                 "--profile", "--profile-step-start", "0", "--profile-step-end", "1"], capsys)
    assert "--record-memory-history needs CUDA" in out, out
    assert "--profile without --use-pytorch-profiler is Megatron's nsys capture range" in out
    assert "--log-memory-to-tensorboard writes CUDA allocator statistics: none on cpu" in out
    assert "--log-memory-to-tensorboard without --tensorboard-dir: nothing written" in out
    assert not list(tmp_path.glob("snap*")) and not (tmp_path / "torch_profile").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_snapshot_on_cuda(tmp_path, capsys):
    import pickle
    snap = tmp_path / "mem" / "snapshot.pickle"
    out = train(["--train-iters", "2", "--device", "cuda",
                 "--record-memory-history", "--memory-snapshot-path", str(snap),
                 "--log-interval", "1", "--log-memory-to-tensorboard", "--tensorboard-dir",
                 str(tmp_path / "tb")], capsys)
    assert "needs CUDA" not in out
    with open(tmp_path / "mem" / "snapshot_0.pickle", "rb") as fh:
        dump = pickle.load(fh)
    assert dump["segments"] and any(dump["device_traces"])


def test_deterministic_mode_two_runs_bitwise_equal(monkeypatch):
    from loom.parallel.mesh import ParallelMesh
    from loom.training.cli import add_arguments, prepare
    from loom.training.trainer import Trainer
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        runs = []
        for _ in range(2):
            cfg = prepare(parser.parse_args(BASE[1:] + ["--train-iters", "3",
                                                        "--deterministic-mode"]))
            tr = Trainer(cfg, mesh=ParallelMesh.single())
            runs.append([tr.train_step() for _ in range(3)])
            assert torch.are_deterministic_algorithms_enabled()
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert [r["loss"] for r in runs[0]] == [r["loss"] for r in runs[1]]
        assert [r["grad_norm"] for r in runs[0]] == [r["grad_norm"] for r in runs[1]]
    finally:
        torch.use_deterministic_algorithms(was)


# -- resuming: whose schedule ---------------------------------------------------------------------

def prepared(argv: list[str]):
    from loom.training.cli import add_arguments, prepare
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return prepare(parser.parse_args(BASE[1:] + argv))


def test_schedule_from_the_checkpoint_or_the_flags(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    train(["--train-iters", "4", "--weight-decay", "0.1", "--lr-warmup-fraction", "0.5",
           "--save", ck], capsys)
    again = ["--train-iters", "4", "--load", ck, "--save", ck]
    cfg = prepared(again + ["--weight-decay", "0.1", "--lr-warmup-iters", "2"])
    assert cfg.training.lr_warmup_iters == 2  # 0.5 x 4: the same warm-up, no flag needed
    changed = again + ["--train-iters", "6", "--weight-decay", "0.2", "--lr", "5e-4"]
    with pytest.raises(ConfigError) as e:
        prepared(changed)
    for diff in ("--weight-decay 0.1 in the checkpoint, 0.2 here", "--lr 0.001 in the "
                 "checkpoint, 0.0005 here", "--lr-decay-iters 4 in the checkpoint, 6 here"):
        assert diff in str(e.value), str(e.value)
    t = prepared(changed + ["--use-checkpoint-opt_param-scheduler"]).training
    assert (t.weight_decay, t.lr, t.lr_decay_iters, t.lr_warmup_iters, t.train_iters) == \
        (0.1, 1e-3, 4, 2, 6)
    assert t.lr_warmup_fraction is None
    t = prepared(changed + ["--override-opt_param-scheduler"]).training
    assert (t.weight_decay, t.lr, t.lr_decay_iters) == (0.2, 5e-4, None)
    out = train(changed + ["--use-checkpoint-opt_param-scheduler"], capsys)
    assert "iteration      6" in out, out


def test_checkpoint_of_another_optimizer_is_refused(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    train(["--train-iters", "2", "--optimizer", "sgd", "--save", ck], capsys)
    with pytest.raises(ConfigError, match="holds --optimizer sgd states, this run uses "
                                          "--optimizer adam"):
        prepared(["--train-iters", "2", "--load", ck])
    assert prepared(["--train-iters", "2", "--load", ck, "--no-load-optim"])
    out = train(["--train-iters", "3", "--optimizer", "sgd", "--load", ck, "--save", ck,
                 "--override-opt_param-scheduler"], capsys)
    assert "iteration      3" in out, out
