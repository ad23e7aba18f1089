"""What several drill files share: one training run on a real (tiny) dataset, made once per
session and copied by each test that damages it (``loom evaluate`` / ``generate`` /
``checkpoint convert`` need its ``tokenizer.json``)."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import pytest

GPT = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
       "--seq-length", "8", "--micro-batch-size", "1", "--lr", "1e-3", "--lr-decay-style",
       "constant", "--log-interval", "1", "--eval-iters", "1", "--no-progress-bar"]


def run_quietly(argv: list[str]) -> tuple[object, str, str]:
    """``loom ARGV`` in this process without pytest's capsys: (exit status, stdout, stderr)."""
    import torch.distributed as dist

    from loom.cli import main
    out, err = io.StringIO(), io.StringIO()
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return code, out.getvalue(), err.getvalue()


def make_dataset(root: Path, name: str, words: str, run=run_quietly, *extra) -> str:
    """``loom preprocess`` of 80 lines of ``words`` into ``root/data/NAME`` (a BPE trained on
    them, or ``extra``'s tokenizer flags); the prefix."""
    text = root / f"{name}.txt"
    text.write_text("\n".join(f"{words} {i} and {i % 7} more {words}" for i in range(80)))
    prefix = str(root / "data" / name)
    tokenizer = list(extra) or ["--tokenizer-type", "ByteLevelBPETrained", "--vocab-size", "280"]
    code, _, err = run(["preprocess", "--input", str(text), "--output-prefix", prefix,
                        *tokenizer])
    assert code == 0, err
    return prefix


@pytest.fixture(scope="session")
def data_run(tmp_path_factory) -> dict:
    """``{"root", "prefix", "ckpt", "text"}``: a dataset, and a run of 4 iterations on it with
    checkpoints at 2 and 4 (pointer 4) and its tokenizer. Copy ``ckpt`` before changing it."""
    root = tmp_path_factory.mktemp("data_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", "1")
        mp.delenv("RANK", raising=False)
        prefix = make_dataset(root, "a", "alpha")
        ck = root / "ck"
        code, _, err = run_quietly(["train", *GPT, "--data-path", prefix, "--train-iters", "4",
                                    "--save", str(ck), "--save-interval", "2"])
        assert code == 0, err
    return {"root": root, "prefix": prefix, "ckpt": ck, "text": root / "a.txt"}


@pytest.fixture
def run_copy(data_run, tmp_path) -> Path:
    """A private copy of ``data_run``'s checkpoint root (iterations 2 and 4), without the holds
    of readers of the shared run (``.loom-read.*``: a reader in a spawned world that a failing
    test killed leaves its hold behind; it is no part of the checkpoints)."""
    dst = tmp_path / "ck"
    shutil.copytree(data_run["ckpt"], dst, ignore=shutil.ignore_patterns(".loom-read.*"))
    return dst
