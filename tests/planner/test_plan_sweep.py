"""``loom plan`` on configurations nobody tried (issue 47: "the same held-out runs, and others you
have not seen"): every call ends in a plan whose chosen layout honours every flag given and whose
printed command loom train's validation accepts, or in one clean ConfigError line (exit 2).
The checker and the full sweep are ``benchmarks/plan_sweep.py``; here a seeded sample of each
class of input and one row per bug the sweep found (each fixed in its own commit)."""

from __future__ import annotations

import random
import shlex

import pytest

from benchmarks.plan_sweep import Case, check, grid_cases, hf_cases, is_failure, script_cases

LLAMA = ("--num-layers 12 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
         "--max-position-embeddings 1024 --vocab-size 50257 --global-batch-size 32 "
         "--micro-batch-size 4 --gpu H100-80GB")

# (id, flags, GPUs, expected kind, text the detail must hold)
REGRESSIONS = [
    # --json with a flag given twice: the warning went to stdout, before the JSON
    ("json-warning-to-stderr", f"{LLAMA} --num-gpus 8 --num-layers 12", 8, "ok", ""),
    # --no-sequence-parallel and --pipeline-schedule 1f1b were read as "not given": the plan
    # came back with SP on, and with 16 virtual stages
    ("no-sp-fixes-sp-off", f"{LLAMA} --num-gpus 8 --tensor-model-parallel-size 2 "
     "--no-sequence-parallel", 8, "ok", ""),
    ("1f1b-fixes-one-chunk", f"{LLAMA} --num-gpus 8 --pipeline-model-parallel-size 2 "
     "--pipeline-schedule 1f1b", 8, "ok", ""),
    ("interleaved-needs-chunks", f"{LLAMA} --num-gpus 8 --pipeline-model-parallel-size 2 "
     "--pipeline-schedule interleaved --num-layers-per-virtual-pipeline-stage 3", 8, "ok", ""),
    # the other --no- spellings: searched / assumed on before
    ("no-distributed-optimizer-is-zero-0", f"{LLAMA} --num-gpus 8 "
     "--no-use-distributed-optimizer", 8, "ok", ""),
    ("no-overlap-grad-reduce", f"{LLAMA} --num-gpus 8 --tensor-model-parallel-size 1 "
     "--pipeline-model-parallel-size 1 --zero-stage 1 --no-overlap-grad-reduce", 8, "ok", ""),
    ("1f1b-with-a-layout-string", f"{LLAMA} --num-gpus 8 --pipeline-model-parallel-size 2 "
     "--pipeline-model-parallel-layout Et*5|t*7L --pipeline-schedule 1f1b", 8, "ok", ""),
    ("1f1b-conflicts-with-chunks", f"{LLAMA} --num-gpus 8 --pipeline-model-parallel-size 2 "
     "--pipeline-schedule 1f1b --num-layers-per-virtual-pipeline-stage 3", 8, "refused",
     "--pipeline-schedule 1f1b"),
    # a hybrid model's depth from --hybrid-layer-pattern (no --num-layers): TypeError
    ("hybrid-depth-from-pattern", "--model-type mamba --hybrid-layer-pattern M-M*-M-M*-M- "
     "--hidden-size 1024 --num-attention-heads 8 --mamba-num-heads 32 --vocab-size 50257 "
     "--seq-length 1024 --gpu H100-80GB --num-gpus 8 --global-batch-size 64", 8, "ok", ""),
    ("hybrid-segments-need-pp", "--model-type mamba --hybrid-layer-pattern M-M*|M-M* "
     "--hidden-size 1024 --num-attention-heads 8 --mamba-num-heads 32 --vocab-size 50257 "
     "--seq-length 1024 --gpu H100-80GB --num-gpus 8", 8, "refused",
     "--pipeline-model-parallel-size"),
    # --sequence-parallel at TP 1 (Megatron turns it off): "admits no layout"
    ("sp-at-tp1", f"{LLAMA} --num-gpus 8 --tensor-model-parallel-size 1 --pipeline-model-"
     "parallel-size 2 --sequence-parallel", 8, "ok", ""),
    # Megatron's spellings loom train resolves, dropped by the plan: --use-megatron-fsdp's
    # sharding strategy (ZeRO 3 planned as 1), --num-virtual-stages-per-pipeline-rank (as 1)
    ("megatron-fsdp-zero-stage", f"{LLAMA} --num-gpus 8 --tensor-model-parallel-size 2 "
     "--use-megatron-fsdp --use-distributed-optimizer", 8, "ok", ""),
    ("virtual-stages-per-rank", f"{LLAMA} --num-gpus 8 --pipeline-model-parallel-size 2 "
     "--num-virtual-stages-per-pipeline-rank 3", 8, "ok", ""),
    ("accounted-split-interleaved", f"{LLAMA} --num-layers 6 --num-gpus 8 "
     "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
     "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split", 8, "ok",
     ""),
    # --use-distributed-optimizer at d = 1 (Megatron runs it; the Adam states of one rank)
    ("distributed-optimizer-at-d1", f"{LLAMA} --num-gpus 4 --tensor-model-parallel-size 4 "
     "--use-distributed-optimizer", 4, "ok", ""),
    # ZB-H1 picked on a split only a layout string gives (28 layers over 16 stages), which
    # loom train runs with 1F1B only: the command was refused (loom train also refuses the
    # flags as given, 16 not dividing 28: the plan's command carries the layout)
    ("zero-bubble-not-with-layout-string", f"{LLAMA} --num-layers 28 --num-gpus 16 "
     "--pipeline-model-parallel-size 16 --global-batch-size 256", 16,
     "ok:given-refused-by-train", ""),
    # fixed sizes that cannot tile the GPUs, a pipeline longer than the model: the message
    # blamed the batch ("every (t, p, c) ... leaves a data-parallel size d that does not divide")
    ("sizes-do-not-tile-the-gpus", f"{LLAMA} --num-gpus 3 --tensor-model-parallel-size 2 "
     "--pipeline-model-parallel-size 3", 3, "nofit", "= 6 ranks does not divide the 3 GPUs"),
    ("pipeline-longer-than-the-model", f"{LLAMA} --num-layers 2 --num-gpus 8 "
     "--pipeline-model-parallel-size 4", 8, "nofit", "exceeds --num-layers 2"),
    # a2a+p2p with --hierarchical-context-parallel-sizes: the planner took the node's CP ranks
    # as the all-to-all group (4 at TP 1), found A = c, dropped the type ("admits no layout")
    ("hierarchical-cp-sizes", f"{LLAMA} --num-gpus 8 --tensor-model-parallel-size 1 "
     "--pipeline-model-parallel-size 2 --context-parallel-size 4 --cp-comm-type a2a+p2p "
     "--hierarchical-context-parallel-sizes 2 2", 8, "ok", ""),
    ("hierarchical-cp-sizes-product", f"{LLAMA} --num-gpus 8 --context-parallel-size 2 "
     "--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2", 8, "refused",
     "multiply to 4, not --context-parallel-size 2"),
    # the no-layout diagnosis dropped the pipeline size a given layout string needs and
    # refused "--pipeline-model-parallel-layout needs --pipeline-model-parallel-size"
    ("diagnosis-keeps-the-layouts-pp", f"{LLAMA} --num-gpus 8 --pipeline-model-parallel-size 2 "
     "--pipeline-model-parallel-layout Et*6|t*6L --micro-batch-size 64", 8, "nofit",
     "--micro-batch-size 64 admits no layout"),
    # CP planned for a model loom train runs without it (gpt-oss's --window-size /
    # --softmax-type; BERT, Gated DeltaNet, DSA): the command was refused (gpt-oss-120b at 256
    # GPUs picked CP once main searched MoE models with CP)
    ("no-cp-for-window-attention", f"{LLAMA} --num-gpus 8 --window-size 127,0 "
     "--context-parallel-size 2", 8, "refused", "not supported for --window-size"),
    # --decoder-first-pipeline-num-layers with PP searched (grid:109 once the GPU table grew):
    # the checker read the given count at PP 1 (0) against the command's PP 8 (7)
    ("first-stage-layers-with-pp-searched", "llama3-70b --gpu V100-32GB --num-gpus 12288 "
     "--num-layers 126 --global-batch-size 1536 --seq-length 512 --tensor-model-parallel-size "
     "8 --recompute-granularity selective --decoder-first-pipeline-num-layers 7", 12288, "ok",
     ""),
    # MoE: the dispatcher is searched when not given, kept when given
    ("dispatcher-searched", "mixtral-8x7b --gpu H100-80GB --num-gpus 64 "
     "--expert-model-parallel-size 8", 64, "ok", ""),
    ("dispatcher-given", "mixtral-8x7b --gpu H100-80GB --num-gpus 64 "
     "--expert-model-parallel-size 8 --moe-token-dispatcher-type allgather", 64, "ok", ""),
]


