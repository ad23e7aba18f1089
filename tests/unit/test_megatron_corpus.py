"""Every functional-test training case of Megatron-LM d98e8a6 through ``loom train --dry-run
--world-size W`` in-process (issue 42): the 237 cases of
``tests/functional_tests/test_cases/{gpt,moe,bert,hybrid}`` that are not ``MODE: inference``,
transcribed in tests/unit/megatron_corpus.json (``benchmarks/megatron_corpus.py``; placeholders:
testkit/megatron_corpus.py).

Each case is accepted, or refused in one line (exit status 2) that names what loom lacks:

- a capability another branch is adding (testkit.megatron_corpus.PENDING, empty since issue
  42's branches merged): the case is run again as if it had merged (the flag dropped, or
  loom's value in its place), which gives the share accepted once they merge;
- a capability nobody is adding yet (:data:`MISSING` below, each case with the words its
  refusal must hold).

A case that changes state (accepted where it was refused, or the reverse) fails the test with
what to update, so the counts stay true. ``python -m pytest -s tests/unit/test_megatron_corpus.py``
prints the report.
"""

from __future__ import annotations

import pytest

from testkit.megatron_corpus import (COMMIT, CORPUS, INFERENCE, PENDING_RULES, TRAINING, argv_of,
                                     dry_run, pending_in, with_pending_implemented)

# Refused even when every pending capability has merged: the missing capability and the cases.
MISSING = {
    "--perform-rl-step: loom has no reinforcement learning": [
        "gpt_grpo_basic_function", "gpt_grpo_tp1tp2_pp1_dp8_583m_throughputtest",
        "gpt_grpo_tp1tp2_pp1_dp8_583m_throughputtest_github",
        "gpt_grpo_tp4_pp1_dp2_8b_cudagraphs_throughput", "gpt_grpo_tp4_pp1_dp2_8b_throughput",
        "gpt_grpo_tp4_pp1_dp2_8b_throughput_github",
        "gpt_grpo_tp8tp4_pp1_ep8ep2_dp8_throughputtest"],
    "--export-model-type MambaModel: loom has no ModelOpt": [  # quantization-aware
        "hybrid_nemotron_v3_pico_7b_a1b_tp1_ep8_QAD_dgx_h100_1N8G"],  # distillation (--sft: ok)
    "--flextron: not supported by loom": [  # pretrain_hybrid_flex.py's own 24 flags
        "hybrid_flextron_nightly_tp2_pp1_ep2_dgx_h100_1N8G"],
    "no training data": [  # empty MODEL_ARGS: the case runs its own cuda_graphs.py script
        "gpt_dynamic_inference_tp1_pp1_583m_cuda_graphs_validation"],
}
EXPECTED_AS_GIVEN = 227
"""Cases accepted as given (of 237, 95.8%): every case but those of :data:`MISSING` (10), since
the capabilities of issue 42's branches (timers, deterministic mode, SGD, profiler, memory
history, sinkhorn, YaRN, per-layer MoE logging, --save-retain-interval, --ckpt-format torch,
MLA without RoPE, Mamba heads of any width, --use-checkpoint-args falling back; then
interleaved RoPE, muP and Muon: branch capsmath; then capstrain's evaluation batch sizes, fp16
ZeRO-3 and fill-in-the-middle data: the two FIM cases read a small real dataset, as FIM needs
text and Megatron refuses it with --mock-data; Megatron's expert grid, EP over TP and CP
ranks: branch epgen; Megatron-Core's interleaved micro-batch groups, m not a multiple of p;
--pipeline-model-parallel-layout and the embedding / loss counted in an interleaved split;
global_aux_loss under recomputation, the recomputed forward replaying the running load, and
Megatron's rerun state machine with error injection: branch rerun; Qwen3-Next's gated
attention output and Gated DeltaNet layers: branch gdn; Mamba layers under context
parallelism: branch cpmamba; knowledge distillation from a frozen teacher,
--export-kd-teacher-load and --export-kd-cfg: branch distill; DeepSeek sparse attention:
branch dsa) merged."""


