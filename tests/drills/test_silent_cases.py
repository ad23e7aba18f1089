"""Nothing lost, round 4 (issue 44), the silent cases: each is now refused (exit status 2, one
line, every file byte-identical) or announced in one line."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import GPT, make_dataset
from loom.checkpoint.safety import LATEST
from test_never_overwrite import TRAIN, cli, hashes, one_rank, refused  # noqa: F401

LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--disable-bias-linear"]


def test_keep_last_without_save_is_refused(tmp_path, one_rank, capsys):
    refused(TRAIN + ["--train-iters", "2", "--keep-last", "1"], capsys, tmp_path,
            "--keep-last 1 prunes the checkpoints of --save, but no --save is given")


def test_train_iters_below_the_loaded_iteration_is_refused(data_run, run_copy, one_rank,
                                                           capsys, tmp_path):
    """It did nothing and exited 0."""
    base = ["train", *GPT, "--data-path", data_run["prefix"], "--load", str(run_copy),
            "--save", str(run_copy)]
    line = refused(base + ["--train-iters", "2"], capsys, tmp_path,
                   f"--train-iters 2 is below iteration 4 of the checkpoint "
                   f"{run_copy / 'iter_0000004'}")
    assert "--finetune" in line and "--ckpt-step" in line, line
    code, out, err = cli(base + ["--train-iters", "4"], capsys)  # a finished run: said
    assert code == 0 and "already holds iteration 4: not saved again" in out, err


def test_model_flags_taken_from_the_checkpoint_are_announced(tmp_path, one_rank, capsys):
    """A LLaMA-layout checkpoint resumed with plain GPT flags trained the LLaMA model without
    saying so."""
    ck = tmp_path / "ck"
    code, _, err = cli(TRAIN + LLAMA + ["--train-iters", "1", "--save", str(ck)], capsys)
    assert code == 0, err
    code, out, err = cli(TRAIN + ["--train-iters", "2", "--load", str(ck), "--save", str(ck)],
                         capsys)
    assert code == 0, err
    said = [x for x in out.splitlines() if "not given here are the checkpoint's" in x]
    assert len(said) == 1, out
    for words in ("--normalization RMSNorm", "--swiglu", "--position-embedding-type rope"):
        assert words in said[0], said
    code, out, err = cli(TRAIN + LLAMA + ["--train-iters", "3", "--load", str(ck), "--save",
                                          str(ck)], capsys)
    assert code == 0 and "the checkpoint's" not in out, out  # given: nothing to say


def test_a_checkpoint_of_non_finite_weights_is_refused(tmp_path, one_rank, capsys,
                                                       monkeypatch):
    """Resuming an all-NaN checkpoint trained on NaN, and the log then named it the last good
    checkpoint."""
    import loom.checkpoint.io as ckio
    real = ckio.rank_state_dict

    def nan_weights(*a, **k):
        state = real(*a, **k)
        state["model"] = {n: torch.full_like(t, float("nan")) for n, t in state["model"].items()}
        return state
    ck = tmp_path / "ck"
    code, _, err = cli(TRAIN + ["--train-iters", "1", "--save", str(ck)], capsys)
    assert code == 0, err
    monkeypatch.setattr(ckio, "rank_state_dict", nan_weights)
    code, _, err = cli(TRAIN + ["--train-iters", "2", "--load", str(ck), "--save", str(ck)],
                       capsys)
    assert code == 0, err
    monkeypatch.setattr(ckio, "rank_state_dict", real)
    line = refused(TRAIN + ["--train-iters", "3", "--load", str(ck), "--save", str(ck)], capsys,
                   tmp_path, f"checkpoint {ck / 'iter_0000002'} holds non-finite weights")
    assert "--ckpt-step 1" in line, line  # the one before it
    code, _, err = cli(TRAIN + ["--train-iters", "3", "--load", str(ck), "--save", str(ck),
                                "--ckpt-step", "1", "--overwrite-checkpoints"], capsys)
    assert code == 0, err


def test_a_changed_blend_is_refused_on_resume(tmp_path, one_rank, capsys):
    """Changed blend order or weights were accepted: the sample order changes."""
    def run(argv):
        return cli(argv, capsys)
    a = make_dataset(tmp_path, "a", "alpha", run)
    b = make_dataset(tmp_path, "b", "beta gamma", run, "--tokenizer-from", a)
    ck = tmp_path / "ck"
    base = ["train", *GPT, "--save", str(ck), "--load", str(ck)]
    code, _, err = cli(base + ["--data-path", "0.7", a, "0.3", b, "--train-iters", "2"], capsys)
    assert code == 0, err
    for blend in (["0.3", a, "0.7", b], ["0.3", b, "0.7", a], ["0.7", b, "0.3", a]):
        line = refused(base + ["--data-path", *blend, "--train-iters", "4"], capsys, tmp_path,
                       "--data-path: the blend differs from the checkpoint's")
        assert "--override-data-change" in line, line
    code, _, err = cli(base + ["--data-path", "7", a, "3", b, "--train-iters", "3"], capsys)
    assert code == 0, err  # the same blend, weights written unnormalized


def test_fp16_loss_scale_that_overflows_every_gradient_is_refused(tmp_path, one_rank, capsys):
    """``--fp16 --loss-scale 1e30`` skipped every step and exited 0."""
    line = refused(TRAIN + ["--train-iters", "3", "--fp16", "--loss-scale", "1e30"], capsys,
                   tmp_path, "--loss-scale 1e+30 with --fp16")
    assert "65504" in line, line
