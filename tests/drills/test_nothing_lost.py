"""Nothing lost: a save that fails names the directory and the OS error and leaves nothing
half-written; leftovers of a crashed save are cleaned at start; the free space of --save is
checked before the first step; good inputs still pass every check (issue 16)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from loom.cli import main

BASE = ["train",  # pinned: loom's defaults before Megatron's (issue 21)
         "--lr", "3e-4", "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--log-interval",
         "10", "--eval-iters", "10", "--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--train-iters", "1", "--no-progress-bar"]
DATA = ["train",  # pinned: loom's defaults before Megatron's (issue 21)
         "--lr", "3e-4", "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--log-interval",
         "10", "--eval-iters", "10", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1"]


def checksums(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_save_dir_free_space_checked(tmp_path, monkeypatch, capsys):
    import shutil as sh
    monkeypatch.setenv("WORLD_SIZE", "1")
    real = sh.disk_usage
    monkeypatch.setattr("loom.checkpoint.safety.shutil.disk_usage",
                        lambda p: real(p)._replace(free=1000))
    with pytest.raises(SystemExit) as e:
        main(BASE + ["--save", str(tmp_path / "ck")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--save" in err and "free" in err, err
    assert not (tmp_path / "ck").exists()


def test_failed_save_names_dir_and_os_error_and_leftovers_are_cleaned(tmp_path, monkeypatch,
                                                                      capsys):
    """A leftover iter_*.tmp is removed at start; a save that hits a full disk (writes to
    /dev/full: the kernel's ENOSPC) names the directory and "No space left on device", removes
    its partial .tmp and leaves the previous checkpoint and the pointer untouched."""
    import loom.checkpoint.io as ckio
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    save = tmp_path / "ck"
    (save / "iter_0000005.tmp").mkdir(parents=True)
    (save / "iter_0000005.tmp" / "model_tp00_pp000.pt").write_bytes(b"half")
    try:
        with pytest.raises(SystemExit) as e:
            main(BASE + ["--save", str(save)])
        assert e.value.code == 0
        assert "removed the partial checkpoint" in capsys.readouterr().out
        assert sorted(os.listdir(save)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
        before = checksums(save)
        real_open = ckio._open_for_write

        def full_disk(path):
            return open("/dev/full", "wb") if "iter_0000002.tmp" in path else real_open(path)
        monkeypatch.setattr(ckio, "_open_for_write", full_disk)
        with pytest.raises(SystemExit) as e:
            main(BASE + ["--load", str(save), "--save", str(save), "--train-iters", "2",
                         "--override-opt-param-scheduler"])
        err = capsys.readouterr().err
        assert e.value.code == 1
        assert str(save) in err and "No space left on device" in err and "Traceback" not in err
        assert checksums(save) == before  # iter 1 and the pointer untouched, no .tmp left
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_good_inputs_still_pass(tmp_path, monkeypatch, capsys):
    """The checks refuse nothing good: preprocess (2 workers) then train on the real dataset
    (meta, tokenizer, .idx/.bin cross-checks), save, resume with the explicit --ckpt-step."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    text = tmp_path / "a.txt"
    text.write_text("".join(f"line {i} of some plain words about {i % 7} things\n"
                            for i in range(200)))
    prefix = str(tmp_path / "ds")
    with pytest.raises(SystemExit) as e:
        main(["preprocess", "--input", str(text), "--output-prefix", prefix, "--tokenizer-type",
              "ByteLevelBPETrained", "--vocab-size", "300", "--append-eod", "--workers", "2"])
    assert e.value.code == 0
    args = DATA + ["--data-path", prefix, "--save", str(tmp_path / "ck"), "--no-progress-bar"]
    try:
        for extra in ([], ["--load", str(tmp_path / "ck"), "--ckpt-step", "1",
                           "--train-iters", "2", "--override-opt-param-scheduler"]):
            with pytest.raises(SystemExit) as e:
                main(args + extra)
            assert e.value.code == 0, capsys.readouterr().err
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_rewind_refused_but_uncommitted_save_replaceable(tmp_path):
    """Resuming from the directory's own pointer may replace an iter_N above it (a save killed
    between its rename and the pointer move); an explicit --ckpt-step below newer checkpoints
    is a rewind and is refused without --overwrite-checkpoints."""
    import json

    from loom.checkpoint.safety import check_save_dir
    from loom.errors import ConfigError
    for it in (10, 15):
        d = tmp_path / f"iter_{it:07d}"
        d.mkdir()
        (d / "metadata.json").write_text(json.dumps({}))
        (d / "common.pt").write_bytes(b"")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    check_save_dir(str(tmp_path), 10, resumed_from_pointer=True)
    with pytest.raises(ConfigError, match="15"):
        check_save_dir(str(tmp_path), 10)
    check_save_dir(str(tmp_path), 10, overwrite=True)
