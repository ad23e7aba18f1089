"""Never overwrite what a user made; one writer per --save; divergence keeps the past (issue 27,
items 1, 3, 4). Each refusal: the command, its exit status, the one-line message, and every
file byte-identical afterwards (hashed before and after)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from loom.checkpoint.lock import LOCK, SaveLock
from loom.checkpoint.safety import LATEST, prune_checkpoints, resolve_checkpoint
from loom.cli import main
from loom.errors import ConfigError

TRAIN = ["train", "--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size",
         "16", "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1",
         "--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", "1", "--eval-iters",
         "1", "--no-progress-bar"]


def hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def cli(argv, capsys) -> tuple[int, str, str]:
    """``loom ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        with pytest.raises(SystemExit) as e:
            main(argv)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def refused(argv, capsys, root: Path, words: str) -> str:
    """``loom ARGV`` exits 2 with one line holding ``words``, and ``root`` is unchanged."""
    before = hashes(root)
    code, out, err = cli(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and words in lines[0], (code, out, err)
    assert "Traceback" not in err
    assert hashes(root) == before
    return lines[0]


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)


@pytest.fixture
def trained(tmp_path_factory, one_rank, capsys) -> Path:
    """A training checkpoint root: iterations 1 and 2, pointer at 2."""
    ck = tmp_path_factory.mktemp("run") / "ck"
    code, out, err = cli(TRAIN + ["--train-iters", "2", "--save", str(ck), "--save-interval",
                                  "1"], capsys)
    assert code == 0, err
    assert (ck / LATEST).read_text() == "2" and not (ck / LOCK).exists()
    return ck


# ---- item 1: preprocess ------------------------------------------------------------------
def _preprocess(text: Path, prefix: str, *extra) -> list[str]:
    return ["preprocess", "--input", str(text), "--output-prefix", prefix, "--tokenizer-type",
            "ByteLevelBPETrained", "--vocab-size", "280", *extra]


def test_preprocess_refuses_an_existing_dataset_unless_overwrite(tmp_path, one_rank, capsys):
    text = tmp_path / "a.txt"
    text.write_text("\n".join(f"line {i} about {i % 5} things" for i in range(60)))
    prefix = str(tmp_path / "data" / "d")
    assert cli(_preprocess(text, prefix), capsys)[0] == 0
    text.write_text("\n".join(f"other words {i} entirely {i * 7}" for i in range(80)))
    line = refused(_preprocess(text, prefix), capsys, tmp_path / "data",
                   f"--output-prefix {prefix} already holds a dataset")
    assert "--overwrite" in line and f"{prefix}.bin" in line
    before = hashes(tmp_path / "data")
    assert cli(_preprocess(text, prefix, "--overwrite"), capsys)[0] == 0
    assert hashes(tmp_path / "data") != before  # --overwrite replaced it


def test_preprocess_refuses_a_checkpoint_root_even_with_overwrite(tmp_path, trained, capsys):
    text = tmp_path / "a.txt"
    text.write_text("\n".join(f"line {i}" for i in range(40)))
    for prefix in (trained / "data", trained / "iter_0000002" / "data"):
        refused(_preprocess(text, str(prefix), "--overwrite"), capsys, trained,
                f"{trained} is a training checkpoint directory (iterations 1, 2")