@pytest.fixture(scope="module")
def results(tmp_path_factory, request):
    """``{case: (status as given, its refusal, pending capabilities, status and refusal with
    them merged)}``."""
    import os
    os.environ.setdefault("WANDB_MODE", "offline")
    mp = pytest.MonkeyPatch()
    mp.delenv("WORLD_SIZE", raising=False)
    mp.delenv("RANK", raising=False)
    import loom.planner.meta_count as meta_count  # the exact per-rank count builds every
    mp.setattr(meta_count, "format_counts", lambda *a: "")  # expert: tested in tests/planner
    tmp = tmp_path_factory.mktemp("corpus")
    (tmp / "load").mkdir()  # Megatron's CI --load: a directory without this run's checkpoint
    (tmp / "ckpt").mkdir()
    out = {}
    for case in TRAINING:
        argv = argv_of(case, tmp)
        code, err = dry_run(argv, case["world_size"])
        pending = pending_in(argv)
        merged = (code, err) if not pending else dry_run(with_pending_implemented(argv),
                                                          case["world_size"])
        out[case["name"]] = (code, err, pending, *merged)
    mp.undo()
    yield out
    _report(out, request.config)


def _report(out: dict, config) -> None:
    given = sum(v[0] == 0 for v in out.values())
    merged = sum(v[3] == 0 for v in out.values())
    n = len(out)
    lines = [f"Megatron-LM {COMMIT[:7]} functional-test training cases through loom train "
             f"--dry-run: {given}/{n} accepted as given ({100 * given / n:.1f}%); "
             f"{merged}/{n} ({100 * merged / n:.1f}%) with the pending capabilities merged"]
    for words, cases in MISSING.items():
        lines.append(f"  refused ({len(cases)}): {words}")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("\n".join(lines))


def test_the_corpus_is_megatrons():
    assert CORPUS["commit"] == COMMIT
    assert len(TRAINING) == 237 and len(INFERENCE) == 59
    assert {c["family"] for c in TRAINING} == {"gpt", "moe", "bert", "hybrid"}
    assert all(c["world_size"] >= 1 for c in TRAINING)


def test_every_refusal_is_one_line_naming_what_loom_lacks(results):
    missing = {case: words for words, cases in MISSING.items() for case in cases}
    for name, (code, err, pending, code2, err2) in results.items():
        if code == 0:
            continue
        assert code == 2 and err.startswith("loom train: error: "), (name, err)
        assert "\n" not in err or "unrecognized arguments" in err, (name, err)
        named = any(p in err for p in pending) or any(r in err for r in PENDING_RULES) or \
            (name in missing and missing[name] in err)
        assert named, f"{name}: refused for what the test does not list: {err}"


def test_with_the_pending_capabilities_merged(results):
    """Accepted once the pending branches merge, unless listed in MISSING; a listed case now
    accepted, or a new refusal, fails (update MISSING: the share is what the listing says)."""
    missing = {case: words for words, cases in MISSING.items() for case in cases}
    for name, (_, _, _, code2, err2) in results.items():
        pending_rule = any(r in err2 for r in PENDING_RULES)
        if name in missing:
            assert code2 == 2 and missing[name] in err2, \
                f"{name} is no longer refused for {missing[name]!r}: {err2 or 'accepted'}" \
                f" (remove it from MISSING)"
        else:
            assert code2 == 0 or pending_rule, f"{name}: refused: {err2}"


def test_accepted_shares(results):
    given = sum(v[0] == 0 for v in results.values())
    assert given == EXPECTED_AS_GIVEN, f"{given} accepted as given: update EXPECTED_AS_GIVEN"
    refused = sum(len(cases) for cases in MISSING.values())
    merged = sum(v[3] == 0 for v in results.values())
    rules = sum(v[3] != 0 and any(r in v[4] for r in PENDING_RULES) for v in results.values())
    assert merged + rules + refused == len(results)
    assert merged + rules >= EXPECTED_AS_GIVEN  # of 237 (95.8%)
