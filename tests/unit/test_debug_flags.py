"""Megatron's debugging and optimizer flags (issue 42 items 3, 5): declared as real fields with
Megatron's defaults (no longer no-effect switches), refused before launch with one line where
loom cannot honour them, Megatron's underscore spellings of the scheduler flags; the timers'
levels, report layouts and schedule mapping (loom/training/timers.py), one process."""

from __future__ import annotations

import argparse

import pytest

from loom.config import add_config_arguments, config_from_args
from loom.config.flag_kinds import IMPLEMENTED
from loom.config.flag_table import field_of, table
from loom.errors import ConfigError
from loom.training.timers import LEVEL1, LEVEL2, LEVELS, Timers, schedule_timer

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data",
        "--vocab-size", "96", "--train-iters", "4"]
REAL = ("profile", "use_pytorch_profiler", "profile_step_start", "profile_step_end",
        "profile_ranks", "record_memory_history", "memory_snapshot_path", "timing_log_level",
        "timing_log_option", "log_timers_to_tensorboard", "no_barrier_with_level_1_timing",
        "log_memory_to_tensorboard", "deterministic_mode", "optimizer", "sgd_momentum")


def resolve(argv, world=1):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(BASE + argv)).validate(world)


def test_output_flags_are_real_fields_not_switches():
    implemented = {field_of(n, r) for n, r in table().items() if r.kind == IMPLEMENTED}
    assert set(REAL) <= implemented  # rows of the flag table implemented by these fields
    cfg = resolve([])
    lg, t = cfg.logging, cfg.training
    assert (lg.profile, lg.use_pytorch_profiler, lg.profile_step_start, lg.profile_step_end,
            lg.profile_ranks) == (False, False, 10, 12, None)
    assert (lg.timing_log_level, lg.timing_log_option, lg.no_barrier_with_level_1_timing) == \
        (0, "minmax", False)
    assert lg.memory_snapshot_path == "snapshot.pickle"
    assert (t.optimizer, t.sgd_momentum, t.deterministic_mode) == ("adam", 0.9, False)
    cfg = resolve(["--timing-log-level", "2", "--timing-log-option", "all", "--optimizer", "sgd",
                   "--sgd-momentum", "0.5", "--profile", "--profile-ranks", "0", "1"], world=2)
    assert cfg.logging.timing_log_level == 2 and cfg.training.sgd_momentum == 0.5
    assert cfg.logging.profile_ranks == "0 1"


