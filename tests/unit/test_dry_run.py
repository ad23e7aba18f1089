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
