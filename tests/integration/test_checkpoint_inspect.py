"""``loom checkpoint inspect``: iteration, layout, every tensor under its global shape (sorted by
name, ``layers.2`` before ``layers.10``), totals equal to the trainer's parameter count; a directory without a checkpoint is refused (exit 2)."""

from __future__ import annotations

import json
import re

import pytest

from loom.checkpoint.cli import natural_key
from loom.cli import main

TRAIN = ["train",  # pinned: loom's defaults before Megatron's (issue 21)
         "--lr", "3e-4", "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--log-interval",
         "10", "--eval-iters", "10", "--mock-data", "--vocab-size", "100", "--num-layers", "2",
         "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--train-iters", "3", "--no-progress-bar", "--swiglu", "--num-experts", "4"]


def run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def test_inspect_lists_global_shapes_and_totals(tmp_path, capsys):
    code, out = run(TRAIN + ["--save", str(tmp_path)], capsys)
    assert code == 0, out
    total = int(re.search(r"([\d,]+) parameters", out).group(1).replace(",", ""))
    code, out = run(["checkpoint", "inspect", str(tmp_path), "--json"], capsys)
    assert code == 0, out
    info = json.loads(out)
    assert info["iteration"] == 3 and info["consumed_samples"] == 6
    assert info["total_parameters"] == total
    assert info["parameters"]["layers.1.mlp.experts.3.linear_fc1.weight"]["shape"] == [256, 32]
    names = list(info["parameters"])  # sorted, numbers as numbers
    assert names == sorted(names, key=natural_key) and names[0].startswith("embedding.")
    code, out = run(["checkpoint", "inspect", str(tmp_path)], capsys)
    assert code == 0 and "iteration 3" in out and f"{total:,} parameters" in out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert listed == names


def test_inspect_refuses_an_empty_directory(tmp_path, capsys):
    code, out = run(["checkpoint", "inspect", str(tmp_path)], capsys)
    assert code == 2 and "no checkpoint there" in out
