"""``loom evaluate --task mlm`` (issue 12, item 3): BERT's masked-LM accuracy and loss.

A tiny BERT trained for a few iterations through the CLI (`loom preprocess` with a WordPiece
trained on the corpus, `loom train --model-type bert --save`), evaluated on held-out documents
of the same pseudo-words. The reference is a plain loop over the single-process model: the
held-out stream cut by hand into ``[CLS] window [SEP]`` samples, masked by the training
dataset's code with the same seed, one sample at a time, float64 log-softmax; the task's
counts and loss must equal it, at TP=2, PP=2 and DP=2 as well (one spawned 2-rank world).
A task the checkpoint's family lacks is refused in one line.
"""

from __future__ import annotations

import argparse
import json
import math
import random

import numpy as np
import pytest
import torch

from loom.cli import main
from loom.evaluation.cli import add_arguments, evaluate
from testkit import run_distributed
from testkit.cli import refusal

SEQ = 24


def _corpus(path, n_docs: int, seed: int) -> None:
    """Documents of 30 pseudo-words built from syllables (many split into WordPieces)."""
    rng = random.Random(0)
    syll = ["ka", "lo", "mi", "ten", "ras", "qu", "ve", "dor", "sin", "pha", "ul", "bre"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 3))) for _ in range(30)]
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n_docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(40)) + "."})
                    + "\n")


