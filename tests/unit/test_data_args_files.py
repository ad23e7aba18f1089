"""``--data-args-path`` and ``--per-split-data-args-path`` (Megatron's
``get_blend_and_blend_per_split``): the data paths read from a file, through ``loom train
--dry-run`` as Megatron's command line gives them, and the refusals."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from loom.cli import main
from loom.config.script_flags import read_data_args
from loom.errors import ConfigError
from testkit.config import tiny_config


def _data(**flat):
    return tiny_config("gpt", mock_data=False, **flat).data


def test_the_files_words_become_the_data_paths(tmp_path):
    blend = tmp_path / "blend.txt"
    blend.write_text("0.3 /data/a_text_document\n  0.7\t/data/b_text_document\n")
    d = _data(data_args_path=str(blend))
    read_data_args(d)
    assert d.data_path == "0.3 /data/a_text_document 0.7 /data/b_text_document"
    read_data_args(d)  # idempotent: validation reads it again
    assert d.data_path == "0.3 /data/a_text_document 0.7 /data/b_text_document"
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": ["1", "/d/train"], "valid": "/d/valid",
                                 "test": []}))
    d = _data(per_split_data_args_path=str(split))
    read_data_args(d)
    assert (d.train_data_path, d.valid_data_path, d.test_data_path) == \
        ("1 /d/train", "/d/valid", None)


@pytest.mark.parametrize("content,flat,words", [
    (None, {}, "cannot read it"),
    ("", {}, "the file is empty"),
    ("/d/x", {"data_path": "/d/y"}, "--data-args-path and --data-path both"),
])
def test_data_args_refusals(tmp_path, content, flat, words):
    path = tmp_path / "args.txt"
    if content is not None:
        path.write_text(content)
    d = _data(data_args_path=str(path), **flat)
    with pytest.raises(ConfigError, match=words):
        read_data_args(d)


@pytest.mark.parametrize("content,flat,words", [
    ("{not json", {}, "not JSON"),
    (json.dumps({"train": "/a", "valid": "/b"}), {}, "no 'test' key"),
    (json.dumps({"train": "/a", "valid": "/b", "test": "/c"}), {"valid_data_path": "/z"},
     "--valid-data-path both"),
])
def test_per_split_refusals(tmp_path, content, flat, words):
    path = tmp_path / "split.json"
    path.write_text(content)
    d = _data(per_split_data_args_path=str(path), **flat)
    with pytest.raises(ConfigError, match=words):
        read_data_args(d)


def test_dry_run_reads_the_file_as_megatron_does(tmp_path):
    """A Megatron command line with --data-args-path: the dry run reads the blend from the file
    (a missing dataset is refused naming the prefix the file gave)."""
    blend = tmp_path / "blend.txt"
    blend.write_text(f"0.5 {tmp_path}/missing_a 0.5 {tmp_path}/missing_b")
    err = io.StringIO()
    argv = ["train", "--dry-run", "--world-size", "1", "--num-layers", "2", "--hidden-size",
            "32", "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings",
            "16", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
            "--vocab-size", "64", "--data-args-path", str(blend)]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(SystemExit) as e:
            main(argv)
    assert e.value.code == 2 and "missing_a" in err.getvalue(), err.getvalue()
