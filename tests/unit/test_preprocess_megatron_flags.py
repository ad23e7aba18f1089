"""Megatron-LM's ``tools/preprocess_data.py`` command line through ``loom preprocess``: every flag
it took in any release (v2.6, 23.06, core_v0.8.0, core_v0.12.0, core_v0.16.0 and d98e8a6, read
from the mirror this session) is loom's, accepted without effect and named once
(:data:`loom.data.preprocess.MEGATRON_ONLY`), or refused in one line (``--split-sentences``);
the flags without effect change no byte written; and the dataset name Megatron's script writes
(``PREFIX_text_document``) gets a hint at ``loom train`` when loom wrote ``PREFIX``."""

from __future__ import annotations

import argparse
import hashlib
import json

import pytest

from loom.cli import main

# the tools/preprocess_data.py flags of v2.6 .. d98e8a6 (its own groups: the tokenizer flags
# of core_v0.12+ come from Megatron's shared tokenizer arguments, the training table's)
MEGATRON_PREPROCESS = (
    "--input", "--json-keys", "--split-sentences", "--keep-newlines", "--tokenizer-type",
    "--tokenizer-model", "--vocab-file", "--vocab-size", "--merge-file", "--append-eod", "--lang",
    "--output-prefix", "--dataset-impl", "--workers", "--partitions", "--log-interval",
    "--keep-sequential-samples", "--legacy-tokenizer", "--find-optimal-num-workers",
    "--workers-to-check", "--max-documents")


def _run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(["preprocess", *argv]) or 0
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} with words {i % 5}"}) + "\n"
                            for i in range(20)))
    return path


def test_every_megatron_preprocess_flag_is_known():
    from loom.data.preprocess import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert set(MEGATRON_PREPROCESS) <= set(parser._option_string_actions)


def test_flags_without_effect_are_named_once_and_change_no_byte(corpus, tmp_path, capsys):
    base = ["--input", str(corpus), "--tokenizer-type", "ByteLevelBPETrained", "--vocab-size",
            "300", "--append-eod", "--workers", "1"]
    code, _, err = _run(base + ["--output-prefix", str(tmp_path / "plain")], capsys)
    assert code == 0 and "no effect" not in err, err
    megatron = ["--dataset-impl", "mmap", "--partitions", "2", "--keep-sequential-samples",
                "--log-interval", "5", "--legacy-tokenizer", "--lang", "english",
                "--keep-newlines"]
    code, _, err = _run(base + ["--output-prefix", str(tmp_path / "meg")] + megatron, capsys)
    assert code == 0, err
    notes = [ln for ln in err.splitlines() if "no effect" in ln]
    assert len(notes) == 1 and all(w in notes[0] for w in (
        "--dataset-impl mmap", "--partitions 2", "--keep-sequential-samples", "--log-interval 5",
        "--legacy-tokenizer", "--keep-newlines")), notes
    assert "--lang" not in notes[0]  # Megatron's default, english
    for ext in (".bin", ".idx"):
        digest = [hashlib.sha256((tmp_path / f"{n}{ext}").read_bytes()).hexdigest()
                  for n in ("plain", "meg")]
        assert digest[0] == digest[1], ext


def test_split_sentences_is_refused_in_one_line(corpus, tmp_path, capsys):
    code, _, err = _run(["--input", str(corpus), "--output-prefix", str(tmp_path / "s"),
                         "--tokenizer-type", "ByteLevelBPETrained", "--split-sentences"], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "--split-sentences" in lines[0], lines
    assert not list(tmp_path.glob("s.*"))


def test_megatrons_dataset_name_gets_a_hint(corpus, tmp_path, capsys, monkeypatch):
    code, _, err = _run(["--input", str(corpus), "--output-prefix", str(tmp_path / "my-gpt2"),
                         "--tokenizer-type", "ByteLevelBPETrained", "--vocab-size", "300"],
                        capsys)
    assert code == 0, err
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit):
        main(["train", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
              "--seq-length", "8", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters",
              "1", "--dry-run", "--data-path", str(tmp_path / "my-gpt2_text_document")])
    err = capsys.readouterr().err
    assert f"appends _KEY_document: --data-path {tmp_path / 'my-gpt2'}" in err, err