def _case(flags: str, gpus: int) -> Case:
    return Case("regression", "", shlex.split(flags), gpus)


@pytest.mark.parametrize("name,flags,gpus,kind,text", REGRESSIONS,
                         ids=[r[0] for r in REGRESSIONS])
def test_regression_rows(name, flags, gpus, kind, text, tmp_path):
    got, detail = check(_case(flags, gpus), tmp_path)
    assert got == kind and text in detail, (got, detail)


def test_megatron_scripts_sample(tmp_path):
    """A seeded sample of Megatron-LM's example scripts and functional-test cases, at their
    published layout and with their model flags only: no crash, dropped flag or bad command."""
    cases = script_cases()
    sample = random.Random(0).sample(cases, 10)
    bad = [(c.name, c.klass, *check(c, tmp_path)) for c in sample]
    assert not [b for b in bad if is_failure(b[2])], bad


def test_grid_sample(tmp_path):
    """Every ``--gpu`` once and seeded random GPU counts (non-powers of two), odd layer counts,
    tiny and huge batches and given layouts."""
    cases = grid_cases(seed=1, n=6)
    bad = [(c.name, " ".join(c.argv), *check(c, tmp_path)) for c in cases]
    assert not [b for b in bad if is_failure(b[2])], bad


# --from-hf read only gpt2 / llama / mistral / mixtral / qwen2: every other family loom
# converts was refused ("model_type ... is not one of"); now each family's own reader
FROM_HF = ("qwen3-8b", "qwen3-30b-a3b", "gemma3-1b", "mamba2-2.7b", "nemotron-h-8b",
           "bert-large")