def _cli(argv) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0, argv


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate_bert")
    mp = pytest.MonkeyPatch()
    mp.setenv("WORLD_SIZE", "1")
    mp.delenv("RANK", raising=False)
    _corpus(root / "train.jsonl", 60, seed=1)
    _corpus(root / "heldout.jsonl", 12, seed=2)
    prefix = str(root / "tiny")
    _cli(["preprocess", "--input", str(root / "train.jsonl"), "--output-prefix", prefix,
          "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-size", "200", "--append-eod"])
    _cli(["train",  # pinned: loom's defaults before Megatron's (issue 21)
          "--adam-beta2", "0.95", "--lr-decay-style", "cosine",
          "--model-type", "bert", "--data-path", prefix, "--num-layers", "2",
          "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
          "--micro-batch-size", "8", "--train-iters", "20", "--lr", "3e-3",
          "--lr-warmup-iters", "2", "--log-interval", "10", "--eval-interval", "20", "--eval-iters", "1",
          "--no-progress-bar", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--save", str(root / "bert")])
    gpt = str(root / "gpt")
    _cli(["train",  # pinned: loom's defaults before Megatron's (issue 21)
          "--lr", "3e-4", "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--log-interval",
          "10", "--eval-iters", "10", "--mock-data", "--vocab-size", "64", "--num-layers", "2",
          "--hidden-size",
          "32", "--num-attention-heads", "4", "--seq-length", "8", "--micro-batch-size", "2",
          "--train-iters", "1", "--no-progress-bar", "--save", gpt])
    mp.undo()
    return {"root": root, "bert": str(root / "bert"), "gpt": gpt,
            "heldout": str(root / "heldout.jsonl")}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def _eval(ckpt: str, data: str, *extra) -> dict:
    return evaluate(_args(["--load", ckpt, "--task", "mlm", "--eval-data", data, *extra]))


def _model(ckpt: str):
    """The single-process model of the checkpoint and its tokenizer (the reference)."""
    from loom.checkpoint.io import _ShardIndex, latest_checkpoint, load_model_weights, read_common
    from loom.config import LoomConfig
    from loom.data.tokenizer import Tokenizer
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    path = latest_checkpoint(ckpt)
    cfg = LoomConfig.from_flat(read_common(path)["config"], ignore_retired=True)
    mesh = ParallelMesh.single()
    model = build_model(get_family(cfg.model.model_type), cfg.model, mesh, seed=None)
    load_model_weights(_ShardIndex(path), [model], mesh)
    return model.eval(), Tokenizer.load(path + "/tokenizer.json"), cfg.model.vocab_size


@torch.no_grad()
def _reference(ckpt: str, data: str, seed: int) -> dict:
    """The plain loop: documents + [SEP] -> windows of SEQ - 2 -> BertDataset masking (seed)
    -> the model one sample at a time -> float64 cross-entropy and argmax at masked positions."""
    from loom.data.bert_dataset import BertDataset, special_ids, word_starts
    model, tok, V = _model(ckpt)
    stream = []
    for line in open(data):
        stream += tok.encode(json.loads(line)["text"]) + [tok.eod]
    n = SEQ - 2
    src = [{"tokens": np.array(stream[i:i + n])} for i in range(0, len(stream), n)]
    ds = BertDataset(src, SEQ, special_ids(tok), tok.vocab_size, seed, short_seq_prob=0.0,
                     starts=word_starts(tok))
    targets = correct = 0
    loss = 0.0
    for k in range(len(ds)):
        d = ds[k]
        logits, _ = model(input_ids=d["tokens"][None], padding_mask=d["padding_mask"][None])
        lp = logits[0].double().log_softmax(-1)  # all Vp columns, as the training loss
        for i in d["loss_mask"].nonzero().flatten().tolist():
            label = int(d["labels"][i])
            targets += 1
            loss -= float(lp[i, label])
            correct += int(int(lp[i].argmax()) == label)
    return {"targets": targets, "correct": correct, "loss": loss / targets,
            "masked_inputs": sum(int((ds[k]["tokens"] == tok.hf.token_to_id("[MASK]")).sum())
                                 for k in range(len(ds)))}


def test_mlm_accuracy_and_loss_equal_the_plain_loop(world):
    ref = _reference(world["bert"], world["heldout"], seed=7)
    out = _eval(world["bert"], world["heldout"], "--seed", "7", "--micro-batch-size", "3")
    assert out["task"] == "mlm" and out["model_type"] == "bert"
    assert out["targets"] == ref["targets"] > 30
    assert 0.6 * ref["targets"] <= ref["masked_inputs"] <= ref["targets"]  # 80% [MASK]
    assert out["correct"] == ref["correct"] > 0  # trained: some masked tokens are recovered
    assert out["accuracy"] == pytest.approx(ref["correct"] / ref["targets"], rel=1e-12)
    assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert out["perplexity"] == pytest.approx(math.exp(ref["loss"]), rel=1e-5)
    again = _eval(world["bert"], world["heldout"], "--seed", "7")
    assert (again["targets"], again["correct"]) == (out["targets"], out["correct"])
    assert again["loss"] == pytest.approx(out["loss"], rel=1e-6)  # the seed fixes the masks
    other = _eval(world["bert"], world["heldout"], "--seed", "8")
    assert other["loss"] != pytest.approx(out["loss"], rel=1e-6)


def _layouts(ckpt: str, data: str) -> dict:
    out = {}
    for tp, pp in ((2, 1), (1, 2), (1, 1)):  # the last one: DP = 2
        out[(tp, pp)] = _eval(ckpt, data, "--seed", "7", "--micro-batch-size", "2",
                              "--tensor-model-parallel-size", str(tp),
                              "--pipeline-model-parallel-size", str(pp))
    return out


def test_tp2_pp2_dp2_give_the_single_process_numbers(world):
    ref = _eval(world["bert"], world["heldout"], "--seed", "7")
    for rank in run_distributed(2, _layouts, world["bert"], world["heldout"]):
        for (tp, pp), out in rank.items():
            assert out["layout"] == {"tp": tp, "pp": pp, "dp": 2 // (tp * pp)}
            assert (out["targets"], out["correct"]) == (ref["targets"], ref["correct"]), (tp, pp)
            assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5), (tp, pp)


def _refusal(argv, monkeypatch, capsys) -> str:
    return refusal(argv, monkeypatch, capsys, prog="loom evaluate")


@pytest.mark.parametrize("ckpt,task,family", [("bert", "perplexity", "bert"),
                                              ("gpt", "mlm", "gpt")])
def test_task_not_supported_for_the_model_type(world, monkeypatch, capsys, ckpt, task, family):
    line = _refusal(["evaluate", "--load", world[ckpt], "--task", task, "--eval-data",
                     world["heldout"]], monkeypatch, capsys)
    assert f"--task {task} is not supported for model type {family}" in line, line


def test_bad_mlm_flags(world, monkeypatch, capsys):
    line = _refusal(["evaluate", "--load", world["bert"], "--task", "mlm", "--eval-data",
                     world["heldout"], "--mask-prob", "0"], monkeypatch, capsys)
    assert "--mask-prob must be > 0" in line, line  # the field's bounds, as loom train
