"""Know what you load (issue 27, item 2): checkpoint files against their checksums
(``manifest.json``), ``metadata.json`` against the directory and DCP's ``.metadata``, a corrupt
``common.pt``; datasets against ``meta.json``'s checksums (an edited ``.bin`` with ids >= V, a
swapped ``.idx``), ``loom data check``; a resume on changed data, ``--split`` or ``--seed``.
Each refusal: exit status 2, one line naming the file, every file byte-identical."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from loom.checkpoint.integrity import MANIFEST, write_manifest
from loom.checkpoint.safety import LATEST
from test_never_overwrite import TRAIN, cli, hashes, one_rank, refused  # noqa: F401

DATA = ["train", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "1", "--lr", "1e-3", "--lr-decay-style",
        "constant", "--log-interval", "1", "--eval-iters", "1", "--no-progress-bar"]


@pytest.fixture
def ckpt(tmp_path, one_rank, capsys) -> Path:
    ck = tmp_path / "ck"
    code, _, err = cli(TRAIN + ["--train-iters", "2", "--save", str(ck), "--save-interval", "1"],
                       capsys)
    assert code == 0, err
    return ck


def _flip(path: Path, start: int = 400, count: int = 400) -> None:
    data = bytearray(path.read_bytes())
    for i in range(start, min(start + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_shard_is_refused_and_inspect_reports_it(ckpt, tmp_path, capsys):
    it2 = ckpt / "iter_0000002"
    manifest = json.loads((it2 / MANIFEST).read_text())["files"]
    assert {".metadata", "__0_0.distcp", "common.pt", "metadata.json"} <= set(manifest)
    shard = it2 / "__0_0.distcp"
    size = shard.stat().st_size
    _flip(shard)
    assert shard.stat().st_size == size  # same size: only the checksum sees it
    line = refused(TRAIN + ["--train-iters", "3", "--load", str(ckpt), "--save",
                            str(tmp_path / "out")], capsys, tmp_path,
                   f"checkpoint file {shard} changed since it was saved")
    assert "--ckpt-step" in line
    before = hashes(tmp_path)
    code, out, err = cli(["checkpoint", "inspect", str(ckpt)], capsys)
    assert code == 1 and f"checksums: CORRUPTED: {shard}" in out and "Traceback" not in err
    assert hashes(tmp_path) == before
    # the previous checkpoint is intact and still loads
    code, out, err = cli(TRAIN + ["--train-iters", "3", "--load", str(ckpt), "--ckpt-step", "1",
                                  "--save", str(tmp_path / "out")], capsys)
    assert code == 0, err


@pytest.mark.parametrize("claim,words", [
    ({"iteration": 7}, "claims iteration 7 but lies in iter_0000002"),
    ({"format": "loom-checkpoint-v9"}, "claims format 'loom-checkpoint-v9'"),
    ({"layout": {"tp": 2, "cp": 1, "dp": 1, "pp": 1}, "world_size": 2}, "claims 2 ranks")])
def test_metadata_json_must_agree_with_the_checkpoint(ckpt, tmp_path, capsys, claim, words):
    meta = ckpt / "iter_0000002" / "metadata.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), **claim}))
    write_manifest(str(meta.parent))  # an edit the checksums would refuse otherwise
    refused(TRAIN + ["--train-iters", "3", "--load", str(ckpt), "--save", str(tmp_path / "o")],
            capsys, tmp_path, words)


def test_a_corrupt_common_pt_is_one_line(ckpt, tmp_path, capsys):
    it2 = ckpt / "iter_0000002"
    (it2 / "common.pt").write_bytes(b"PK\x03\x04" + b"\x00garbage" * 100)
    write_manifest(str(it2))  # a manifest that vouches for it: the reader itself refuses
    refused(TRAIN + ["--train-iters", "3", "--load", str(ckpt), "--save", str(tmp_path / "o")],
            capsys, tmp_path, f"checkpoint file {it2 / 'common.pt'} is unreadable")
    from loom.checkpoint.io import read_common
    from loom.errors import ConfigError
    with pytest.raises(ConfigError, match="common.pt is unreadable"):
        read_common(str(it2))


# ---- datasets ---------------------------------------------------------------------------------
def _dataset(tmp_path: Path, name: str, words: str, capsys) -> str:
    text = tmp_path / f"{name}.txt"
    text.write_text("\n".join(f"{words} {i} and {i % 7} more {words}" for i in range(80)))
    prefix = str(tmp_path / "data" / name)
    code, _, err = cli(["preprocess", "--input", str(text), "--output-prefix", prefix,
                        "--tokenizer-type", "ByteLevelBPETrained", "--vocab-size", "280"], capsys)
    assert code == 0, err
    return prefix


def test_dataset_checksums_out_of_vocab_ids_and_data_check(tmp_path, one_rank, capsys,
                                                           monkeypatch):
    a = _dataset(tmp_path, "a", "alpha", capsys)
    b = _dataset(tmp_path, "b", "beta gamma", capsys)
    meta = json.loads(Path(a + ".meta.json").read_text())
    assert set(meta["files"]) == {".bin", ".idx", ".tokenizer.json"}
    code, out, err = cli(["data", "check", a], capsys)
    assert code == 0 and "checksums: ok" in out and "token ids: ok" in out, (out, err)
    root = tmp_path / "data"
    # ids >= V written into the .bin, meta.json unchanged: refused at any TP size (before any
    # process group: the layout plays no part), and by `loom data check`
    tokens = np.fromfile(a + ".bin", dtype=np.uint16)
    tokens[5] = 60000
    tokens.tofile(a + ".bin")
    for tp in ("1", "2"):
        monkeypatch.setenv("WORLD_SIZE", tp)
        refused(DATA + ["--data-path", a, "--train-iters", "2", "--tensor-model-parallel-size",
                        tp], capsys, root, f"{a}.bin changed since `loom preprocess` wrote it")
    monkeypatch.setenv("WORLD_SIZE", "1")
    Path(a + ".meta.json").write_text(json.dumps({**meta, "files": None}))  # no checksums
    before = hashes(root)  # the scan caches its result in PREFIX.maxid.json, nothing else
    refused(DATA + ["--data-path", a, "--train-iters", "2"], capsys, tmp_path / "a.txt",
            f"token id 60000 in {a}.bin is >= --vocab-size")
    assert {k: v for k, v in hashes(root).items() if "maxid" not in k} == before
    refused(["data", "check", a], capsys, root, "token id 60000 (document 0, position 5)")
    # an .idx swapped for another dataset's: named by its size or checksum
    Path(a + ".meta.json").write_text(json.dumps(meta))
    shutil.copyfile(b + ".idx", a + ".idx")
    refused(DATA + ["--data-path", a, "--train-iters", "2"], capsys, root, f"{a}.idx")


def test_resume_refuses_changed_data_split_and_seed(tmp_path, one_rank, capsys):
    a = _dataset(tmp_path, "a", "alpha", capsys)
    ck = tmp_path / "ck"
    run = DATA + ["--data-path", a, "--save", str(ck), "--load", str(ck)]
    base = run + ["--split", "90,10,0"]
    code, _, err = cli(base + ["--train-iters", "2"], capsys)
    assert code == 0, err
    common = torch.load(ck / "iter_0000002" / "common.pt", weights_only=False)
    assert common["data"]["--data-path"][a]["content"]
    refused(run + ["--split", "50,50,0", "--train-iters", "4"], capsys, tmp_path,
            "--split 90,10,0 in the checkpoint")
    refused(base + ["--train-iters", "4", "--seed", "7"], capsys, tmp_path,
            "--seed 1234 in the checkpoint, 7 here")
    text = tmp_path / "a.txt"
    text.write_text("\n".join(f"other text {i}" for i in range(90)))
    assert cli(["preprocess", "--input", str(text), "--output-prefix", a, "--tokenizer-from", a,
                "--overwrite"], capsys)[0] == 0
    refused(base + ["--train-iters", "4"], capsys, tmp_path,
            f"--data-path {a}: its files changed since the checkpoint was trained on them")
    code, _, err = cli(base + ["--train-iters", "4", "--override-data-change"], capsys)
    assert code == 0, err
    assert (ck / LATEST).read_text().strip() == "4"