# ---- item 1: checkpoint convert ----------------------------------------------------------
def test_convert_refuses_existing_targets_and_checkpoint_roots(tmp_path, trained, capsys):
    hf, imp = tmp_path / "hf", tmp_path / "imported"
    assert cli(["checkpoint", "convert", "--to-hf", str(trained), str(hf)], capsys)[0] == 0
    # --to-hf: a previous export is kept, replaced only with --overwrite
    refused(["checkpoint", "convert", "--to-hf", str(trained), str(hf)], capsys, tmp_path,
            f"--to-hf output {hf} already holds files")
    assert cli(["checkpoint", "convert", "--to-hf", str(trained), str(hf), "--overwrite"],
               capsys)[0] == 0
    # --to-hf into (or inside) a checkpoint root: never, even with --overwrite
    for out in (trained, trained / "hf"):
        refused(["checkpoint", "convert", "--to-hf", str(trained), str(out), "--overwrite"],
                capsys, tmp_path, "is a training checkpoint directory")
    # --from-hf into a training root: the pointer stays at 2, even with --overwrite
    for extra in ([], ["--overwrite"]):
        line = refused(["checkpoint", "convert", "--from-hf", str(hf), str(trained), *extra],
                       capsys, tmp_path, "is a training checkpoint directory (iterations 1, 2")
        assert "even with --overwrite" in line
    assert (trained / LATEST).read_text() == "2" and not (trained / "iter_0000000").exists()
    # --from-hf: an earlier import is kept, and replaced only with --overwrite
    assert cli(["checkpoint", "convert", "--from-hf", str(hf), str(imp)], capsys)[0] == 0
    refused(["checkpoint", "convert", "--from-hf", str(hf), str(imp)], capsys, tmp_path,
            f"--from-hf output {imp} already holds files")
    assert cli(["checkpoint", "convert", "--from-hf", str(hf), str(imp), "--overwrite"],
               capsys)[0] == 0
    assert resolve_checkpoint(str(imp)) == str(imp / "iter_0000000")
    assert sorted(os.listdir(imp)) == ["iter_0000000", LATEST]


# ---- item 1: the final checkpoint is never deleted before its replacement ----------------
def test_restarting_a_finished_run_rewrites_nothing(trained, capsys):
    before = hashes(trained)
    code, out, err = cli(TRAIN + ["--train-iters", "2", "--save", str(trained), "--load",
                                  str(trained)], capsys)
    assert code == 0, err
    assert "already holds iteration 2: not saved again" in out, out
    assert hashes(trained) == before


def test_a_kill_while_replacing_a_checkpoint_leaves_a_loadable_latest(trained, monkeypatch,
                                                                        capsys):
    """Re-save iteration 2 (resume from 1, --overwrite-checkpoints) and die right after the new
    one is swapped in: the pointer names a complete iteration 2 (the new one), and the next
    start removes the old one (left as the partial iter_0000002.tmp)."""
    import loom.checkpoint.io as io
    old = hashes(trained / "iter_0000002")
    real = io._exchange

    def swap_then_die(a, b):
        assert real(a, b)
        raise SystemExit("killed")
    monkeypatch.setattr(io, "_exchange", swap_then_die)
    resume = TRAIN + ["--train-iters", "2", "--save", str(trained), "--load", str(trained),
                      "--override-data-change"]  # --seed 7 below: a different re-save
    code, out, err = cli(resume + ["--ckpt-step", "1", "--overwrite-checkpoints", "--seed", "7"],
                         capsys)
    assert code == "killed"
    assert resolve_checkpoint(str(trained)) == str(trained / "iter_0000002")
    assert hashes(trained / "iter_0000002") != old  # the new checkpoint is in place
    assert hashes(trained / "iter_0000002.tmp") == old  # the old one, not yet removed
    monkeypatch.setattr(io, "_exchange", real)
    code, out, err = cli(resume, capsys)
    assert code == 0 and "removed the partial checkpoint" in out, err
    assert not (trained / "iter_0000002.tmp").exists()


def test_without_an_atomic_swap_the_pointer_moves_away_first(trained, monkeypatch, capsys):
    """Where the filesystem cannot swap two directories, the pointer names another complete
    checkpoint before the old one is deleted: a kill in between leaves a loadable latest."""
    import loom.checkpoint.io as io
    monkeypatch.setattr(io, "_exchange", lambda a, b: False)
    real = io.shutil.rmtree

    def die_on_final(path, *a, **k):
        if str(path).endswith("iter_0000002"):
            raise SystemExit("killed")
        return real(path, *a, **k)
    monkeypatch.setattr(io.shutil, "rmtree", die_on_final)
    code, _, _ = cli(TRAIN + ["--train-iters", "2", "--save", str(trained), "--load",
                              str(trained), "--ckpt-step", "1", "--overwrite-checkpoints"],
                     capsys)
    assert code == "killed"
    assert resolve_checkpoint(str(trained)) == str(trained / "iter_0000001")


