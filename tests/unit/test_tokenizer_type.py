"""``loom train --tokenizer-type`` (Megatron's flag at train time) is checked against the
tokenizer stored with the data: accepted when it agrees, refused naming both when it does not
(issue 15 item 5); the config's choices are preprocess's (and SFTTokenizer)."""

from __future__ import annotations

import typing

import pytest

from loom.cli import main
from loom.config.sections import TokenizerType
from loom.data.tokenizer import TOKENIZER_TYPES

TRAIN = ["train",  # pinned: loom's defaults before Megatron's (issue 21)
         "--lr", "3e-4", "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--log-interval",
         "10", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1",
         "--no-progress-bar", "--split", "100,0,0", "--eval-iters", "1"]


def run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def test_choices_are_preprocess_choices():
    """Plus SFTTokenizer: it tokenizes --sft's conversations as training reads them
    (loom.data.sft), not a `loom preprocess` tokenizer."""
    assert typing.get_args(TokenizerType) == TOKENIZER_TYPES + ("SFTTokenizer",)


def test_train_time_tokenizer_type_checked_against_the_data(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"line {i} of some text about the {i % 7}th thing" for i in range(300)))
    prefix = str(tmp_path / "data")
    code, out = run(["preprocess", "--input", str(text), "--output-prefix", prefix,
                     "--tokenizer-type", "ByteLevelBPETrained", "--vocab-size", "300",
                     "--append-eod"], capsys)
    assert code == 0, out
    code, out = run(TRAIN + ["--data-path", prefix, "--tokenizer-type", "GPT2BPETokenizer"], capsys)
    assert code == 2 and "was tokenized with ByteLevelBPETrained" in out, out
    code, out = run(TRAIN + ["--data-path", prefix, "--tokenizer-type", "ByteLevelBPETrained"],
                    capsys)
    assert code == 0, out


def test_a_data_path_with_the_bin_extension_gets_the_prefix_hint(tmp_path, capsys):
    text = tmp_path / "c.txt"
    text.write_text("\n".join(f"document {i} about things" for i in range(50)))
    prefix = str(tmp_path / "d")
    code, out = run(["preprocess", "--input", str(text), "--output-prefix", prefix,
                     "--tokenizer-type", "ByteLevelBPETrained", "--vocab-size", "280"], capsys)
    assert code == 0, out
    code, out = run(TRAIN + ["--data-path", prefix + ".bin"], capsys)
    assert code == 2 and f"give the prefix without .bin: --data-path {prefix}" in out, out