@pytest.mark.parametrize("argv, world, message", [
    (["--optimizer", "adaptive_muon"], 1, "--optimizer adaptive_muon: loom has no adaptive "
                                          "Muon optimizer"),
    (["--optimizer", "lion"], 1, r"use --optimizer adam \(AdamW\), sgd or muon"),
    (["--profile", "--profile-step-start", "5", "--profile-step-end", "5"], 1,
     "--profile-step-end 5 must exceed --profile-step-start 5"),
    (["--profile-ranks", "0", "2"], 2, "'2' is not a global rank of this run"),
    (["--timing-log-level", "3"], 1, "--timing-log-level"),
])
def test_refused_before_launch(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        resolve(argv, world)


def test_deterministic_mode_refuses_a_nondeterministic_environment(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ConfigError, match="CUBLAS_WORKSPACE_CONFIG=:0:0 is not a determin"):
        resolve(["--deterministic-mode"])
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    with pytest.raises(ConfigError, match="NCCL_ALGO=Tree is not reproducible"):
        resolve(["--deterministic-mode"])
    monkeypatch.setenv("NCCL_ALGO", "Ring,CollnetDirect")
    assert resolve(["--deterministic-mode"]).training.deterministic_mode
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    assert not resolve([]).training.deterministic_mode  # only checked when asked for


def test_megatron_underscore_spellings_of_the_scheduler_flags():
    ck = resolve(["--use-checkpoint-opt_param-scheduler"]).checkpoint
    assert ck.use_checkpoint_opt_param_scheduler and not ck.override_opt_param_scheduler
    ck = resolve(["--override-opt_param-scheduler"]).checkpoint
    assert ck.override_opt_param_scheduler
    ck = resolve(["--override-opt_param-scheduler", "--no-override-opt-param-scheduler"])
    assert not ck.checkpoint.override_opt_param_scheduler
    with pytest.raises(ConfigError, match="exclude each other"):
        resolve(["--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler"])


# -- timers ------------------------------------------------------------------------------------

class CountingTimers(Timers):
    """Timers whose device synchronizations are counted (CPU has none to make)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.syncs = 0

    def sync(self):
        self.syncs += 1


def test_levels_gate_the_timers_and_their_synchronization():
    assert set(LEVEL1) | set(LEVEL2) <= set(LEVELS)
    off = CountingTimers(level=0)
    for name in LEVEL1 + LEVEL2:
        with off(name):
            pass
    assert off.syncs == 0 and off.elapsed == {}  # level 0: shared no-op contexts
    assert off("forward-backward") is off("optimizer")
    assert off.interval_names() == []
    one = CountingTimers(level=1)
    for name in LEVEL1 + LEVEL2:
        with one(name):
            pass
    assert set(one.elapsed) == set(LEVEL1) and one.syncs == 2 * len(LEVEL1)
    assert one.interval_names() == list(LEVEL1)
    assert CountingTimers(level=2).interval_names() == list(LEVEL1 + LEVEL2)
    with off("save-checkpoint"):  # level 0 timers are kept at every level
        pass
    assert "save-checkpoint" in off.elapsed


def test_level_two_recorder_feeds_the_schedule_timers():
    from loom.parallel.pipeline.timeline import Timeline
    tl = Timeline(enabled=True)
    assert Timers(level=1).recorder(tl) is tl  # below level 2 the schedule sees the timeline
    timers = Timers(level=2)
    rec = timers.recorder(tl)
    rec.add("F c0 mb0", "forward", 0.0, 2000.0)
    rec.add("send fwd c0 mb0", "send", 0.0, 1000.0, peer=1)
    rec.add("idle (wait bwd c0 mb0)", "idle", 0.0, 3000.0)
    rec.add("W c0 mb0", "backward_weight", 0.0, 500.0)
    assert timers.elapsed == pytest.approx({"forward-compute": 2e-3, "forward-send": 1e-3,
                                            "backward-recv": 3e-3, "backward-compute": 5e-4})
    assert len(tl.events) == 4  # the --timeline trace still gets every span
    assert schedule_timer("recv fwd c1 mb2", "recv") == "forward-recv"
    assert schedule_timer("send bwd c0 mb0", "send") == "backward-send"
    assert schedule_timer("optimizer", "optimizer") is None


@pytest.mark.parametrize("option, head, line", [
    ("minmax", "(min, max) time across ranks (ms):", "    optimizer ..."),
    ("max", "max time across ranks (ms):", "    optimizer ..."),
    ("all", "times across ranks (ms):", "    optimizer: rank 0 "),
])
def test_report_layouts(option, head, line):
    timers = Timers(level=1, option=option)
    timers.add("optimizer", 0.010)  # 10 ms over 4 iterations
    lines, stats = timers.report(["forward-backward", "optimizer"], normalizer=4)
    assert lines[0] == head and lines[1].startswith(line) and len(lines) == 2, lines
    assert stats == {"optimizer": {"min": pytest.approx(2.5), "max": pytest.approx(2.5)}}
    assert timers.elapsed == {}  # reset by the report


def test_sgd_is_torch_sgd_with_megatrons_groups():
    """--optimizer sgd: torch.optim.SGD (fused where supported), --lr, --sgd-momentum, weight
    decay on matrices only (biases and norms undecayed), as Megatron's."""
    import torch

    from loom.training.optimizer import build_optimizer
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    t = resolve(["--optimizer", "sgd", "--sgd-momentum", "0.8", "--weight-decay", "0.1"])
    opt = build_optimizer(model, t.training)
    assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.8
    assert opt.defaults["lr"] == 1e-3 and opt.defaults.get("fused")
    decay = {g["weight_decay"]: len(g["params"]) for g in opt.param_groups}
    assert decay == {0.1: 1, 0.0: 3}  # the weight; bias, norm weight and bias
    assert type(build_optimizer(model, resolve([]).training)) is torch.optim.AdamW
