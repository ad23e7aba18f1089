"""Megatron's --exit-on-missing-checkpoint, --log-progress, --exit-signal (and the refusals of
--no-save-optim / --no-save-rng checkpoints, from a stored config) before anything starts:
the one-line refusals, ``progress.txt``'s lines and its cumulative start (Megatron's
``get_start_time_from_progress_log`` semantics), and the signal ``--exit-signal-handler``
saves on. The runs themselves: tests/integration/test_ckpt_and_log_flags.py."""

from __future__ import annotations

import signal
import time
from datetime import datetime, timedelta
from types import SimpleNamespace

import pytest

from loom.errors import ConfigError
from loom.training.progress_log import ProgressLog, cumulative_start, progress_line
from loom.training.resume import check_saved_states
from loom.training.signals import SignalExit
from testkit.cli import TINY, prepared, refusal

BASE = ["train", *TINY]


def _prepare(argv, monkeypatch):
    return prepared(BASE[1:] + argv, monkeypatch)


def test_exit_on_missing_checkpoint_refuses_what_would_start_fresh(tmp_path, monkeypatch,
                                                                   capsys):
    empty = str(tmp_path / "ck")  # --load = --save, absent: a job that resumes itself
    same = ["--load", empty, "--save", empty]
    assert _prepare(same, monkeypatch).checkpoint.load == empty  # a fresh start without it
    assert "holds no checkpoint yet: starting from iteration 0" in capsys.readouterr().out
    line = refusal(BASE + same + ["--exit-on-missing-checkpoint"], monkeypatch, capsys)
    assert line == (f"loom train: error: --load {empty} holds no checkpoint and "
                    f"--exit-on-missing-checkpoint is given: exiting instead of starting from "
                    f"iteration 0 (check the path, or drop --exit-on-missing-checkpoint to "
                    f"start fresh)")


@pytest.mark.parametrize("argv,words", [
    (["--log-progress"], "--log-progress writes progress.txt into the --save directory, but no "
                         "--save is given: add --save DIR or drop --log-progress"),
    (["--exit-signal", "SIGKILL"], "--exit-signal SIGKILL: SIGKILL never reaches a handler"),
    (["--exit-signal", "SIGSEGV"], "--exit-signal SIGSEGV: SIGSEGV is a hardware-fault signal"),
])
def test_refusals_are_one_line(argv, words, monkeypatch, capsys):
    assert words in refusal(BASE + argv, monkeypatch, capsys)


def test_exit_signal_takes_megatrons_names(monkeypatch):
    cfg = _prepare(["--exit-signal-handler", "--exit-signal", "SIGUSR1"], monkeypatch)
    assert cfg.fault_tolerance.exit_signal == "SIGUSR1"
    assert _prepare([], monkeypatch).fault_tolerance.exit_signal == "SIGTERM"


def _cfg(**ck):
    flags = {"finetune": False, "no_load_optim": False, "no_load_rng": False, **ck}
    return SimpleNamespace(checkpoint=SimpleNamespace(**flags),
                           training=SimpleNamespace(skip_train=False))


def test_a_checkpoint_without_states_needs_the_no_load_flags():
    saved = {"no_save_optim": True, "no_save_rng": True}
    check_saved_states({}, _cfg(), "ck")  # a full checkpoint: nothing to say
    with pytest.raises(ConfigError, match=r"saved with --no-save-optim --no-save-rng and holds "
                                          r"no optimizer and LR-schedule state and no "
                                          r"random-generator state: give --no-load-optim "
                                          r"--no-load-rng"):
        check_saved_states(saved, _cfg(), "ck")
    with pytest.raises(ConfigError, match=r"saved with --no-save-rng and holds no "
                                          r"random-generator state: give --no-load-rng to"):
        check_saved_states(saved, _cfg(no_load_optim=True), "ck")
    check_saved_states(saved, _cfg(no_load_optim=True, no_load_rng=True), "ck")
    check_saved_states(saved, _cfg(finetune=True), "ck")


