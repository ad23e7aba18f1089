"""lm-evaluation-harness scores a fresh ``loom checkpoint convert --to-hf`` export as it is
(issue 45: it crashed on ``prefix_token_id`` without ``tokenizer_config.json``), and agrees
with ``loom evaluate --task perplexity`` on the same text; ``loom evaluate --lm-eval-tasks``
scores the checkpoint itself (no export) at TP 1, TP 2 and PP 2 with ``HFLM``'s numbers: every
``loglikelihood`` request (empty context, a context longer than the window) and the tasks'
metrics.

The task is local and offline: a one-document jsonl file read by ``datasets``' ``json``
builder, ``loglikelihood_rolling`` (lm-eval's WikiText task without the download). The two
tools count the same thing once their windows are aligned: lm-eval scores every token of the
document, the first one conditioned on the prefix token (the tokenizer's BOS, which the export
names: loom's end-of-document token), in windows of ``max_length`` tokens; ``loom evaluate``
scores the N - 1 later tokens of its stream in windows of ``--seq-length``. So loom reads the
document after an end-of-document token, with ``--seq-length`` = the model's context, on a text
of whole windows (lm-eval's last, partial window would otherwise see up to ``max_length``
tokens of context where Megatron's sees those of its own window only).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re

import pytest
from testkit.config import tiny_config

lm_eval = pytest.importorskip("lm_eval")

SEQ, V = 16, 64


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    from lm_eval.models.huggingface import HFLM
    from tokenizers import Tokenizer, models, pre_tokenizers
    from lm_eval.tasks import TaskManager

    from loom.checkpoint.convert import to_hf
    from loom.evaluation.cli import add_arguments, evaluate
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    root = tmp_path_factory.mktemp("lm_eval")
    words = ["<|endoftext|>", "<pad>"] + [f"w{i}" for i in range(V - 2)]  # one id a word
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(words[:2])
    tok.save(str(root / "tok.json"))
    cfg = tiny_config("llama", seq_length=SEQ, vocab_size=V,
                      init_method_std=0.3,  # peaked predictions: not uniform
                      exclude_padded_vocab=True,  # HF's softmax over V (the export's)
                      lr=3e-4, train_iters=10, world=1)
    Trainer(cfg, mesh=ParallelMesh.single()).save(
        str(root / "ckpt"), tokenizer_file=str(root / "tok.json"))
    to_hf(str(root / "ckpt"), str(root / "hf"))

    rng = random.Random(0)
    text = " ".join(f"w{rng.randrange(V - 4)}" for _ in range(3 * SEQ))  # 3 whole windows
    (root / "doc.jsonl").write_text(json.dumps({"text": text}) + "\n")
    (root / "tasks").mkdir()
    (root / "tasks" / "loom_text.yaml").write_text(
        "task: loom_text\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'doc.jsonl'}\ntest_split: test\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    docs = [{"ctx": " ".join(f"w{rng.randrange(V - 4)}" for _ in range(n)),
             "choices": [" ".join(f"w{rng.randrange(V - 4)}" for _ in range(k)) for k in (1, 2, 3)],
             "gold": n % 3} for n in (3, 5, 20, 7, 9, 11)]
    (root / "choice.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "tasks" / "loom_choice.yaml").write_text(
        "task: loom_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'choice.jsonl'}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{ctx}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n")
    lm = HFLM(pretrained=str(root / "hf"), batch_size=4, device="cpu", dtype="float32")
    res = lm_eval.simple_evaluate(
        model=lm, tasks=["loom_text", "loom_choice"], log_samples=False,
        task_manager=TaskManager(include_path=str(root / "tasks"), include_defaults=False))
    requests = [("", docs[0]["ctx"])] + [(d["ctx"], " " + c) for d in docs for c in d["choices"]]
    count = len(re.split(r"\s+", text))  # lm-eval's word count of the document

    def loom(data: str) -> dict:
        (root / "loom.txt").write_text(data)
        p = argparse.ArgumentParser()
        add_arguments(p)
        return evaluate(p.parse_args(["--load", str(root / "ckpt"), "--task", "perplexity",
                                      "--eval-data", str(root / "loom.txt"),
                                      "--seq-length", str(SEQ)]))
    flags = ["--load", str(root / "ckpt"), "--lm-eval-tasks", "loom_text,loom_choice",
             "--lm-eval-include-path", str(root / "tasks"), "--seq-length", str(SEQ)]
    from testkit import run_distributed
    return {"root": root,
            "lm_eval": -math.log(res["results"]["loom_text"]["word_perplexity,none"]) * count,
            "loom": loom("<|endoftext|>" + text), "loom_unaligned": loom(text),
            "prefix": lm.prefix_token_id, "max_length": lm.max_length,
            "hf_results": res["results"], "hf_requests": lm.loglikelihood(instances(requests)),
            "loom_tp1": loom_lm_eval(flags, requests),
            **run_distributed(2, two_layouts, flags, requests, start_method="fork")[0]}


def two_layouts(flags: list, requests: list) -> dict:
    return {"loom_tp2": loom_lm_eval(flags + ["--tensor-model-parallel-size", "2"], requests),
            "loom_pp2": loom_lm_eval(flags + ["--pipeline-model-parallel-size", "2"], requests)}


def instances(requests: list) -> list:
    from lm_eval.api.instance import Instance
    return [Instance(request_type="loglikelihood", doc={}, arguments=r, idx=i)
            for i, r in enumerate(requests)]


def loom_lm_eval(flags: list, requests: list) -> dict:
    """``loom evaluate --lm-eval-tasks`` with ``flags`` (the results), and LoomLM's answers to
    ``requests`` at the same layout."""
    from loom.evaluation.cli import add_arguments, evaluate, prepare
    from loom.evaluation.lm_harness import LoomLM
    from loom.evaluation.runner import build_mesh, load_model
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(flags)
    result = evaluate(args)
    ckpt, cfg, _, tok = prepare(p.parse_args(flags))
    model = load_model(ckpt, cfg, build_mesh(args.tensor_model_parallel_size,
                                             args.pipeline_model_parallel_size))
    return {"results": result["results"], "layout": result["layout"],
            "requests": LoomLM(model, tok, 4).loglikelihood(instances(requests))}


def test_hflm_takes_the_export_as_it_is(scored):
    assert scored["prefix"] == 0 and scored["max_length"] == SEQ  # the EOD id, the context


def test_rolling_loglikelihood_equals_loom_evaluate(scored):
    ours = -scored["loom"]["loss"] * scored["loom"]["targets"]  # total log-likelihood, nats
    assert scored["loom"]["targets"] == 3 * SEQ
    assert abs(scored["lm_eval"] - ours) < 1e-5 * abs(ours), (scored["lm_eval"], ours)
    unaligned = -scored["loom_unaligned"]["loss"] * scored["loom_unaligned"]["targets"]
    assert abs(scored["lm_eval"] - unaligned) > 1e-3 * abs(ours)  # the check can fail


@pytest.mark.parametrize("layout", ["loom_tp1", "loom_tp2", "loom_pp2"])
def test_lm_eval_tasks_score_the_checkpoint_as_hflm_scores_the_export(scored, layout):
    ours, hf = scored[layout], scored["hf_requests"]
    assert (ours["layout"]["tp"], ours["layout"]["pp"]) == {
        "loom_tp1": (1, 1), "loom_tp2": (2, 1), "loom_pp2": (1, 2)}[layout]
    assert [g for _, g in ours["requests"]] == [g for _, g in hf]  # greedy or not
    for (a, _), (b, _) in zip(ours["requests"], hf):
        assert abs(a - b) < 1e-5 * max(1.0, abs(b)), (a, b)
    r, h = ours["results"], scored["hf_results"]
    assert r["loom_choice"]["acc,none"] == h["loom_choice"]["acc,none"]
    assert r["loom_text"]["word_perplexity,none"] == pytest.approx(
        h["loom_text"]["word_perplexity,none"], rel=1e-5)


def test_lm_eval_tasks_refusals(scored, tmp_path, capsys):
    from loom.cli import main
    ckpt = str(scored["root"] / "ckpt")
    for flags, needle in (([], "one of the two"),
                          (["--task", "perplexity"], "--task perplexity needs --eval-data"),
                          (["--task", "perplexity", "--eval-data", "x", "--lm-eval-tasks", "a"],
                           "one of the two"),
                          (["--lm-eval-tasks", "a", "--lm-eval-include-path", str(tmp_path / "n")],
                           "no such directory")):
        with pytest.raises(SystemExit) as e:
            main(["evaluate", "--load", ckpt, *flags])
        assert e.value.code == 2 and needle in capsys.readouterr().err, flags
