"""Strict loading (issue 15 item 1): a checkpoint loads only into the architecture it was
trained as; every differing flag is named (width and depth alike); only the vocabulary padding
may differ (``--make-vocab-size-divisible-by``), and training flags (dropout) may change.
"""

from __future__ import annotations

import pytest

from loom.cli import main

BASE = ["train",  # pinned: loom's defaults before Megatron's (issue 21)
        "--lr", "3e-4", "--train-iters", "100", "--adam-beta2", "0.95", "--lr-decay-style",
        "cosine", "--eval-iters", "10", "--mock-data", "--vocab-size", "100",
        "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--no-progress-bar",
        "--log-interval", "1"]


def run(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("strict") / "ckpt"
    with pytest.raises(SystemExit) as e:
        main(BASE + ["--num-layers", "3", "--hidden-size", "64", "--train-iters", "1",
                     "--save", str(d)])
    assert e.value.code == 0
    return d


@pytest.mark.parametrize("change,named", [
    (["--num-layers", "3", "--hidden-size", "32"], "--hidden-size 64 in the checkpoint, 32 here"),
    (["--num-layers", "2", "--hidden-size", "64"], "--num-layers 3 in the checkpoint, 2 here"),
    (["--num-layers", "4", "--hidden-size", "64"], "--num-layers 3 in the checkpoint, 4 here"),
    (["--num-layers", "3", "--hidden-size", "64", "--swiglu"], "--swiglu False in the checkpoint"),
])
def test_other_architecture_refused(ckpt, capsys, change, named):
    code, out = run(BASE + change + ["--train-iters", "2", "--load", str(ckpt)], capsys)
    assert code == 2, out
    assert named in out and "Traceback" not in out
    assert len([l for l in out.splitlines() if "error" in l]) == 1, out


def test_same_architecture_other_padding_and_dropout_loads(ckpt, capsys):
    code, out = run(BASE + ["--num-layers", "3", "--hidden-size", "64", "--train-iters", "2",
                            "--load", str(ckpt), "--make-vocab-size-divisible-by", "16",
                            "--hidden-dropout", "0.0", "--override-opt-param-scheduler"], capsys)
    assert code == 0, out
    assert "starting at iteration 1" in out and "iteration      2" in out
