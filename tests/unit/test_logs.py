"""Logs that tell the truth (issue 15, item 9): off a terminal each line carries the UTC time,
and each iteration line the elapsed time and the ETA; the pipeline bubble is on the console
line; the full config is the first record of ``--log-json`` (a run header, so two runs
appended to one file are told apart) and TensorBoard text."""

from __future__ import annotations

import json
import re
import sys

import pytest

from loom.cli import main
from loom.training.metrics import MetricsLogger

REC = {"iteration": 5, "loss": 2.5, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 100.0,
       "step_time_s": 2.0, "tflops_per_rank": 0.1, "mfu": None, "peak_memory_bytes": 2**20}
STAMP = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] ")


def test_non_terminal_lines_have_time_elapsed_and_eta(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    log = MetricsLogger(True, total_iters=10, progress_bar=False, start_iteration=0)
    log.start -= 50.0  # 50 s spent on 5 of 10 iterations: 50 s to go
    log.print("hello")
    log.log(REC)
    log.log({"iteration": 5, "valid_loss": 2.0, "valid_ppl": 7.4}, kind="valid")
    lines = capsys.readouterr().out.splitlines()
    assert all(STAMP.match(ln) for ln in lines), lines
    assert lines[1].endswith("| elapsed 0:00:50 | ETA 0:00:50"), lines[1]


def test_terminal_lines_stay_plain(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    log = MetricsLogger(True, total_iters=10, progress_bar=False)
    log.log(REC)
    line = capsys.readouterr().out.rstrip("\n")
    assert line.startswith(" iteration") and "ETA" not in line, line


def test_bubble_on_the_console_line(capsys):
    log = MetricsLogger(True, progress_bar=False, timestamps=False)
    log.log({**REC, "bubble_fraction": 0.125})
    log.log(REC)
    first, second = capsys.readouterr().out.splitlines()
    assert "| bubble 12.5%" in first and "bubble" not in second


BASE = ["train",  # pinned: loom's defaults before Megatron's (issue 21)
         "--lr", "3e-4", "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--log-interval",
         "10", "--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--no-progress-bar", "--eval-iters", "1", "--train-iters", "2"]


def test_json_run_header_and_tensorboard_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    log, tb = tmp_path / "log.jsonl", tmp_path / "tb"
    for lr in ("1e-3", "2e-3"):  # two runs appended to one file
        with pytest.raises(SystemExit) as e:
            main(BASE + ["--lr", lr, "--log-json", str(log), "--tensorboard-dir", str(tb)])
        assert e.value.code == 0
    records = [json.loads(x) for x in log.read_text().splitlines()]
    runs = [i for i, r in enumerate(records) if r["kind"] == "run"]
    assert runs[0] == 0 and len(runs) == 2
    assert [records[i]["config"]["lr"] for i in runs] == [1e-3, 2e-3]
    assert records[0]["config"]["hidden_size"] == 32 and "start_utc" in records[0]
    assert [r["kind"] for r in records[runs[0]:runs[1]]] == ["run", "train", "valid", "summary"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb), size_guidance={"tensors": 0})
    acc.Reload()
    texts = [t.tensor_proto.string_val[0].decode() for tag in acc.Tags()["tensors"]
             if tag.startswith("config") for t in acc.Tensors(tag)]
    assert texts and "hidden_size: 32" in texts[0]
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")  # HPARAMS tab


def test_demo_summary_of_a_short_run_has_real_numbers():
    """`loom demo --train-iters 50` logs one training window: its tokens/s is reported (was 0),
    and the final evaluation gives a validation loss (was null)."""
    from loom.demo import summarize
    records = [{"kind": "run", "config": {}},
               {"kind": "train", "iteration": 50, "loss": 7.76, "tokens_per_s": 1800.0},
               {"kind": "valid", "iteration": 50, "valid_loss": 7.25, "valid_ppl": 1409.5}]
    s = summarize(records, 39.1)
    assert s["tokens_per_s"] == 1800 and s["valid_loss"] == 7.25 and s["iterations"] == 50
