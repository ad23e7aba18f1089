"""``loom train --dry-run`` without torchrun (issue 15 item 3): the world size from
``--world-size`` or the layout flags, printed once, naming the device it assumed."""

from __future__ import annotations

import pytest

from loom.cli import main

FLAGS = ["train", "--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size",
         "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--tensor-model-parallel-size", "2"]


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
