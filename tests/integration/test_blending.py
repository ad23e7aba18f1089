"""Megatron users' scripts (issue 15, item 5): blended data, separate train/valid/test sets,
``--train-samples``, ``--lr-warmup-fraction``, ``--recompute-activations``, ``--skip-train``,
``--eval-interval`` with a final evaluation.

Blends: each dataset's share of 10k samples within 1% of its weight; the same samples in the
same order after a restart (a fresh dataset read from the middle) and at any data-parallel
size (the union of the DP ranks' micro-batches, and the training losses at DP=1 and DP=2).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from loom.cli import main
from loom.config import ConfigError, DataConfig, LoomConfig, ModelConfig
from loom.data.blended import BlendedDataset, blend_order, build_datasets, parse_blend
from loom.data.sampler import get_batch, microbatch_indices
from loom.parallel.mesh import ParallelMesh
from testkit import run_distributed
from testkit.config import PRE_ISSUE_21, tiny_config
from testkit.data import write_dataset
from loom.training.optimizer import lr_at

SEQ = 8
# token ranges tell the datasets apart: dataset i holds ids in [1 + 30 i, 30 + 30 i]
RANGES = {"a": (1, 30), "b": (31, 60), "c": (61, 90)}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("blend")
    return {k: write_dataset(root / k, lo, hi, seed=i) for i, (k, (lo, hi)) in enumerate(RANGES.items())}


def _source(sample: dict) -> str:
    lo = int(sample["tokens"].min())
    return next(k for k, (a, b) in RANGES.items() if a <= lo <= b)


@pytest.mark.parametrize("weights", [(0.3, 0.7), (0.2, 0.5, 0.3), (1.0, 3.0)])
def test_blend_shares_within_one_percent_over_10k_samples(data, weights):
    names = list(RANGES)[:len(weights)]
    text = " ".join(f"{w} {data[n]}" for w, n in zip(weights, names))
    train, _, _ = build_datasets(DataConfig(data_path=text, split="100,0,0"), SEQ, 1234)
    assert isinstance(train, BlendedDataset)
    counts = {n: 0 for n in names}
    for k in range(10_000):
        counts[_source(train[k])] += 1
    total = sum(weights)
    for n, w in zip(names, weights):
        assert abs(counts[n] / 10_000 - w / total) < 0.01, (counts, weights)


def test_blend_order_prefix_counts_within_one_sample():
    d, j = blend_order([0.25, 0.6, 0.15], 5000)
    for n in (1, 7, 100, 999, 5000):
        counts = np.bincount(d[:n], minlength=3)
        assert np.all(np.abs(counts - np.array([0.25, 0.6, 0.15]) * n) <= 1.0), (n, counts)
    for ds in range(3):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert np.array_equal(j[d == ds], np.arange((d == ds).sum()))


def test_blend_same_order_after_restart_and_at_any_dp_size(data):
    cfg = DataConfig(data_path=f"0.3 {data['a']} 0.7 {data['b']}", split="90,10,0")
    first, _, _ = build_datasets(cfg, SEQ, 7)
    ref = [first[k]["tokens"] for k in range(6000)]
    restarted, _, _ = build_datasets(cfg, SEQ, 7)  # a new process, reading from the middle
    for k in (5999, 4096, 5000, 17):
        assert torch.equal(restarted[k]["tokens"], ref[k])
    b, gbs = 2, 16
    for dp in (1, 2, 4):
        ds, _, _ = build_datasets(cfg, SEQ, 7)
        m = gbs // (b * dp)
        for it in (0, 3, 200):
            per_rank = [get_batch(ds, [i for mb in microbatch_indices(it * gbs, b, m, r, dp)
                                       for i in mb])["tokens"] for r in range(dp)]
            got = sorted(tuple(t.tolist()) for x in per_rank for t in x)
            want = sorted(tuple(t.tolist()) for t in ref[it * gbs:(it + 1) * gbs])
            assert got == want, (dp, it)


def test_blend_validation_is_blend_of_each_split(data):
    cfg = DataConfig(data_path=f"1 {data['a']} 1 {data['b']}", split="50,50,0")
    train, valid, test = build_datasets(cfg, SEQ, 1)
    assert test is None and isinstance(valid, BlendedDataset)
    assert {_source(valid[k]) for k in range(50)} == {"a", "b"}
    sep = DataConfig(train_data_path=data["a"], valid_data_path=f"0.5 {data['b']} 0.5 {data['c']}",
                     test_data_path=data["c"])
    train, valid, test = build_datasets(sep, SEQ, 1)
    assert {_source(train[k]) for k in range(50)} == {"a"}
    assert {_source(valid[k]) for k in range(50)} == {"b", "c"}
    assert {_source(test[k]) for k in range(50)} == {"c"}


@pytest.mark.parametrize("text,words", [
    ("0.3 A 0.7", "a weight before every prefix"),
    ("0.3 A B 0.7", "a weight before every prefix"),
    ("A 0.3 B", "mix of weights and prefixes"),
    ("-1 A 2 B", ">= 0"),
    ("0 A 0 B", "positive sum"),
])
def test_blend_refusals_name_the_flag(text, words):
    with pytest.raises(ConfigError) as e:
        parse_blend(text, "--data-path")
    assert "--data-path" in str(e.value) and words in str(e.value)


def test_unweighted_prefixes_weigh_by_size(data):
    blend = parse_blend(f"{data['a']} {data['b']}")
    assert [w for w, _ in blend] == [None, None]
    train, _, _ = build_datasets(DataConfig(data_path=f"{data['a']} {data['b']}",
                                            split="1,0,0"), SEQ, 1)
    sizes = [len(d) for d in train.datasets]
    assert train.weights == pytest.approx([s / sum(sizes) for s in sizes])


def _cfg(data_path: str, iters: int) -> LoomConfig:
    return tiny_config("gpt", PRE_ISSUE_21, seq_length=SEQ, mock_data=False, data_path=data_path,
                       split="90,10,0", global_batch_size=4, train_iters=iters,
                       lr_decay_iters=4,  # one LR schedule
                       log_interval=1, eval_iters=1, no_progress_bar=True)


def _losses(cfg: LoomConfig, world: int, load: str | None = None, save: str | None = None):
    from loom.training.trainer import Trainer
    cfg = copy.deepcopy(cfg)
    cfg.checkpoint.load, cfg.checkpoint.save = load, save
    cfg = cfg.validate(world)
    tr = Trainer(cfg, mesh=ParallelMesh.single() if world == 1 else None)
    return [r["loss"] for r in tr.train()]


def test_blended_training_resumes_exactly_and_matches_dp2(data, tmp_path, capsys):
    blend = f"0.3 {data['a']} 0.7 {data['b']}"
    straight = _losses(_cfg(blend, 4), 1)
    out = capsys.readouterr().out
    assert "train data blend: 30.0% " in out and "70.0% " in out  # each share at start
    half = _losses(_cfg(blend, 2), 1, save=str(tmp_path / "ck"))
    rest = _losses(_cfg(blend, 4), 1, load=str(tmp_path / "ck"))
    assert half + rest == pytest.approx(straight, rel=1e-6)
    dp2 = run_distributed(2, _losses, _cfg(blend, 4), 2)
    assert dp2[0] == pytest.approx(straight, rel=1e-4)


def test_train_samples_warmup_fraction_recompute_activations():
    cfg = LoomConfig(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                       seq_length=256, vocab_size=100))
    cfg.training.global_batch_size, cfg.training.micro_batch_size = 8, 2
    cfg.training.lr = 3e-4  # loom's default before issue 21
    cfg.training.train_samples = 100
    cfg.training.lr_warmup_fraction = 0.25
    cfg.training.recompute_activations = True
    cfg = cfg.validate(1)
    assert cfg.training.train_iters == 12  # 100 // 8, Megatron's rounding
    assert cfg.training.recompute_granularity == "selective"
    t = cfg.training
    assert lr_at(0, t) == pytest.approx(t.lr / 3) and lr_at(2, t) == pytest.approx(t.lr)
    cfg.training.lr_warmup_iters = 2
    with pytest.raises(ConfigError, match="--lr-warmup-iters"):
        cfg.validate(1)


BASE = ["train",  # pinned: loom's defaults before Megatron's (issue 21)
         "--lr", "3e-4", "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--log-interval",
         "10", "--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--no-progress-bar", "--eval-iters", "1"]


@pytest.mark.parametrize("extra,words", [
    (["--train-iters", "3", "--train-samples", "8"], ["--train-iters", "--train-samples"]),
    (["--recompute-activations", "--recompute-granularity", "full", "--train-iters", "3",
      "--recompute-method", "uniform", "--recompute-num-layers", "1"],  # (now required)
     ["--recompute-activations"]),
    (["--train-samples", "1", "--global-batch-size", "4"], ["--train-samples 1"]),
])
def test_conflicting_megatron_flags_refused(monkeypatch, capsys, extra, words):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as e:
        main(BASE + extra)
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(w in err for w in words), err


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_skip_train_evaluates_and_exits(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", "29641")
    with pytest.raises(SystemExit) as e:
        main(BASE + ["--train-iters", "2", "--save", str(tmp_path / "ck")])
    assert e.value.code == 0
    log = tmp_path / "skip.jsonl"
    with pytest.raises(SystemExit) as e:
        main(BASE + ["--load", str(tmp_path / "ck"), "--skip-train", "--log-json", str(log)])
    assert e.value.code == 0
    kinds = [(r["kind"], r.get("iteration")) for r in _records(log)]
    assert kinds == [("run", None), ("resume", 2), ("valid", 2)]  # what it loaded, evaluated the
    # iteration-2 model, no step
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "iter_0000002", "latest_checkpointed_iteration.txt"]  # nothing saved


def test_eval_interval_default_and_final_evaluation(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", "29643")
    log = tmp_path / "log.jsonl"
    with pytest.raises(SystemExit) as e:
        main(BASE + ["--train-iters", "3", "--log-json", str(log)])
    assert e.value.code == 0
    valid = [r["iteration"] for r in _records(log) if r["kind"] == "valid"]
    assert valid == [3]  # default --eval-interval (Megatron's None): only the final evaluation
    from loom.config import LoggingConfig
    assert LoggingConfig().eval_interval is None


def test_blend_from_command_line_and_yaml_list(data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    y = tmp_path / "c.yaml"
    y.write_text(f"data:\n  data_path: [0.25, {data['a']}, 0.75, {data['c']}]\n")
    from loom.config import add_config_arguments, config_from_args
    import argparse
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    assert config_from_args(p.parse_args(["--config", str(y)])).data.data_path == \
        f"0.25 {data['a']} 0.75 {data['c']}"
    log = tmp_path / "log.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["train",  # pinned: loom's defaults before Megatron's (issue 21)
              "--lr", "3e-4", "--adam-beta2", "0.95", "--lr-decay-style", "cosine",
              "--log-interval", "10",
              "--data-path", "0.3", data["a"], "0.7", data["b"], "--num-layers", "2",
              "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
              "--micro-batch-size", "2", "--train-iters", "2", "--eval-iters", "1",
              "--split", "90,10,0", "--no-progress-bar", "--log-json", str(log)])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "train data blend: 30.0% " in out and "valid data blend: 30.0% " in out, out
    assert [r["kind"] for r in _records(log)] == ["run", "train", "valid", "summary"]


def test_blend_of_different_tokenizers_refused(data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    other = write_dataset(tmp_path / "other", 1, 30)
    meta = json.loads(Path(other + ".meta.json").read_text())
    Path(other + ".meta.json").write_text(json.dumps({**meta, "vocab_size": 500}))
    with pytest.raises(SystemExit) as e:
        main(["train",  # pinned: loom's defaults before Megatron's (issue 21)
              "--lr", "3e-4", "--micro-batch-size", "4", "--adam-beta2", "0.95",
              "--lr-decay-style", "cosine", "--log-interval", "10", "--eval-iters", "10",
              "--data-path", "0.5", data["a"], "0.5", other, "--num-layers", "2",
              "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and other in err and "same tokenizer" in err, err