def _handler_run(sig: signal.Signals, exit_signal: str, graceful: bool = True):
    """Install a SignalExit, raise ``sig`` at this process, restore; (the SignalExit, its
    lines). A fallback handler (not the default: the end of the test process) sees ``sig``
    where the SignalExit did not install one; it fails the test."""
    said: list[str] = []
    fallback = []
    old = signal.signal(sig, lambda *a: fallback.append(a))
    s = SignalExit(0, graceful, said.append, exit_signal=exit_signal)
    s.install()
    try:
        signal.raise_signal(sig)
        time.sleep(0)  # (the Python-level handler runs at the next bytecode)
    finally:
        s.restore()
        signal.signal(sig, old)
    assert not fallback, f"{sig.name} was not handled by loom"
    return s, said


def test_the_handler_saves_on_the_chosen_signal():
    s, said = _handler_run(signal.SIGUSR1, "SIGUSR1")
    assert s.received == signal.SIGUSR1 and not said
    assert s.agreed(lambda v: v) == "SIGUSR1"  # every rank: the trainer saves and exits
    with pytest.raises(SystemExit) as e:  # SIGTERM then ends the rank at once, as Megatron
        _handler_run(signal.SIGTERM, "SIGUSR1")
    assert e.value.code == 128 + signal.SIGTERM
    for default in ("SIGTERM", "SIGINT"):  # loom's behaviour: both save
        s, _ = _handler_run(signal.SIGINT, default)
        assert s.received == signal.SIGINT
    before = signal.getsignal(signal.SIGUSR1)
    s = SignalExit(0, False, exit_signal="SIGUSR1")  # without --exit-signal-handler: untouched
    s.install()
    try:
        assert signal.getsignal(signal.SIGUSR1) is before
    finally:
        s.restore()


def test_progress_line_is_megatrons_format():
    when = datetime(2026, 1, 5, 10, 0, 0)
    assert progress_line("Starting job", 8, when, "123") == \
        "2026-01-05 10:00:00\tJob ID: 123\t# GPUs: 8\tStarting job\n"


def _saved(when, gpus, flops) -> str:
    return progress_line(f"Saved checkpoint\tIteration: 1\tJob throughput: 1.0 TFLOP/s/GPU\t"
                         f"Cumulative throughput: 1.0 TFLOP/s/GPU\tFloating-point operations: "
                         f"{flops:.2e}\tTokens (in billions): 0.00", gpus, when, "")


def test_cumulative_start_is_the_first_job_of_the_latest_world_size():
    t = [datetime(2026, 1, 1) + timedelta(hours=i) for i in range(8)]
    lines = [progress_line("Starting job", 8, t[0], ""), _saved(t[1], 8, 1e18),
             progress_line("Starting job", 16, t[2], ""), _saved(t[3], 16, 2e18),
             progress_line("Starting job", 8, t[4], ""), "garbled line\n",
             _saved(t[5], 8, 3e18), progress_line("Starting job", 8, t[6], "")]
    assert cumulative_start(lines, 8) == (t[4], 2e18)  # after the 16-GPU jobs, with their FLOPs
    assert cumulative_start(lines, 16) is None  # 8-GPU lines came after
    assert cumulative_start(lines[:2], 8) == (t[0], 0.0)


def test_saved_line_counts_this_job_and_the_cumulative_run(tmp_path):
    now = datetime.now()
    (tmp_path / "progress.txt").write_text(
        _saved(now - timedelta(seconds=300), 2, 1e16)
        + progress_line("Starting job", 2, now - timedelta(seconds=200), ""))
    log = ProgressLog(str(tmp_path), 2, 1e15, 1000, started=time.time() - 100)
    log.start(20)  # resumed at 20 samples: 2e16 FLOPs before this job
    text = log.saved(40, 40)
    fields = dict(f.split(": ", 1) for f in text.split("\t")[2:])
    assert text.startswith("Saved checkpoint\tIteration: 40\t")
    assert float(fields["Job throughput"].split()[0]) == pytest.approx(100.0, abs=0.11)
    assert float(fields["Cumulative throughput"].split()[0]) == pytest.approx(75.0, rel=0.01)
    assert fields["Floating-point operations"] == "4.00e+16"
    assert fields["Tokens (in billions)"] == "0.00"
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    assert lines[-2].endswith("\tStarting job") and lines[-1].endswith(text)
    assert ProgressLog(str(tmp_path), 2, 1e15, 1000, enabled=False).saved(41, 41) == ""
    assert len((tmp_path / "progress.txt").read_text().splitlines()) == 4  # nothing written