def test_from_hf_every_family(tmp_path):
    from benchmarks.plan_sweep import hf_configs
    from loom.planner.command import hf_model_config
    # transformers' GptOssConfig (as openai's config.json) has YaRN's original context 4096,
    # where Megatron's --enable-gpt-oss takes 131072: read as the generic YaRN flags
    # (tests/models/test_gpt_oss.py), it plans
    cases = hf_cases(FROM_HF + ("gpt-oss-20b",), scales=((64, 512),))
    got = {c.name.split("@")[0]: check(c, tmp_path / c.name) for c in cases}
    assert {k: v[0] for k, v in got.items()} == dict.fromkeys(FROM_HF + ("gpt-oss-20b",),
                                                              "ok"), got
    # DeepSeek-V3 read (planning it is the benchmark's: seconds per call)
    path = tmp_path / "deepseek-v3.json"
    path.write_text(__import__("json").dumps(hf_configs(("deepseek-v3",))["deepseek-v3"]))
    m = hf_model_config(str(path))
    assert (m.num_layers, m.num_experts, m.multi_latent_attention, m.mtp_num_layers,
            m.seq_length) == (61, 256, True, 1, 4096)


def test_refusal_after_the_search_prints_nothing_else():
    """``--command-for N`` beyond the table was refused after the table had been printed."""
    from benchmarks.plan_sweep import call
    code, out, err, exc = call(shlex.split(f"{LLAMA} --num-gpus 8 --top 2 --command-for 3"))
    assert (code, out, exc) == (2, "", None) and err.count("\n") == 1 and "--command-for 3" in err


def test_cp_refused_where_the_family_says():
    """The planner's CP refusal for BERT is the family's own rule (``cp_refusal`` in its config
    module, the words its ``check`` raises with), not a branch on the family's name."""
    from loom.models import FamilyRegistry
    from loom.planner.mamba import cp_refusal, refuses_cp
    from dataclasses import replace

    from testkit.config import tiny_model
    gpt = tiny_model("gpt")
    bert = replace(gpt, model_type="bert")
    assert cp_refusal(bert) == FamilyRegistry().cp_refusal(bert)
    assert cp_refusal(bert).startswith("--model-type bert")
    assert refuses_cp(bert, 2) and not refuses_cp(bert, 1)
    assert FamilyRegistry().cp_refusal(gpt) is None and not refuses_cp(gpt, 2)