# ---- item 3: one writer per --save -------------------------------------------------------
def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    first = SaveLock(str(tmp_path / "ck")).acquire()
    with pytest.raises(ConfigError, match=rf"in use by another loom job \(host "
                                          rf"{socket.gethostname()}, pid {os.getpid()}"):
        SaveLock(str(tmp_path / "ck")).acquire()
    first.release()
    assert not (tmp_path / "ck").exists()  # the lock made it, and it stayed empty
    SaveLock(str(tmp_path / "ck")).acquire().release()


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                       "started": "earlier"}))
    said = []
    lock = SaveLock(str(ck)).acquire(said.append)
    assert len(said) == 1 and "took over" in said[0] and f"pid {dead.pid}" in said[0]
    assert json.loads((ck / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (ck / LOCK).exists()
    (ck / LOCK).write_text(json.dumps({"host": "another-host", "pid": dead.pid,
                                       "started": "earlier"}))
    with pytest.raises(ConfigError, match="host another-host"):  # cannot tell: refused
        SaveLock(str(ck)).acquire()


def test_loom_train_refuses_a_save_directory_in_use(trained, capsys):
    (trained / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                            "started": "now"}))  # this process: alive
    resume = TRAIN + ["--train-iters", "4", "--save", str(trained), "--load", str(trained)]
    line = refused(resume, capsys, trained, f"--save {trained} is in use by another loom job")
    assert f"pid {os.getpid()}" in line
    code, out, err = cli(resume + ["--dry-run"], capsys)  # a dry run never touches the lock
    assert code == 0, err
    (trained / LOCK).unlink()
    code, out, err = cli(resume, capsys)
    assert code == 0 and not (trained / LOCK).exists(), err  # released at exit


# ---- item 4: divergence keeps the past ---------------------------------------------------
def _iters(root: Path, its) -> None:
    for i in its:
        d = root / f"iter_{i:07d}"
        d.mkdir(parents=True)
        (d / "metadata.json").write_text("{}")
        (d / "common.pt").write_bytes(b"")
    (root / LATEST).write_text(str(max(its)))


def test_keep_last_never_prunes_the_last_checkpoint_before_divergence(tmp_path):
    _iters(tmp_path / "a", [1, 2, 3, 4, 5])
    prune_checkpoints(str(tmp_path / "a"), 1, keep_before=3)
    assert sorted(os.listdir(tmp_path / "a")) == ["iter_0000002", "iter_0000005", LATEST]
    _iters(tmp_path / "b", [1, 2, 3, 4, 5])
    prune_checkpoints(str(tmp_path / "b"), 1)
    assert sorted(os.listdir(tmp_path / "b")) == ["iter_0000005", LATEST]


def test_a_non_finite_streak_keeps_and_names_the_last_good_checkpoint(trained, monkeypatch,
                                                                      capsys):
    """Resume at 2; step 3 is fine, steps 4.. have a NaN gradient norm. --keep-last 1 keeps
    iteration 3 beside the newest, and both the log and --exit-on-nonfinite name it."""
    import loom.training.step as step
    real, calls = step.clip_and_norm, []

    def nan_from_the_second_step(*a, **k):
        norm = real(*a, **k)
        calls.append(norm)
        return float("nan") if len(calls) >= 2 else norm
    monkeypatch.setattr(step, "clip_and_norm", nan_from_the_second_step)
    code, out, err = cli(TRAIN + ["--train-iters", "8", "--save", str(trained), "--load",
                                  str(trained), "--save-interval", "1", "--keep-last", "1",
                                  "--exit-on-nonfinite", "3"], capsys)
    good = "the last checkpoint before the first non-finite iteration (4) is iteration 3"
    assert code == 1 and "iterations [4, 5, 6]" in err and good in err, (out, err)
    assert "iteration 4: non-finite gradient norm nan" in out and good in out, out
    assert sorted(os.listdir(trained)) == ["iter_0000003", "iter_0000005", LATEST]
