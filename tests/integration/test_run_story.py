"""A run tells its story (issue 45, item 3): a resumed run says what it loaded (iteration,
the layout it was saved at and the one it was resharded to, samples consumed, what came back);
the end of a run says what it did (iterations, tokens, wall time, tokens/s and MFU, last losses,
the checkpoint), in text and in ``--log-json``; each record carries the consumed samples and
tokens, and TensorBoard has every scalar against samples too (Megatron's ``... vs samples``);
``loom plot LOG.jsonl`` draws loss, validation loss, lr and throughput into a PNG."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re

import pytest

from loom.cli import main
from loom.training.story import layout_text, resume_line, resume_record, run_summary, \
    summary_line

TRAIN = ["train", "--lr", "3e-4", "--mock-data", "--vocab-size", "100", "--num-layers", "2",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--no-progress-bar",
         "--eval-iters", "1", "--eval-interval", "2", "--log-interval", "1",
         "--train-iters", "4", "--lr-decay-iters", "4", "--peak-tflops", "1"]


def cli(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    assert e.value.code == 0, out.out + out.err
    return out.out


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """Two iterations saved (--exit-interval 2), then a resumed run to iteration 4, both
    logging to one --log-json and one TensorBoard directory."""
    root = tmp_path_factory.mktemp("story")
    logs = ["--save", str(root / "ck"), "--log-json", str(root / "log.jsonl"),
            "--tensorboard-dir", str(root / "tb")]
    out = []
    for extra in (["--exit-interval", "2"], ["--load", str(root / "ck")]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as e:
            main(TRAIN + logs + extra)
        assert e.value.code == 0, buf.getvalue()
        out.append(buf.getvalue())
    records = [json.loads(x) for x in (root / "log.jsonl").read_text().splitlines()]
    return {"root": root, "first": out[0], "second": out[1], "records": records}


def test_resume_line_says_what_was_loaded(resumed_run):
    line = next(x for x in resumed_run["second"].splitlines() if " loaded " in x)
    assert line.endswith("loaded iter_0000002 (saved at TP1 x DP1, the same layout), 8 samples "
                         "consumed, optimizer and RNG restored"), line
    rec = next(r for r in resumed_run["records"] if r["kind"] == "resume")
    assert rec["iteration"] == 2 and rec["consumed_samples"] == 8 and rec["consumed_tokens"] == 128
    assert rec["optimizer"] and rec["rng"] and rec["checkpoint"].endswith("iter_0000002")


def test_summary_says_what_the_run_did(resumed_run):
    first = [r for r in resumed_run["records"] if r["kind"] == "summary"]
    assert [(s["start_iteration"], s["iteration"], s["iterations"]) for s in first] == \
        [(0, 2, 2), (2, 4, 2)]
    s = first[1]
    train = [r for r in resumed_run["records"] if r["kind"] == "train"]
    valid = [r for r in resumed_run["records"] if r["kind"] == "valid"]
    assert s["tokens"] == 2 * 4 * 16 and s["consumed_tokens"] == 4 * 4 * 16
    assert s["loss"] == train[-1]["loss"] and s["valid_loss"] == valid[-1]["valid_loss"]
    assert s["checkpoint"].endswith("ck/iter_0000004") and s["wall_time_s"] > 0
    steps = [r["step_time_s"] for r in train[2:]]
    assert s["tokens_per_s"] == pytest.approx(128 / sum(steps))
    assert s["mfu"] == pytest.approx(s["tflops_per_rank"] / 1.0)  # --peak-tflops 1
    line = resumed_run["second"].rstrip().splitlines()[-1]
    assert re.search(r"summary: 2 iterations \(2 -> 4\) in \d:\d\d:\d\d, 128 tokens \(256 "
                     r"consumed in all\), [\d,]+ tokens/s, MFU [\d.]+% \| loss [\d.]+, "
                     r"validation loss [\d.]+ \| checkpoint .*ck/iter_0000004$", line), line


def test_records_carry_consumed_samples_and_tokens(resumed_run):
    train = [r for r in resumed_run["records"] if r["kind"] == "train"]
    assert [(r["consumed_samples"], r["consumed_tokens"]) for r in train] == \
        [(4 * i, 64 * i) for i in range(1, 5)]  # the resumed run goes on counting
    assert [r["batch_size"] for r in train] == [4] * 4  # Megatron's batch-size scalar
    assert all("consumed_samples" in r for r in resumed_run["records"] if r["kind"] == "valid")
    assert "| consumed samples 12 tokens 192" in resumed_run["second"]


def test_tensorboard_scalars_against_samples(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    steps = {}
    for run in sorted(os.listdir(resumed_run["root"] / "tb")):
        acc = EventAccumulator(str(resumed_run["root"] / "tb" / run))
        acc.Reload()
        for tag in ("train/loss", "train/loss vs samples", "valid/valid_loss vs samples",
                    "train/batch_size"):
            steps.setdefault(tag, []).extend(e.step for e in acc.Scalars(tag))
    if not steps:  # one event file for both runs
        acc = EventAccumulator(str(resumed_run["root"] / "tb"))
        acc.Reload()
        steps = {tag: [e.step for e in acc.Scalars(tag)] for tag in (
            "train/loss", "train/loss vs samples", "valid/valid_loss vs samples",
            "train/batch_size")}
    assert sorted(steps["train/loss"]) == [1, 2, 3, 4]
    assert sorted(steps["train/batch_size"]) == [1, 2, 3, 4]  # --log-batch-size-to-tensorboard
    assert sorted(steps["train/loss vs samples"]) == [4, 8, 12, 16]
    assert sorted(steps["valid/valid_loss vs samples"]) == [8, 16]


def test_plot_writes_a_png_of_both_runs(resumed_run, capsys):
    root = resumed_run["root"]
    out = cli(["plot", str(root / "log.jsonl"), "--x", "tokens"], capsys)
    png = root / "log.png"
    assert out.strip() == f"wrote {png}" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread
    image = imread(str(png))
    assert image.shape[0] > 600 and image.shape[1] > 1000 and image.std() > 0.05  # drawn on


def test_plot_refuses_a_file_without_training_records(tmp_path, capsys):
    (tmp_path / "x.jsonl").write_text('{"kind": "run", "config": {}}\n')
    with pytest.raises(SystemExit) as e:
        main(["plot", str(tmp_path / "x.jsonl")])
    assert e.value.code == 2 and "no training records" in capsys.readouterr().err


def test_resume_line_names_a_resharded_layout_and_what_starts_fresh():
    saved, now = {"tp": 2, "pp": 1, "dp": 1, "cp": 1}, {"tp": 1, "pp": 1, "dp": 2, "cp": 1}
    rec = resume_record("/x/ck/iter_0000100", 100, 800, saved, now, True, False, 16)
    assert resume_line(rec) == ("loaded iter_0000100 (saved at TP2 x DP1, resharded to TP1 x "
                                "DP2), 800 samples consumed, optimizer restored; RNG fresh "
                                "(generators are saved per rank: another layout starts them "
                                "fresh)")
    assert layout_text({"tp": 2, "pp": 4, "dp": 8}) == "TP2 x PP4 x DP8"
    finetune = resume_record("ck/iter_0000005", None, None, now, now, False, False, 16)
    assert resume_line(finetune) == ("loaded iter_0000005 (saved at TP1 x DP2, the same "
                                     "layout), weights only (--finetune: iteration and samples "
                                     "start at 0), optimizer and RNG fresh")


def test_summary_of_a_run_without_steps_or_peak():
    s = run_summary([], [], 7, 7, 28, 16, 1.5, 64, 1e9, 1, None, None)
    assert s["iterations"] == 0 and s["tokens_per_s"] is None and s["mfu"] is None
    assert summary_line(s) == ("summary: 0 iterations (7 -> 7) in 0:00:02, 0 tokens (448 "
                               "consumed in all) | no training step | checkpoint none saved")
