"""Megatron-LM's earlier releases' functional-test cases through ``loom train --dry-run`` (the
698 training cases of core_v0.10.0 .. core_v0.19.0) and ``loom generate`` (the 72 inference
cases), those whose command line is in no later release's corpus nor in d98e8a6's (tests/unit/megatron_corpus_earlier.json, written by
``python -m benchmarks.megatron_corpus MIRROR --releases core_v0.10.0 ... core_v0.19.0``).

These scripts use flags d98e8a6 dropped (``--use-legacy-models`` in 56 of them,
``--no-async-tensor-model-parallel-allreduce``, ``--legacy-tokenizer``, ``--use-custom-fsdp``,
``--hybrid-attention-ratio``, ...): each has a row (loom/config/flag_rows_removed.py), so a case
is accepted, or refused in one line naming what loom lacks, as in d98e8a6's corpus
(tests/unit/test_megatron_corpus.py). Before that table, 632 of the 706 cases of six of these
releases (core_v0.10/12/14/16/18/19) were accepted (2026-11-29); of the 74 refused, 64 named a
dropped flag, 4 a layout string still escaped for the older CI runner's ``eval`` (the
transcription now unescapes it) and 2 a hybrid pattern under ``--model-type gpt`` (their entry
script, pretrain_mamba.py, now maps to mamba); the other 4 are refused here too or are
d98e8a6's own refusals. core_v0.13's cases then showed a warm-up longer than
``--train-iters`` refused, which Megatron runs (a slice of a longer schedule) and loom now does
too. The counts below are asserted, so a change in either direction fails with what to update.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testkit.megatron_corpus import argv_of, dry_run, inference_world, through_generate

CORPUS = json.loads((Path(__file__).resolve().parent / "megatron_corpus_earlier.json").read_text())
TRAINING = [c for c in CORPUS["cases"] if c["mode"] == "pretraining"]
INFERENCE = [c for c in CORPUS["cases"] if c["mode"] == "inference"]

REFUSED = {
    "no training data": [  # runs its own script, as in d98e8a6's corpus
        "core_v0.15.0:gpt_dynamic_inference_tp1_pp1_583m_cuda_graphs_validation"],
    # Megatron-LM core_v0.16.0 asserts the same (arguments.py:842): the case never ran there
    "--save-retain-interval 2500 is not a multiple of --save-interval 5000": [
        "core_v0.16.0:gpt3_15b_8t_release_sm"],
}
ACCEPTED = 696
"""Cases accepted (of 698, 99.7%): all but :data:`REFUSED`."""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``{case: (exit status, stderr)}`` of every case."""
    import os
    os.environ.setdefault("WANDB_MODE", "offline")
    mp = pytest.MonkeyPatch()
    mp.delenv("WORLD_SIZE", raising=False)
    mp.delenv("RANK", raising=False)
    import loom.planner.meta_count as meta_count  # the per-rank count: tested in tests/planner
    mp.setattr(meta_count, "format_counts", lambda *a: "")
    tmp = tmp_path_factory.mktemp("earlier")
    (tmp / "load").mkdir()
    (tmp / "ckpt").mkdir()
    out = {c["name"]: dry_run(argv_of(c, tmp), c["world_size"]) for c in TRAINING}
    mp.undo()
    return out


def test_the_corpus_is_megatrons_earlier_releases():
    assert sorted(CORPUS["releases"]) == [f"core_v0.{n}.0" for n in range(10, 20)]
    assert (len(TRAINING), len(INFERENCE)) == (698, 72)
    assert all(c["name"].split(":")[0] in CORPUS["releases"] for c in CORPUS["cases"])
    uses = sum("--use-legacy-models" in c["argv"] for c in TRAINING)
    assert uses == 56  # the flag d98e8a6 dropped that these cases use most


def test_every_case_is_accepted_or_refused_in_one_line_naming_why(results):
    listed = {case: words for words, cases in REFUSED.items() for case in cases}
    for name, (code, err) in results.items():
        if code == 0:
            assert name not in listed, f"{name} is accepted now: drop it from REFUSED"
            continue
        assert code == 2 and err.startswith("loom train: error: "), (name, err)
        assert name in listed and listed[name] in err, f"{name}: refused: {err}"
    assert sum(code == 0 for code, _ in results.values()) == ACCEPTED


def test_no_case_is_refused_for_a_flag_loom_does_not_know(results):
    """The failure mode before the earlier releases' table: ``unrecognized argument``."""
    assert not [n for n, (_, err) in results.items() if "unrecognized argument" in err]


INFERENCE_REFUSED = {  # as d98e8a6's own cases are (tests/unit/test_megatron_corpus_inference.py)
    "--pipeline-model-parallel-size: loom generate runs the whole model on each rank": [
        "core_v0.16.0:gpt_dynamic_inference_tp1_pp8_dp1_583m_logitsmatch_zmq",
        "core_v0.16.0:gpt_dynamic_inference_tp2_pp2_dp2_583m_logitsmatch_zmq",
        "core_v0.17.0:gpt_dynamic_inference_tp1_pp8_dp1_583m_logitsmatch_zmq",
        "core_v0.17.0:gpt_dynamic_inference_tp2_pp2_dp2_583m_logitsmatch_zmq"],
    "--num-tokens-from-file: loom has no per-prompt generation lengths": [
        "core_v0.16.0:gpt_dynamic_inference_tp1_pp1_dp8_583m_throughputtest_zmq"],
}
INFERENCE_ACCEPTED = 67
"""Of 72 (93%); core_v0.18's --inference-dynamic-batching-prefix-caching-coordinator-policy
round_robin, a value d98e8a6 dropped, is parsed (``removed_values``) and without effect."""


def test_inference_cases_through_loom_generate(tmp_path):
    """The earlier releases' ``MODE: inference`` cases through ``loom generate`` as
    tests/unit/test_megatron_corpus_inference.py runs d98e8a6's (a tiny checkpoint stands in
    for theirs; one-rank cases generate): accepted, or refused in one line naming what loom
    lacks."""
    world = inference_world(tmp_path)
    listed = {case: words for words, cases in INFERENCE_REFUSED.items() for case in cases}
    accepted = 0
    for c in INFERENCE:
        argv = [w.replace("inference.json", f"{c['name'].split(':')[1]}.json")
                for w in argv_of(c, world, vocab=False)]
        code, err = through_generate(c, argv)
        if code == 0:
            assert c["name"] not in listed, f"{c['name']} is accepted now"
            accepted += 1
            continue
        assert code == 2 and err.startswith("loom generate: error: ") and "\n" not in err, \
            (c["name"], err)
        assert c["name"] in listed and listed[c["name"]] in err, f"{c['name']}: {err}"
    assert accepted == INFERENCE_ACCEPTED
