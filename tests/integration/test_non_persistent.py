"""``--non-persistent-save-interval`` with ``--non-persistent-ckpt-type global``
(loom.training.non_persistent, Megatron's non-persistent global checkpoints): saved between the
regular ones into --save/non_persistent, only the newest kept; a resume takes it when it is
newer than --load's latest; and the refusals."""

from __future__ import annotations

import argparse
import os
import shutil

import pytest

from loom.errors import ConfigError
from loom.paths import saved_iterations
from testkit import run_distributed
from testkit.config import tiny_config

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "6", "--lr", "1e-3", "--lr-decay-iters", "10",
        "--eval-iters", "0",
        "--no-progress-bar", "--mock-data", "--vocab-size", "64", "--save-interval", "4",
        "--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "global"]


def _run(argv):
    from loom.training.cli import add_arguments, prepare
    from loom.training.trainer import Trainer
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    trainer = Trainer(prepare(parser.parse_args(argv)))
    start = trainer.iteration
    trainer.train()
    return start, trainer.loaded_from


def test_saved_between_the_regular_ones_and_resumed_when_newer(tmp_path, capfd):
    save = tmp_path / "ckpt"
    argv = ARGV + ["--save", str(save)]
    assert run_distributed(1, _run, argv, start_method="fork")[0] == (0, None)
    np_dir = save / "non_persistent"
    assert saved_iterations(str(save), complete_only=True) == [4, 6]
    assert saved_iterations(str(np_dir), complete_only=True) == [6]  # 1, 2, 3, 5 pruned
    # the job dies after iteration 6's non-persistent save, before its regular one
    shutil.rmtree(save / "iter_0000006")
    (save / "latest_checkpointed_iteration.txt").write_text("4")
    capfd.readouterr()
    start, loaded = run_distributed(1, _run, argv + ["--load", str(save), "--train-iters", "7"],
                                    start_method="fork")[0]
    assert start == 6 and os.path.dirname(loaded) == str(np_dir)
    assert "resuming the non-persistent checkpoint of iteration 6" in capfd.readouterr().out
    # both hold iteration 7 now (a tie goes to the non-persistent one, as Megatron's >=):
    # --ckpt-step names --load's own
    start, loaded = run_distributed(1, _run, argv + ["--load", str(save), "--train-iters", "8",
                                                     "--ckpt-step", "7"], start_method="fork")[0]
    assert start == 7 and os.path.dirname(loaded) == str(save)
    assert saved_iterations(str(np_dir)) == [7]  # 8 is a regular save: --load's is newer
    start, loaded = run_distributed(1, _run, argv + ["--load", str(save), "--train-iters", "9"],
                                    start_method="fork")[0]
    assert start == 8 and os.path.dirname(loaded) == str(save)


def test_the_newer_of_the_two_is_resumed(tmp_path):
    from loom.training.non_persistent import newer_source
    load, np_dir = tmp_path / "ckpt", tmp_path / "ckpt" / "non_persistent"
    np_dir.mkdir(parents=True)
    (np_dir / "latest_checkpointed_iteration.txt").write_text("5")
    ck = tiny_config("gpt", load=str(load), non_persistent_ckpt_type="global").checkpoint
    assert newer_source(ck) == (str(np_dir), 5, None)  # --load holds none yet
    (load / "latest_checkpointed_iteration.txt").write_text("8")
    assert newer_source(ck) is None  # --load's is newer
    ck.non_persistent_ckpt_type = None
    (load / "latest_checkpointed_iteration.txt").write_text("2")
    assert newer_source(ck) is None  # not asked for


@pytest.mark.parametrize("flat,words", [
    (dict(non_persistent_save_interval=2), "needs --non-persistent-ckpt-type global"),
    (dict(non_persistent_save_interval=2, non_persistent_ckpt_type="global"), "no --save"),
    (dict(non_persistent_ckpt_type="global", save="/tmp/x",
          non_persistent_global_ckpt_dir="/tmp/x"), "is --save itself"),
])
def test_refusals(flat, words):
    with pytest.raises(ConfigError, match=words):
        tiny_config("gpt", **flat).validate(1)
