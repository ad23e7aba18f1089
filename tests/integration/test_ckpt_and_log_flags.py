"""Megatron's --no-save-optim, --no-save-rng, --log-progress and
--log-world-size-to-tensorboard in one tiny ``loom train`` run (4 iterations, checkpoints at 2
and 4): the checkpoints hold neither optimizer nor generator states (and still verify against
their manifests); a resume without --no-load-optim / --no-load-rng is refused in one line
naming them, before anything starts; with them it resumes (to 6, a full checkpoint this time);
``progress.txt`` holds Megatron's lines with loom's FLOPs (KOR eq. 7 by hand); TensorBoard has
``world-size`` at every logged iteration of the run that asked for it, and only there. And
``--exit-signal-handler --exit-signal SIGUSR1``: that signal, raised at the start of an
iteration, saves that iteration and exits 0 (tests/drills/test_drills_signals.py sends
SIGTERM from outside)."""

from __future__ import annotations

import contextlib
import io
import re
import signal

import pytest

from loom.checkpoint.io import DcpIndex, read_common
from loom.checkpoint.cli import inspect
from loom.cli import main

L, H, S, V, B = 2, 32, 16, 128, 4  # layers, hidden, sequence, vocabulary (padded: 128), batch
TRAIN = ["train", "--lr", "3e-4", "--mock-data", "--vocab-size", str(V), "--num-layers",
         str(L), "--hidden-size", str(H), "--num-attention-heads", "4", "--seq-length", str(S),
         "--micro-batch-size", "2", "--global-batch-size", str(B), "--no-progress-bar",
         "--eval-iters", "1", "--log-interval", "1", "--lr-decay-style", "constant"]


def _loom(argv) -> tuple[object, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("no_states")
    ck = str(root / "ck")
    first = _loom(TRAIN + ["--train-iters", "4", "--save", ck, "--save-interval", "2",
                           "--no-save-optim", "--no-save-rng", "--log-progress",
                           "--log-world-size-to-tensorboard", "--tensorboard-dir",
                           str(root / "tb1")])
    assert first[0] == 0, first[1][-2000:] + first[2]
    resume = TRAIN + ["--train-iters", "6", "--load", ck, "--save", ck, "--log-progress",
                      "--tensorboard-dir", str(root / "tb2")]
    refused = {what: _loom(resume + extra) for what, extra in
               (("both", []), ("rng", ["--no-load-optim"]))}
    second = _loom(resume + ["--no-load-optim", "--no-load-rng"])
    assert second[0] == 0, second[1][-2000:] + second[2]
    return {"root": root, "ck": root / "ck", "refused": refused, "second": second[1]}


def test_checkpoints_hold_no_optimizer_or_generator_states(runs):
    for it in (2, 4):
        path = str(runs["ck"] / f"iter_{it:07d}")
        index = DcpIndex(path)
        assert index.names and index.optim == {}
        assert not [k for k in index.md if k.startswith("rng.")]
        common = read_common(path)  # verified against manifest.json
        assert common["scheduler"] is None
        assert common["config"]["no_save_optim"] and common["config"]["no_save_rng"]
        info = inspect(path)
        assert info["integrity"].startswith("ok") and "--no-load-optim" in info["optimizer"]
    full = str(runs["ck"] / "iter_0000006")  # the resumed run saved without the flags
    index = DcpIndex(full)
    assert set(index.optim) == set(index.names)
    assert "rng.00000" in index.md and read_common(full)["scheduler"] is not None


def test_a_resume_without_the_no_load_flags_is_refused_in_one_line(runs):
    ckpt = runs["ck"] / "iter_0000004"
    for what, (code, out, err) in runs["refused"].items():
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1, err
        want = ("--no-save-optim --no-save-rng and holds no optimizer and LR-schedule state "
                "and no random-generator state: give --no-load-optim --no-load-rng"
                if what == "both" else "--no-save-rng and holds no random-generator state: "
                                       "give --no-load-rng")
        assert lines[0] == f"loom train: error: --load: the checkpoint {ckpt} was saved with " \
                           f"{want} to resume its weights and iteration without them, or " \
                           f"--finetune (its weights only, from iteration 0)", lines[0]
        assert " loaded " not in out  # nothing was built


def test_with_them_it_resumes_fresh_states(runs):
    assert re.search(r"loaded iter_0000004 .*, 16 samples consumed, optimizer and RNG fresh",
                     runs["second"]), runs["second"][-2000:]
    assert (runs["ck"] / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


def test_progress_txt_has_megatrons_lines(runs):
    lines = (runs["ck"] / "progress.txt").read_text().splitlines()
    head = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\tJob ID: [^\t]*\t# GPUs: 1\t"
    assert [bool(re.fullmatch(head + "Starting job", x)) for x in lines] == \
        [True, False, False, True, False]
    per_iter = 72 * B * S * L * H ** 2 * (1 + S / (6 * H) + V / (12 * H * L))  # KOR eq. 7
    for line, it in zip((lines[1], lines[2], lines[4]), (2, 4, 6)):
        m = re.fullmatch(head + r"Saved checkpoint\tIteration: (\d+)\tJob throughput: "
                         r"([\d.]+) TFLOP/s/GPU\tCumulative throughput: ([\d.]+) TFLOP/s/GPU\t"
                         r"Floating-point operations: (\S+)\tTokens \(in billions\): (\S+)", line)
        assert m, line
        assert int(m.group(1)) == it and m.group(4) == f"{it * per_iter:.2e}", line
        assert m.group(5) == f"{it * B * S / 1e9:.2f}"


def test_world_size_scalar_in_tensorboard(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars(name):
        acc = EventAccumulator(str(runs["root"] / name))
        acc.Reload()
        tags = acc.Tags()["scalars"]
        return tags, {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags
                      if t.startswith("world-size")}
    tags, ws = scalars("tb1")
    assert ws["world-size"] == [(i, 1.0) for i in (1, 2, 3, 4)]
    assert ws["world-size vs samples"] == [(B * i, 1.0) for i in (1, 2, 3, 4)]
    tags2, ws2 = scalars("tb2")  # the resumed run did not ask for it
    assert "train/loss" in tags2 and not ws2


def test_exit_signal_saves_and_exits_on_the_chosen_signal(tmp_path, monkeypatch):
    from loom.training.fault import FaultTolerance
    before = FaultTolerance.before_iteration

    def raise_at_3(self, iteration):
        if iteration == 3:
            signal.raise_signal(signal.SIGUSR1)  # as a scheduler's warning would arrive
        before(self, iteration)

    monkeypatch.setattr(FaultTolerance, "before_iteration", raise_at_3)
    caught = []  # were loom's handler not installed, this one (not the default: the end of
    old = signal.signal(signal.SIGUSR1, lambda *a: caught.append(a))  # the worker) sees it
    try:
        code, out, err = _loom(TRAIN + ["--train-iters", "50", "--save", str(tmp_path / "ck"),
                                        "--exit-signal-handler", "--exit-signal", "SIGUSR1"])
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert code == 0 and not caught, out[-2000:] + err
    assert "SIGUSR1 received (--exit-signal-handler): exiting after iteration 3" in out, out
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
