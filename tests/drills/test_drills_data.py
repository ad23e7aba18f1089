"""Resource limits and silently-accepted inputs (issue 27, item 6): each case is the command,
exit status 2, one line naming the flag / file / line, and every file byte-identical."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from loom.training.fault import CheckpointInterval
from test_never_overwrite import TRAIN, cli, hashes, one_rank, refused  # noqa: F401

TOK = ["--tokenizer-type", "ByteLevelBPETrained", "--vocab-size", "280"]


def _pre(inp: Path, prefix: Path, *extra) -> list[str]:
    return ["preprocess", "--input", str(inp), "--output-prefix", str(prefix), *TOK, *extra]


@pytest.mark.parametrize("line,words", [
    ('{"text": 123}', "line 2: 'text' is int, not a string"),
    ('{"text": null}', "line 2: 'text' is null, not a string"),
    ('{"text": ["a", "b"]}', "line 2: 'text' is list, not a string"),
    ('null', "line 2 is a JSON null, not an object"),
    ('[1, 2]', "line 2 is a JSON list, not an object")])
def test_non_string_texts_are_refused_naming_the_line(tmp_path, one_rank, capsys, line, words):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"text": "fine words here"}\n' + line + "\n")
    refused(_pre(inp, tmp_path / "out" / "d"), capsys, tmp_path, words)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_preprocess_limits(tmp_path, one_rank, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    refused(_pre(empty, tmp_path / "o" / "d"), capsys, tmp_path, "no documents")
    huge = tmp_path / "huge.txt"
    huge.write_text("short line\n" + "x" * 5000 + "\nshort again\n")
    refused(_pre(huge, tmp_path / "o" / "d", "--max-document-bytes", "4096"), capsys, tmp_path,
            "line 2 is longer than 4096 bytes (--max-document-bytes)")
    ok = tmp_path / "ok.txt"
    ok.write_text("\n".join(f"words {i} and more {i % 3}" for i in range(60)))
    code, out, err = cli(_pre(ok, tmp_path / "o" / "d", "--workers", "100000"), capsys)
    cores = len(os.sched_getaffinity(0))
    assert code == 0 and f"--workers 100000 capped to {cores}" in err, (out, err)


@pytest.mark.parametrize("extra,words", [
    (["--train-iters", "1e30"], "exceeds 1e+09 iterations")])
def test_silently_accepted_flags_are_refused(tmp_path, one_rank, capsys, extra, words):
    refused(TRAIN + extra, capsys, tmp_path, words)


def test_a_warm_up_longer_than_the_run_trains_a_slice_of_the_schedule(tmp_path, one_rank,
                                                                      capsys):
    """Megatron runs it (its core_v0.13 speed test trains 25 iterations of a 1.5M-iteration
    warm-up); so does loom: the learning rate climbs toward --lr without reaching it."""
    code, out, err = cli(TRAIN + ["--train-iters", "4", "--lr-warmup-iters", "40"], capsys)
    assert code == 0, err
    lrs = [float(w.split()[1]) for ln in out.splitlines() for w in ln.split("|")
           if w.strip().startswith("lr ")]
    assert lrs and lrs == sorted(lrs) and lrs[-1] < 1e-3, out


def test_a_flag_given_twice_is_said(tmp_path, one_rank, capsys):
    code, out, err = cli(TRAIN + ["--train-iters", "3", "--train-iters", "1"], capsys)
    assert code == 0 and "--train-iters given more than once: the last value counts" in out
    assert "starting at iteration 0" in out and "iteration      1" in out


def test_load_of_a_wrong_path_is_refused_not_a_fresh_start(tmp_path, one_rank, capsys):
    data = tmp_path / "datadir"
    data.mkdir()
    (data / "corpus.bin").write_bytes(b"\0" * 8)
    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    for load, words in ((tmp_path / "typo", "does not exist"),
                        (data, "holds no checkpoint (no latest_checkpointed_iteration.txt"),
                        (tmp_path / "loop_a", "a symbolic-link loop")):
        refused(TRAIN + ["--train-iters", "2", "--load", str(load), "--save",
                         str(tmp_path / "ck")], capsys, tmp_path, f"--load {load}")
        assert words
    # the self-resuming pattern (--load = --save, nothing yet) still starts fresh
    code, out, err = cli(TRAIN + ["--train-iters", "1", "--load", str(tmp_path / "ck"),
                                  "--save", str(tmp_path / "ck")], capsys)
    assert code == 0 and "holds no checkpoint yet" in out, err


def test_split_without_validation_and_a_micro_batch_larger_than_the_data(tmp_path, one_rank,
                                                                          capsys):
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"few words {i}" for i in range(30)))
    prefix = tmp_path / "data" / "d"
    assert cli(_pre(text, prefix), capsys)[0] == 0
    base = ["train", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--lr", "1e-3", "--data-path", str(prefix),
            "--train-iters", "2", "--no-progress-bar"]
    refused(base + ["--micro-batch-size", "1", "--split", "100,0,0", "--eval-interval", "1"], capsys, tmp_path,
            "--eval-interval 1 evaluates on validation data but --split 100,0,0 leaves none")
    n = json.loads(Path(f"{prefix}.meta.json").read_text())["num_tokens"] // 8
    refused(base + ["--split", "100,0,0", "--micro-batch-size", "4096",
                    "--global-batch-size", "4096"],
            capsys, tmp_path, "--micro-batch-size 4096 is larger than the training data")
    assert n < 4096


def test_saves_after_a_resume_fall_on_multiples_of_the_interval():
    every = CheckpointInterval(100, None, 0)
    every.saved(550, 1.0, 0.1)  # a resume from an --exit-interval save at 550
    assert [i for i in range(551, 901) if every.due(i, 0.1)] == [600, 700, 800, 900]


@pytest.mark.parametrize("extra,words", [
    (["--gpu-hour-price", "-2"], "--gpu-hour-price -2.0: give a finite number >= 0"),
    (["--train-tokens", "1e300"], "--train-tokens 1e300: more than 1e+18 tokens"),
    (["--mtbf-hours-per-node", "0"], "--mtbf-hours-per-node 0.0: give a positive number")])
def test_plan_refuses_impossible_estimates(tmp_path, capsys, extra, words):
    argv = ["plan", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "128", "--vocab-size", "1000", "--num-gpus", "8"]
    if "--train-tokens" not in extra:
        argv += ["--train-tokens", "1B"]
    refused(argv + extra, capsys, tmp_path, words)


def test_new_flags_default_off():
    """``exit_signal_handler`` (Megatron's default: off) and ``override_data_change``."""
    from loom.config.resilience import CheckpointConfig, FaultToleranceConfig
    assert FaultToleranceConfig().exit_signal_handler is False
    assert CheckpointConfig().override_data_change is False
