"""``loom train --dry-run`` without torchrun (issue 15 item 3): the world size from
``--world-size`` or the layout flags, printed once, naming the device it assumed."""

from __future__ import annotations

import pytest

from loom.cli import main

FLAGS = ["train", "--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size",
         "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--lr", "1e-3", "--train-iters", "10", "--tensor-model-parallel-size", "2"]


def run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def test_dry_run_without_torchrun_from_the_layout(capsys):
    code, out = run(FLAGS + ["--dry-run"], capsys)
    assert code == 0, out
    assert out.count("planner prediction on 2 x A100-80GB") == 1
    assert "assumed: no --gpu given" in out


def test_dry_run_world_size_and_gpu(capsys):
    code, out = run(FLAGS + ["--dry-run", "--world-size", "8", "--gpu", "H100-80GB"], capsys)
    assert code == 0 and "planner prediction on 8 x H100-80GB" in out and "assumed" not in out


def test_world_size_needs_dry_run(capsys):
    code, out = run(FLAGS + ["--world-size", "8"], capsys)
    assert code == 2 and "add --dry-run" in out


def test_dry_run_never_touches_the_local_disk(capsys, tmp_path, monkeypatch):
    """Issue 21 item 5: --save names the predicted cluster's storage, not this machine's: no
    free-space check, no write probe, no directory created."""
    import shutil
    import tempfile

    def refuse(*a, **k):
        raise AssertionError("--dry-run touched the local disk")
    monkeypatch.setattr(shutil, "disk_usage", refuse)
    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    save = tmp_path / "not" / "here"
    code, out = run(FLAGS + ["--dry-run", "--world-size", "128", "--save", str(save),
                             "--save-interval", "100"], capsys)
    assert code == 0, out
    assert not (tmp_path / "not").exists()


def test_save_interval_without_save_is_no_saves(capsys):
    code, out = run(FLAGS + ["--dry-run", "--save-interval", "5"], capsys)
    assert code == 0, out


def test_headline_parameter_count_uses_the_padded_vocabulary(capsys):
    """Issue 42: the ``parameters:`` line counts the embedding and output rows the model is
    built with (``--padded-vocab-size``, else V padded to ``--make-vocab-size-divisible-by`` x
    t), as the exact per-rank count and Megatron do (Qwen2.5-7B said 6.89 B for 7.62 B)."""
    import re
    base = FLAGS[:-2]  # one rank: no tensor parallelism
    counts = {}
    for extra in ([], ["--padded-vocab-size", "512"], ["--untie-embeddings-and-output-weights",
                                                       "--padded-vocab-size", "512"]):
        code, out = run(base + extra + ["--dry-run", "--world-size", "1"], capsys)
        assert code == 0, out
        counts[len(extra)] = int(re.search(r"^parameters: (\d+)", out, re.M).group(1))
        exact = re.search(r"rank 0 .*?: ([\d,]+) params", out)
        assert exact and int(exact.group(1).replace(",", "")) == counts[len(extra)], out
    h = 32
    assert counts[2] - counts[0] == (512 - 128) * h  # V = 128 is already a multiple of 128
    assert counts[3] - counts[2] == 512 * h  # the untied output layer, padded too
