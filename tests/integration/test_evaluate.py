"""``loom evaluate`` (issue 12, item 3): Megatron's zero-shot semantics, checked by hand.

A tiny GPT (and a tiny Mamba hybrid) checkpoint with a word-level tokenizer (one token per
word ``w0 .. w39``, so texts and targets are known token by token); the reference is a plain
loop over the single-process model on the exact, unpadded token slices:

- perplexity = exp(total loss / (N - 1)), word perplexity = exp(total loss / (W - 1)) with
  Megatron's word count; stride == window is the non-overlapping evaluation; a stride < window
  case is enumerated by hand (which window scores which targets);
- cloze accuracy on a hand-made 5-example file whose expected accuracy comes from the model's
  greedy predictions (3 of 5 end with the model's argmax word);
- TP=2, PP=2 and DP=2 (one spawned 2-rank world) give the single-process numbers (GPT
  perplexity and cloze, Mamba perplexity);
- the same text as a .txt, a .jsonl and an indexed dataset gives the same numbers;
- bad input: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random

import pytest
import torch

from loom.evaluation.cli import add_arguments, evaluate
from loom.evaluation.datasets import lm_windows, megatron_word_count
from testkit import run_distributed
from testkit.cli import refusal
from testkit.config import tiny_config, tiny_model

WORDS = ["<|endoftext|>", "[UNK]"] + [f"w{i}" for i in range(40)]
SEQ = 8


def _tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))


def _checkpoint(root, model_type: str) -> str:
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    common = dict(num_layers=2, seq_length=SEQ, max_position_embeddings=32,
                  vocab_size=len(WORDS), init_method_std=0.3)  # far from uniform predictions
    if model_type == "mamba":
        m = tiny_model("mamba", common, hybrid_override_pattern="M*", padded_vocab_size=None)
    else:
        m = tiny_model("gpt", common)
    cfg = tiny_config(model=m, lr=3e-4, world=1)  # (never trained: any valid values)
    save = str(root / f"ckpt_{model_type}")
    Trainer(cfg, mesh=ParallelMesh.single()).save(save, tokenizer_file=str(root / "tok.json"))
    return save


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    _tokenizer(root / "tok.json")
    rng = random.Random(0)
    words = [f"w{rng.randrange(40)}" for _ in range(40)]
    # Megatron counts words by " ": the double space and the " \n " are words of their own
    text = " ".join(words[:20]) + "  " + " ".join(words[20:30]) + " \n " + " ".join(words[30:])
    (root / "text.txt").write_text(text)
    (root / "short.txt").write_text(" ".join(words[:11]))
    return {"root": root, "gpt": _checkpoint(root, "gpt"), "mamba": _checkpoint(root, "mamba"),
            "text": text, "ids": [WORDS.index(w) for w in text.split()]}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def _eval(ckpt: str, data, task: str = "perplexity", *extra) -> dict:
    return evaluate(_args(["--load", ckpt, "--task", task, "--eval-data", str(data), *extra]))


def _model(ckpt: str):
    """The single-process model of the checkpoint (the reference)."""
    from loom.checkpoint.io import _ShardIndex, latest_checkpoint, load_model_weights, read_common
    from loom.config import LoomConfig
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    path = latest_checkpoint(ckpt)
    cfg = LoomConfig.from_flat(read_common(path)["config"], ignore_retired=True)
    mesh = ParallelMesh.single()
    model = build_model(get_family(cfg.model.model_type), cfg.model, mesh, seed=None)
    load_model_weights(_ShardIndex(path), [model], mesh)
    return model.eval()


@torch.no_grad()
def _log_probs(model, ids: list[int]) -> torch.Tensor:
    """``[n, Vp]`` float64 log-probabilities of the next token after each of ``ids`` (the
    padded vocabulary columns in the softmax, as the training loss has them: Megatron's)."""
    logits = model(input_ids=torch.tensor([ids]))[0]
    return logits.double().log_softmax(-1)


def _losses(model, ids: list[int]) -> list[float]:
    """Loss of each target ``ids[1:]`` given everything before it in ``ids``."""
    lp = _log_probs(model, ids[:-1])
    return [-float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]


@pytest.mark.parametrize("family", ["gpt", "mamba"])
def test_perplexity_is_exp_of_mean_token_loss(world, family):
    model, ids, text = _model(world[family]), world["ids"], world["text"]
    total = 0.0
    for start in range(0, len(ids) - 1, SEQ):  # non-overlapping windows of SEQ targets
        total += sum(_losses(model, ids[start:start + SEQ + 1]))
    r = _eval(world[family], world["root"] / "text.txt")
    n, w = len(ids), len(text.strip().split(" "))
    assert (r["tokens"], r["targets"], r["windows"]) == (40, 39, 5)
    assert r["words"] == w == 42 == megatron_word_count(text)
    assert r["loss"] == pytest.approx(total / (n - 1), rel=1e-6)
    assert r["perplexity"] == pytest.approx(math.exp(total / (n - 1)), rel=1e-6)
    assert r["token_ratio"] == pytest.approx((n - 1) / (w - 1))
    assert r["word_perplexity"] == pytest.approx(math.exp(total / (w - 1)), rel=1e-6)


def test_stride_equal_to_window_is_the_non_overlapping_evaluation(world):
    plain = _eval(world["gpt"], world["root"] / "text.txt")
    same = _eval(world["gpt"], world["root"] / "text.txt", "perplexity",
                 "--overlapping-eval", str(SEQ), "--micro-batch-size", "3")
    for k in ("loss", "perplexity", "word_perplexity", "targets", "windows"):
        assert same[k] == pytest.approx(plain[k], rel=1e-12), k


def test_overlapping_windows_by_hand(world):
    """11 tokens, window 4, stride 2: window 0 scores targets 1-4; windows at 2, 4, 6 score
    only their last 2 targets (5-6, 7-8, 9-10), with 2 tokens of extra context each."""
    ids = world["ids"][:11]
    assert [s.mask.tolist() for s in lm_windows(ids, 4, 2, 0)] == \
        [[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]]
    model = _model(world["gpt"])
    total = sum(_losses(model, ids[0:5]))
    for start in (2, 4, 6):
        total += sum(_losses(model, ids[start:start + 5])[-2:])
    r = _eval(world["gpt"], world["root"] / "short.txt", "perplexity", "--seq-length", "4",
              "--overlapping-eval", "2")
    assert (r["windows"], r["targets"]) == (4, 10)
    assert r["loss"] == pytest.approx(total / 10, rel=1e-6)
    no_overlap = _eval(world["gpt"], world["root"] / "short.txt", "perplexity",
                       "--seq-length", "4")
    assert no_overlap["loss"] != pytest.approx(r["loss"], rel=1e-6)  # the context matters


def test_cloze_accuracy_on_five_hand_made_examples(world):
    """Examples 0, 2, 4 end with the model's greedy next word (correct), 1 and 3 with another
    word (wrong): accuracy 3 / 5, whether the target is the last token or the last word."""
    model, rng = _model(world["gpt"]), random.Random(1)
    lines, target_loss = [], 0.0
    for i in range(5):
        context = [WORDS.index(f"w{rng.randrange(40)}") for _ in range(3 + i)]  # <= SEQ
        lp = _log_probs(model, context)[-1]
        greedy = int(lp[2:].argmax()) + 2  # a word (not <|endoftext|> or [UNK])
        assert int(lp.argmax()) == greedy
        last = greedy if i % 2 == 0 else 2 + (greedy - 2 + 7) % 40
        target_loss += -float(lp[last])
        lines.append(json.dumps({"text": " ".join(WORDS[t] for t in context + [last])}))
    path = world["root"] / "cloze.jsonl"
    path.write_text("\n".join(lines) + "\n")
    for extra in ((), ("--strict-lambada",)):
        r = _eval(world["gpt"], path, "cloze", *extra)
        assert (r["examples"], r["correct"], r["accuracy"]) == (5, 3, 0.6)
        assert r["target_loss"] == pytest.approx(target_loss / 5, rel=1e-6)


def test_cloze_counts_an_example_only_if_every_target_token_is_the_argmax():
    from loom.evaluation.cloze import score
    logits = torch.zeros(2, 3, 5)
    logits[:, 0, 1] = logits[:, 1, 2] = logits[:, 2, 3] = 1.0  # greedy: 1, 2, 3
    batch = {"labels": torch.tensor([[0, 2, 3], [0, 2, 4]]),
             "loss_mask": torch.tensor([[0.0, 1, 1], [0, 1, 1]])}  # a 2-token last word
    out = score(logits, batch)
    assert out["correct"].tolist() == [1.0, 0.0] and out["targets"].tolist() == [2.0, 2.0]


def _layouts(ckpt: str, mamba: str, text: str, cloze: str) -> dict:
    out = {}
    for tp, pp in ((2, 1), (1, 2), (1, 1)):  # the last one: DP = 2
        lay = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
        out[(tp, pp)] = (_eval(ckpt, text, "perplexity", "--overlapping-eval", "3", *lay),
                         _eval(ckpt, cloze, "cloze", "--micro-batch-size", "2", *lay),
                         _eval(mamba, text, "perplexity", *lay))
    return out


def test_tp2_pp2_dp2_give_the_single_process_numbers(world):
    text, cloze = world["root"] / "text.txt", world["root"] / "cloze5.jsonl"
    rng = random.Random(2)
    cloze.write_text("".join(json.dumps({"text": " ".join(f"w{rng.randrange(40)}"
                                                           for _ in range(6))}) + "\n"
                             for _ in range(5)))
    ref = (_eval(world["gpt"], text, "perplexity", "--overlapping-eval", "3"),
           _eval(world["gpt"], cloze, "cloze"), _eval(world["mamba"], text))
    results = run_distributed(2, _layouts, world["gpt"], world["mamba"], str(text), str(cloze))
    for rank in results:
        for (tp, pp), (ppl, acc, mamba) in rank.items():
            assert mamba["loss"] == pytest.approx(ref[2]["loss"], rel=1e-5), (tp, pp, "mamba")
            assert ppl["layout"] == {"tp": tp, "pp": pp, "dp": 2 // (tp * pp)}
            for k in ("loss", "perplexity", "word_perplexity"):
                assert ppl[k] == pytest.approx(ref[0][k], rel=1e-5), (tp, pp, k)
            assert ppl["targets"] == ref[0]["targets"] == 39
            assert (acc["correct"], acc["examples"]) == (ref[1]["correct"], 5)
            assert acc["target_loss"] == pytest.approx(ref[1]["target_loss"], rel=1e-5)


def test_text_jsonl_and_indexed_dataset_agree(world):
    from loom.data.preprocess import preprocess
    from loom.data.tokenizer import Tokenizer
    root, docs = world["root"], ["w1 w2 w3 w4 w5 w6", "w7 w8 w9 w10", "w11 w12 w13 w14 w15"]
    (root / "docs.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    # a text file with the end-of-document tokens written out is the same token stream
    (root / "docs.txt").write_text("".join(d + " <|endoftext|> " for d in docs))
    tok = Tokenizer.load(str(root / "tok.json"))
    preprocess([str(root / "docs.jsonl")], str(root / "docs_idx"), tok, append_eod=True,
               json_keys=("body",))
    j = _eval(world["gpt"], root / "docs.jsonl", "perplexity", "--json-key", "body")
    i = _eval(world["gpt"], root / "docs_idx")
    t = _eval(world["gpt"], root / "docs.txt")
    assert (j["tokens"], j["documents"], j["words"]) == (i["tokens"], i["documents"],
                                                         i["words"]) == (18, 3, 15)
    assert j["loss"] == pytest.approx(i["loss"], rel=1e-12)
    assert t["loss"] == pytest.approx(i["loss"], rel=1e-12) and t["tokens"] == 18
    flags = _eval(world["gpt"], root / "docs_idx", "perplexity", "--tokenizer-type",
                  "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tok.json"))
    assert flags["loss"] == i["loss"]  # the tokenizer from flags instead of the checkpoint's


# -- bad input ----------------------------------------------------------------------------------

def _refusal(argv, monkeypatch, capsys) -> str:
    return refusal(argv, monkeypatch, capsys, prog="loom evaluate")


def test_cloze_file_without_the_text_key(world, monkeypatch, capsys):
    path = world["root"] / "bad_cloze.jsonl"
    path.write_text('{"text": "w1 w2 w3"}\n{"text": "w4 w5"}\n{"sentence": "w6 w7"}\n')
    line = _refusal(["evaluate", "--load", world["gpt"], "--task", "cloze", "--eval-data",
                     str(path)], monkeypatch, capsys)
    assert str(path) in line and "line 3" in line and "'text'" in line, line


def test_missing_eval_file(world, monkeypatch, capsys):
    for task in ("perplexity", "cloze"):
        line = _refusal(["evaluate", "--load", world["gpt"], "--task", task, "--eval-data",
                         "/nonexistent/wiki.txt"], monkeypatch, capsys)
        assert "--eval-data /nonexistent/wiki.txt: no such file" in line, line


def test_checkpoint_of_another_model_type(world, monkeypatch, capsys):
    line = _refusal(["evaluate", "--load", world["gpt"], "--task", "perplexity", "--eval-data",
                     str(world["root"] / "text.txt"), "--model-type", "mamba"],
                    monkeypatch, capsys)
    assert "--model-type mamba" in line and "holds a gpt model" in line, line


def test_task_not_supported_for_the_model_type(world, monkeypatch, capsys, tmp_path):
    """A BERT checkpoint (its config says model_type bert) asked for cloze accuracy."""
    import shutil
    from loom.checkpoint.integrity import write_manifest
    from loom.checkpoint.io import latest_checkpoint
    bert = tmp_path / "bert"
    shutil.copytree(world["gpt"], bert)
    common_pt = latest_checkpoint(str(bert)) + "/common.pt"
    common = torch.load(common_pt, weights_only=False)
    common["config"]["model_type"] = "bert"
    torch.save(common, common_pt)
    write_manifest(os.path.dirname(common_pt))  # an edit the checksums would refuse otherwise
    line = _refusal(["evaluate", "--load", str(bert), "--task", "cloze", "--eval-data",
                     str(world["root"] / "text.txt")], monkeypatch, capsys)
    assert "--task cloze is not supported for model type bert" in line, line


@pytest.mark.parametrize("argv,words", [
    (["--load", "/nonexistent/ckpt"], "--load /nonexistent/ckpt: no such checkpoint"),
    (["--overlapping-eval", "9"], "--overlapping-eval 9 exceeds --seq-length 8"),
    (["--overlapping-eval", "0"], "--overlapping-eval must be >= 1"),
    (["--tensor-model-parallel-size", "3"], "not divisible by --tensor-model-parallel-size 3"),
])
def test_bad_flags(world, monkeypatch, capsys, argv, words):
    base = ["evaluate", "--load", world["gpt"], "--task", "perplexity", "--eval-data",
            str(world["root"] / "text.txt")]
    line = _refusal(base + argv, monkeypatch, capsys)
    assert words in line, line


def test_bad_data_files(world, monkeypatch, capsys, tmp_path):
    """A cloze line that is not JSON (file and line named); an indexed dataset tokenized with
    another tokenizer than the checkpoint's (its ids would mean other words)."""
    from loom.data.preprocess import preprocess
    from loom.data.tokenizer import Tokenizer
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w1 w2"}\n{"text": "w3 w4"\n')
    line = _refusal(["evaluate", "--load", world["gpt"], "--task", "cloze", "--eval-data",
                     str(bad)], monkeypatch, capsys)
    assert f"{bad}: line 2 is not JSON" in line, line
    from tokenizers import Tokenizer as HF, models, pre_tokenizers
    other = HF(models.WordLevel({w: i for i, w in enumerate(reversed(WORDS))}, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "doc.jsonl").write_text('{"text": "w1 w2 w3"}\n')
    preprocess([str(tmp_path / "doc.jsonl")], str(tmp_path / "other"),
               Tokenizer(other, eod=len(WORDS) - 1))
    line = _refusal(["evaluate", "--load", world["gpt"], "--task", "perplexity", "--eval-data",
                     str(tmp_path / "other")], monkeypatch, capsys)
    assert "not the model's tokenizer" in line and "other.tokenizer.json" in line, line
