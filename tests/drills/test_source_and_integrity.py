"""Nothing lost, round 4 (issue 44), the damage cases: a fine-tune never rewrites the run it
loads; a checkpoint whose manifest was deleted or edited is not trusted, by any reader; the
data identity a checkpoint records is the data the run opened. Each refusal: exit status 2,
one line, every file byte-identical."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import GPT
from loom.checkpoint.integrity import MANIFEST
from loom.checkpoint.safety import LATEST
from test_never_overwrite import cli, hashes, one_rank, refused  # noqa: F401


def _flip(path: Path, start: int, count: int = 400) -> None:
    data = bytearray(path.read_bytes())
    for i in range(start, min(start + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _tensor_offset(it: Path) -> int:
    """Where the word embedding's bytes lie in ``__0_0.distcp`` (a flip there loads silently
    as other weights; a flip in a pickled entry would fail to unpickle)."""
    from torch.distributed.checkpoint import FileSystemReader
    storage = FileSystemReader(str(it)).read_metadata().storage_data
    info = next(v for k, v in storage.items() if k.fqn.startswith("model.embedding.word"))
    return info.offset + info.length // 2


def _readers(data_run, ck: Path, out: Path) -> dict[str, list[str]]:
    """Every command that reads a checkpoint, on ``ck``."""
    return {
        "train": ["train", *GPT, "--data-path", data_run["prefix"], "--train-iters", "6",
                  "--load", str(ck), "--save", str(out / "resumed")],
        "evaluate": ["evaluate", "--load", str(ck), "--task", "perplexity", "--eval-data",
                     str(data_run["text"])],
        "generate": ["generate", "--load", str(ck), "--prompt", "alpha", "--max-new-tokens",
                     "2"],
        "convert": ["checkpoint", "convert", "--to-hf", str(ck), str(out / "hf")]}


# ---- damage 1: a fine-tune never rewrites the run it loads ----------------------------------
def test_finetune_into_the_directory_it_loads_is_refused(data_run, run_copy, one_rank, capsys,
                                                         tmp_path):
    """``--finetune --load X --save X`` on a run holding 2 and 4 started at iteration 0 and
    rewrote iteration 2, moving the pointer 4 -> 2 (with --train-iters 4: replacing the run's
    only copy of iteration 4)."""
    base = ["train", *GPT, "--data-path", data_run["prefix"], "--finetune", "--load",
            str(run_copy)]
    for iters in ("2", "4"):
        line = refused(base + ["--train-iters", iters, "--save", str(run_copy)], capsys,
                       tmp_path, "--finetune starts at iteration 0")
        assert "iterations 2, 4" in line and "--overwrite-checkpoints" in line, line
        assert "fresh --save directory" in line, line
    assert (run_copy / LATEST).read_text() == "4"
    code, out, err = cli(base + ["--train-iters", "1", "--save", str(tmp_path / "tuned")],
                         capsys)  # into a fresh directory: fine
    assert code == 0, err
    assert (tmp_path / "tuned" / LATEST).read_text() == "1"


# ---- damage 2 and 3: integrity that a deleted or edited file cannot switch off --------------
def test_a_checkpoint_without_its_manifest_is_refused_by_every_reader(data_run, run_copy,
                                                                      one_rank, capsys,
                                                                      tmp_path):
    it = run_copy / "iter_0000004"
    shard = it / "__0_0.distcp"
    (it / MANIFEST).unlink()
    _flip(shard, _tensor_offset(it))
    for name, argv in _readers(data_run, run_copy, tmp_path).items():
        line = refused(argv, capsys, tmp_path, f"{it} has no {MANIFEST}")
        assert "--ckpt-step" in line, (name, line)
    before = hashes(tmp_path)
    code, out, err = cli(["checkpoint", "inspect", str(run_copy)], capsys)
    assert code == 1 and f"checksums: MISSING {MANIFEST}" in out, (out, err)
    assert "before loom kept checksums" not in out and "Traceback" not in err
    assert hashes(tmp_path) == before


def test_a_manifest_that_leaves_out_a_file_is_refused(data_run, run_copy, one_rank, capsys,
                                                      tmp_path):
    it = run_copy / "iter_0000004"
    _flip(it / "__0_0.distcp", _tensor_offset(it))
    full = json.loads((it / MANIFEST).read_text())
    edited = {k: v for k, v in full["files"].items() if k != "__0_0.distcp"}
    for manifest, missing in (({"algorithm": "blake2b", "files": edited}, "__0_0.distcp"),
                              ({"algorithm": "blake2b", "files": {}}, ".metadata")):
        (it / MANIFEST).write_text(json.dumps(manifest))
        for name, argv in _readers(data_run, run_copy, tmp_path).items():
            line = refused(argv, capsys, tmp_path, f"{it / MANIFEST} does not list {missing}")
            assert "restore" in line, (name, line)
        code, out, _ = cli(["checkpoint", "inspect", str(run_copy)], capsys)
        assert code == 1 and f"does not list {missing}" in out, out


def test_convert_refuses_flipped_and_truncated_shards(data_run, run_copy, one_rank, capsys,
                                                      tmp_path):
    """``checkpoint convert --to-hf`` exported damaged shards without a word."""
    it = run_copy / "iter_0000004"
    shard = it / "__0_0.distcp"
    good = shard.read_bytes()
    argv = _readers(data_run, run_copy, tmp_path)["convert"]
    _flip(shard, _tensor_offset(it))
    refused(argv, capsys, tmp_path, f"checkpoint file {shard} changed since it was saved")
    shard.write_bytes(good[:-1000])
    refused(argv, capsys, tmp_path, f"checkpoint file {shard} is truncated")
    assert not (tmp_path / "hf").exists()
    shard.write_bytes(good)
    assert cli(argv, capsys)[0] == 0  # the restored shard converts


# ---- damage 4: the data identity is taken when the data is opened ---------------------------
def test_data_replaced_before_the_first_save_is_not_recorded_as_trained_on(tmp_path, one_rank,
                                                                            capsys,
                                                                            monkeypatch):
    """``loom preprocess --overwrite`` of the dataset while the job runs, before its first
    save: the job trains on the files it opened (the old ones), so its checkpoint records
    their identity and says the files changed; the resume on the new files is refused."""
    from conftest import make_dataset
    from loom.data.checks import dataset_identity
    from loom.training.trainer import Trainer
    prefix = make_dataset(tmp_path, "a", "alpha", lambda argv: cli(argv, capsys))
    meta = json.loads(Path(prefix + ".meta.json").read_text())
    opened = {"--data-path": {prefix: dataset_identity(meta)}}
    text = tmp_path / "other.txt"
    text.write_text("\n".join(f"other words {i} entirely {i * 7}" for i in range(90)))
    real_save = Trainer.save

    def save_after_a_rewrite(self, *a, **k):
        if not (tmp_path / "rewritten").exists():
            (tmp_path / "rewritten").touch()
            from loom.cli import main
            with pytest.raises(SystemExit) as e:
                main(["preprocess", "--input", str(text), "--output-prefix", prefix,
                      "--tokenizer-from", prefix, "--overwrite"])
            assert e.value.code == 0
        return real_save(self, *a, **k)
    monkeypatch.setattr(Trainer, "save", save_after_a_rewrite)
    ck = tmp_path / "ck"
    run_argv = ["train", *GPT, "--data-path", prefix, "--save", str(ck), "--load", str(ck)]
    code, out, err = cli(run_argv + ["--train-iters", "2"], capsys)
    assert code == 0, err
    assert f"--data-path {prefix}: its files changed on disk since this run opened them" in out
    common = torch.load(ck / "iter_0000002" / "common.pt", weights_only=False)
    assert common["data"] == opened  # what the run trained on, not the new files
    monkeypatch.setattr(Trainer, "save", real_save)
    refused(run_argv + ["--train-iters", "4"], capsys, tmp_path,
            f"--data-path {prefix}: its files changed since the checkpoint was trained on them")


# ---- every reader checks only the files it reads ---------------------------------------------
def test_a_reader_hashes_the_files_it_reads_and_no_others(data_run, run_copy, monkeypatch):
    """Each file is hashed when loom first reads it, once per process while unchanged: the
    checks before a process group read DCP's ``.metadata`` and ``metadata.json`` (the shards:
    sizes only, and that the manifest lists them); the weights' shard is hashed when they are
    loaded, ``common.pt`` when it is read."""
    import loom.checkpoint.integrity as integrity
    from loom.checkpoint.reader import DcpIndex, read_common
    from loom.checkpoint.safety import check_checkpoint_files
    seen: list[str] = []
    real = integrity.file_digest
    monkeypatch.setattr(integrity, "file_digest", lambda p: seen.append(os.path.basename(p))
                        or real(p))
    it = str(run_copy / "iter_0000002")
    check_checkpoint_files(it)
    assert sorted(seen) == [".metadata", "metadata.json"], seen  # the shards: sizes only
    index = DcpIndex(it)
    assert len(seen) == 2, seen
    index.load(["embedding.word_embeddings.weight"])
    read_common(it)
    assert sorted(seen) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"], seen
    index.load(index.names)
    assert len(seen) == 4, seen  # unchanged files are hashed once per process
