"""Megatron's restart idiom and checkpoint retention (issue 42, item 4 and
``--save-retain-interval``): every Megatron script passes the same ``--load $CKPT --save
$CKPT`` for the first start and every restart; ``--use-checkpoint-args`` without a checkpoint
falls back to the flags; ``--save-retain-interval`` keeps the checkpoints at its multiples when
``--keep-last`` prunes."""

from __future__ import annotations

import os

import pytest

from loom.checkpoint.safety import LATEST, prune_checkpoints
from test_never_overwrite import TRAIN, _iters, cli, one_rank, refused  # noqa: F401


def test_the_first_start_with_load_equal_to_save_starts_from_scratch(tmp_path, one_rank,
                                                                     capsys):
    ck = tmp_path / "runs" / "ck"  # neither it nor its parent exists yet
    argv = TRAIN + ["--train-iters", "1", "--load", str(ck), "--save", str(ck)]
    for extra in (["--dry-run"], []):
        code, out, err = cli(argv + extra, capsys)
        assert code == 0, err
        said = [x for x in out.splitlines() if str(ck) in x and "holds no checkpoint" in x]
        assert len(said) == 1 and "starting from iteration 0" in said[0], out
        assert not (tmp_path / "runs").exists() or not extra  # a dry run creates nothing
    assert (ck / LATEST).read_text() == "1"
    code, out, err = cli(argv + ["--train-iters", "2", "--use-checkpoint-args"], capsys)
    assert code == 0 and "holds no checkpoint" not in out, err  # the restart resumes
    line = refused(TRAIN + ["--train-iters", "1", "--load", str(tmp_path / "typo"), "--save",
                            str(ck)], capsys, tmp_path, f"--load {tmp_path / 'typo'} does not "
                                                        f"exist")
    assert "same directory as --save" in line, line


def test_use_checkpoint_args_without_a_checkpoint_falls_back_to_the_flags(tmp_path, one_rank,
                                                                          capsys):
    ck = tmp_path / "ck"
    code, out, err = cli(TRAIN + ["--train-iters", "1", "--use-checkpoint-args", "--load",
                                  str(ck), "--save", str(ck)], capsys)
    assert code == 0, err
    assert f"--use-checkpoint-args: --load {ck} holds no checkpoint yet: the model's flags " \
           f"are this command's" in out, out
    refused(TRAIN + ["--train-iters", "1", "--use-checkpoint-args"], capsys, tmp_path,
            "--use-checkpoint-args needs --load or --pretrained-checkpoint")


@pytest.mark.parametrize("keep_last,retain,left", [
    (None, 3, [3, 6, 7]),       # Megatron's: the multiples, and the newest
    (3, 3, [3, 5, 6, 7]),       # with --keep-last: the newest 3 as well
    (2, None, [6, 7])])          # --keep-last alone, as before
def test_save_retain_interval_keeps_its_multiples(tmp_path, keep_last, retain, left):
    _iters(tmp_path, range(1, 8))
    prune_checkpoints(str(tmp_path), keep_last, retain_interval=retain)
    assert sorted(int(n[5:]) for n in os.listdir(tmp_path) if n.startswith("iter_")) == left


def test_save_retain_interval_in_a_run(tmp_path, one_rank, capsys):
    ck = tmp_path / "ck"
    code, out, err = cli(TRAIN + ["--train-iters", "7", "--save", str(ck), "--save-interval",
                                  "1", "--save-retain-interval", "3"], capsys)
    assert code == 0, err
    assert sorted(os.listdir(ck)) == ["iter_0000003", "iter_0000006", "iter_0000007", LATEST]
    refused(TRAIN + ["--train-iters", "4", "--save", str(tmp_path / "o"), "--save-interval",
                     "2", "--save-retain-interval", "3"], capsys, tmp_path,
            "--save-retain-interval 3 is not a multiple of --save-interval 2")
