"""The 59 ``MODE: inference`` functional-test cases of Megatron-LM d98e8a6 through ``loom
generate`` (issue 42): each case's flags are checked as ``loom generate`` checks them (every
Megatron flag has a row for generation, :mod:`loom.inference.options`), against a tiny loom
checkpoint standing in for the case's Megatron checkpoint (the cases give
``--use-checkpoint-args``: the model is the checkpoint's), and the one-rank cases generate for
real (their prompts, lengths, sampling, ``--output-path`` JSON with ``--return-log-probs``).
A case is accepted, or refused in one line naming what loom lacks (:data:`MISSING`); pending
capabilities (testkit.megatron_corpus.PENDING) are simulated merged, as for training."""

from __future__ import annotations

import json

import pytest

from testkit.megatron_corpus import (INFERENCE, argv_of, inference_world, pending_in,
                                     through_generate, with_pending_implemented)

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


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny GPT checkpoint with a tokenizer (``{CKPT}``) and a prompt file (``{FILE}``)."""
    return inference_world(tmp_path_factory.mktemp("inference"))


@pytest.fixture(scope="module")
def results(world):
    mp = pytest.MonkeyPatch()
    mp.delenv("WORLD_SIZE", raising=False)
    mp.delenv("RANK", raising=False)
    out = {}
    for case in INFERENCE:
        argv = [w.replace("inference.json", f"{case['name']}.json")
                for w in argv_of(case, world, vocab=False)]
        code, err = through_generate(case, argv)
        pending = pending_in(argv)
        merged = (code, err) if not pending else through_generate(
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
