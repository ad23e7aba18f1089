"""The 59 ``MODE: inference`` functional-test cases of Megatron-LM d98e8a6 through ``loom
generate`` (issue 42): each case's flags are checked as ``loom generate`` checks them (every
Megatron flag has a row for generation, :mod:`loom.inference.options`), against a tiny loom
checkpoint standing in for the case's Megatron checkpoint (the cases give
``--use-checkpoint-args``: the model is the checkpoint's), and the one-rank cases generate for
real (their prompts, lengths, sampling, ``--output-path`` JSON with ``--return-log-probs``).
A case is accepted, or refused in one line naming what loom lacks (:data:`MISSING`); pending
capabilities (testkit.megatron_corpus.PENDING) are simulated merged, as for training."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest

from loom.cli import main
from loom.errors import ConfigError
from testkit.megatron_corpus import INFERENCE, argv_of, pending_in, with_pending_implemented
from testkit.config import tiny_config

MISSING = {  # refused with the pending capabilities merged: the words and the cases
    "--pipeline-model-parallel-size: loom generate runs the whole model on each rank": [
        "gpt_dynamic_inference_tp1_pp8_583m_prefix_caching",
        "gpt_dynamic_inference_tp1_pp8_dp1_583m_logitsmatch_zmq",
        "gpt_dynamic_inference_tp2_pp2_583m_chunked_prefill",
        "gpt_dynamic_inference_tp2_pp2_583m_cuda_graphs",
        "gpt_dynamic_inference_tp2_pp2_583m_prefix_caching",
        "gpt_dynamic_inference_tp2_pp2_583m_prefix_caching_cuda_graphs",
        "gpt_dynamic_inference_tp2_pp2_dp2_583m_logitsmatch_zmq",
        "moe/gpt_dynamic_inference_tp2_pp2_ep2_gptoss_20b_swa"],
}


def _tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["[UNK]", "<|endoftext|>"] + [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny GPT checkpoint with a tokenizer (``{CKPT}``) and a prompt file (``{FILE}``)."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    root = tmp_path_factory.mktemp("inference")
    _tokenizer(root / "tok.json")
    cfg = tiny_config("llama", num_query_groups=None, vocab_size=42, micro_batch_size=1,
                      train_iters=1, world=1)
    Trainer(cfg, mesh=ParallelMesh.single()).save(
        str(root / "ckpt"), tokenizer_file=str(root / "tok.json"))
    (root / "file").write_text("".join(json.dumps({"text": f"w{i} w{i + 1}"}) + "\n"
                                       for i in range(3)))
    return root


def _parse(argv: list[str]) -> argparse.Namespace:
    from loom.inference.cli import add_arguments
    p = argparse.ArgumentParser(prog="loom generate", exit_on_error=False)
    add_arguments(p)
    return p.parse_args(argv)


def _through_generate(case: dict, argv: list[str]) -> tuple[int, str]:
    """``(0, "")`` accepted (and generated on one rank), or ``(2, the one refusal line)``."""
    from loom.inference.cli import check_arguments
    tp = int(argv[argv.index("--tensor-model-parallel-size") + 1]) \
        if "--tensor-model-parallel-size" in argv else 1
    if tp == 1:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(["generate", *argv]) or 0
            except SystemExit as e:
                code = e.code or 0
        return code, err.getvalue().strip()
    try:  # t ranks: every check of `loom generate`, then it would start the process group
        check_arguments(_parse(argv))
        return 0, ""
    except ConfigError as e:
        return 2, f"loom generate: error: {e}"


@pytest.fixture(scope="module")
def results(world):
    mp = pytest.MonkeyPatch()
    mp.delenv("WORLD_SIZE", raising=False)
    mp.delenv("RANK", raising=False)
    out = {}
    for case in INFERENCE:
        argv = [w.replace("inference.json", f"{case['name']}.json")
                for w in argv_of(case, world, vocab=False)]
        code, err = _through_generate(case, argv)
        pending = pending_in(argv)
        merged = (code, err) if not pending else _through_generate(
            case, with_pending_implemented(argv))
        out[f"{case['family']}/{case['name']}"] = (code, err, pending, *merged)
    mp.undo()
    return out


def test_inference_cases_through_loom_generate(results, world):
    missing = {c: words for words, cases in MISSING.items() for c in cases}
    wrong, accepted = [], 0
    for name, (code, err, pending, code2, err2) in results.items():
        short = name.split("/", 1)[1]
        key = name if name in missing else short
        if code != 0 and not (code == 2 and "\n" not in err and err.startswith(
                "loom generate: error:") and (any(p in err for p in pending) or (
                    key in missing and missing[key] in err))):
            wrong.append(f"{name}: as given: {err}")
        if key in missing:
            if not (code2 == 2 and missing[key] in err2):
                wrong.append(f"{name}: no longer refused for {missing[key]!r}: {err2}")
        elif code2 != 0:
            wrong.append(f"{name}: {err2}")
        else:
            accepted += 1
    assert not wrong, "\n".join(wrong)
    assert accepted == len(results) - sum(len(c) for c in MISSING.values())
    given = sum(v[0] == 0 for v in results.values())
    assert given == accepted == 51, f"{given} accepted as given (of {len(results)})"
    outputs = list((world / "out").glob("*.json"))
    assert outputs and all(json.loads(p.read_text())[0]["generated_tokens"] for p in outputs)
