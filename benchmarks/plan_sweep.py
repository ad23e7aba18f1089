"""``loom plan`` on configurations nobody tried yet (issue 47's held-out check, as a sweep).

Each case is one ``loom plan`` command line, run in-process (``loom.cli.main``, no subprocess)
with ``--json``. It must end in one of two ways:

* **a plan** (exit 0, or 1 when nothing fits): the JSON parses; the chosen layout honours every
  layout flag given (TP, PP, CP, EP, expert TP, virtual stages / split, micro-batch, recompute
  granularity / method / layers, SP, distributed optimizer / ZeRO stage, schedule, CP comm
  type); its printed ``loom train`` command is accepted by loom train's own validation
  (:func:`loom.planner.command.command_config`, in-process, no process group) and builds the
  same model (every ``ModelConfig`` field) and the same layout (:func:`loom.planner.predict.
  layout_of`) as the flags given;
* **a refusal**: exit 2, one line ``loom plan: error: ...`` on stderr, nothing on stdout.

Anything else is a failure: a traceback (``crash``), a refusal on several lines or after half
the output (``messy-refusal``), a dropped flag (``dropped:<what>``), a command loom train
refuses (``bad-command``), unparsable JSON (``bad-json``). Refusals and no-fit results are
listed with their message, to read for wrong refusals.

Classes of input (:func:`all_cases`):

* ``script-published`` / ``script-default``: Megatron-LM's example scripts
  (tests/integration/megatron_scripts/*.args) and every training case of Megatron-LM's
  functional-test corpus (tests/unit/megatron_corpus.json), at their published layout
  (``loom plan`` with every flag of the script) and with their model flags only (the default
  search), on the script's world size;
* ``examples-conf``: the model flags of Megatron-LM's ``examples/`` configurations (post-training
  and RL model configs, transcribed in :data:`EXAMPLE_MODELS`) at scale, default search;
* ``from-hf``: ``--from-hf`` on a ``config.json`` written by ``transformers``' own config class
  of every family loom converts (Llama 2/3, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, DeepSeek-V3,
  Gemma 3, gpt-oss, Mamba-2, Nemotron-H, BERT, GPT-2) at published sizes;
* ``grid``: every ``--gpu`` name, GPU counts 1..16384 (non-powers of two too), odd layer
  counts, tiny and huge global batches, random given layouts (seeded).

    OMP_NUM_THREADS=1 python -m benchmarks.plan_sweep [--classes grid,from-hf] [--limit N]
        [--seed 0] [--failures-only]

Prints JSON: per class the number tried and failed, and every failure (case, kind, detail).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import re
import shlex
import sys
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "integration" / "megatron_scripts"
CORPUS = REPO / "tests" / "unit" / "megatron_corpus.json"
ENTRY_MODEL_TYPE = {"pretrain_bert.py": "bert", "examples/bert/pretrain_bert.py": "bert",
                    "pretrain_hybrid.py": "mamba", "pretrain_mamba.py": "mamba",
                    "megatron/elastification/pretrain_hybrid_flex.py": "mamba"}


@dataclass
class Case:
    """One ``loom plan`` call: its class, a name, the flags (without ``plan`` and ``--json``)
    and the world size it plans for."""

    klass: str
    name: str
    argv: list
    num_gpus: int
    files: dict = field(default_factory=dict)  # name -> text written under a temporary dir


# -- the layout flags: given ones must come back in the chosen row's command ------------------
LAYOUT_FIELDS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "data_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
    "pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "pipeline_schedule",
    "microbatch_group_size_per_virtual_pipeline_stage", "sequence_parallel", "cp_comm_type",
    "hierarchical_context_parallel_sizes", "micro_batch_size", "use_distributed_optimizer",
    "zero_stage", "use_torch_fsdp2", "recompute_granularity", "recompute_method",
    "recompute_num_layers", "recompute_activations", "use_megatron_fsdp",
    "data_parallel_sharding_strategy")
BATCH_FIELDS = ("global_batch_size", "rampup_batch_size", "step_batch_size_schedule")
LAYOUT_FLAGS = {"--" + f.replace("_", "-") for f in LAYOUT_FIELDS} | {
    "--no-sequence-parallel", "--no-use-distributed-optimizer", "--no-overlap-grad-reduce",
    "--no-overlap-param-gather"}
# what the search fixes from each given flag, compared on layout_of() of both configs
LAYOUT_KEYS = {"--tensor-model-parallel-size": ("tp",), "--pipeline-model-parallel-size": ("pp",),
               "--context-parallel-size": ("cp",), "--expert-model-parallel-size": ("ep",),
               "--expert-tensor-parallel-size": ("etp",),
               "--num-layers-per-virtual-pipeline-stage": ("vp",),
               "--num-virtual-stages-per-pipeline-rank": ("vp",),
               "--pipeline-model-parallel-layout": ("vp", "lf", "ll"),
               "--decoder-first-pipeline-num-layers": ("lf",),
               "--decoder-last-pipeline-num-layers": ("ll",),
               "--micro-batch-size": ("mbs",), "--sequence-parallel": ("sp",),
               "--no-sequence-parallel": ("sp",), "--no-use-distributed-optimizer": ("zero",),
               "--use-distributed-optimizer": ("zero",), "--zero-stage": ("zero",),
               "--use-torch-fsdp2": ("zero",), "--recompute-granularity": ("recompute",),
               "--recompute-activations": ("recompute",),
               "--pipeline-schedule": ("zb", "vp")}  # 1f1b: one chunk, interleaved: more
# config fields compared directly when their flag is given (the same value must come back)
SAME_FIELDS = {"--recompute-method": "recompute_method",
               "--recompute-num-layers": "recompute_num_layers",
               "--cp-comm-type": "cp_comm_type",
               "--hierarchical-context-parallel-sizes": "hierarchical_context_parallel_sizes",
               "--microbatch-group-size-per-virtual-pipeline-stage":
                   "microbatch_group_size_per_virtual_pipeline_stage",
               "--global-batch-size": "global_batch_size",
               "--no-overlap-grad-reduce": "overlap_grad_reduce",  # off: not in the command
               "--no-overlap-param-gather": "overlap_param_gather"}


def groups(words: list) -> list:
    """``--a 1 --b`` -> ``[["--a", "1"], ["--b"]]``."""
    out: list = []
    for w in words:
        if w.startswith("--") or not out:
            out.append([w])
        else:
            out[-1].append(w)
    return out


def _flag_words(argv: list) -> set:
    return {w for w in argv if w.startswith("--")}


def resolve_placeholders(words: list) -> list:
    """A script's flags with its placeholders resolved for planning: a tokenizer ``{TOKENIZER:V}``
    is ``--vocab-size V``, data, checkpoint and log paths (``{DATA}``, ``{CKPT}``, ...) and
    data-only flags dropped (``loom plan`` reads none of them)."""
    given = _flag_words(words)
    out: list = []
    for flag, *values in groups(words):
        text = " ".join(values)
        m = re.fullmatch(r"\{TOKENIZER(?::(\d+))?\}", text)
        if m:
            if m.group(1) and "--vocab-size" not in given and "--vocab-size" not in out:
                out += ["--vocab-size", m.group(1)]
            continue
        if "{" in text or flag in ("--fim-data", "--mock-data"):
            continue
        out += [flag, *values]
    if "--vocab-size" not in out and "--padded-vocab-size" not in given:
        out += ["--vocab-size", "50257"]
    return out


def model_only(argv: list) -> list:
    """``argv`` without its layout and batch flags (the default search of the same model)."""
    drop = LAYOUT_FLAGS | {"--" + f.replace("_", "-") for f in BATCH_FIELDS} | {
        "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size",
        "--num-distributed-optimizer-instances", "--expert-tensor-parallel-size"}
    return [w for g in groups(argv) if g[0] not in drop for w in g]


def _load_args_file(path: Path) -> tuple[dict, list]:
    meta, words = {}, []
    for raw in path.read_text().splitlines():
        if raw.startswith("# ") and ":" in raw and not raw.startswith("#   "):
            key, _, value = raw[2:].partition(":")
            meta.setdefault(key.strip(), value.strip())
        elif raw.strip() and not raw.startswith("#"):
            words += shlex.split(raw)
    return meta, words


def script_cases() -> list:
    """Megatron-LM's example scripts and its functional-test corpus (training cases), at their
    published layout and with the model flags only."""
    sources = []
    for path in sorted(SCRIPTS.glob("*.args")):
        meta, words = _load_args_file(path)
        entry = meta.get("entry", "pretrain_gpt.py").split()[0]
        sources.append((f"script:{path.stem}", words, int(meta["world_size"]), entry))
    corpus = json.loads(CORPUS.read_text())
    for c in corpus["cases"]:
        if c["mode"] == "inference":
            continue
        sources.append((f"corpus:{c['name']}", c["argv"], int(c["world_size"]), c["entry"]))
    out = []
    for name, words, world, entry in sources:
        argv = resolve_placeholders(words)
        if entry in ENTRY_MODEL_TYPE and "--model-type" not in argv:
            argv += ["--model-type", ENTRY_MODEL_TYPE[entry]]
        gpu = ["--gpu", "H100-80GB", "--num-gpus", str(world)]
        out.append(Case("script-published", name, argv + gpu, world))
        out.append(Case("script-default", name, model_only(argv) + gpu, world))
    return out


# Model flags of Megatron-LM d98e8a6 examples/ configurations (transcribed as test data:
# examples/post_training/modelopt/conf/*/*.sh MODEL_ARGS and examples/rl/model_configs/*.sh),
# with the scale each trains at in loom plan: (GPUs, global batch).
EXAMPLE_MODELS = {
    "Qwen3-8B": ("--num-layers 36 --hidden-size 4096 --ffn-hidden-size 12288 "
                 "--num-attention-heads 32 --group-query-attention --num-query-groups 8 "
                 "--kv-channels 128 --qk-layernorm --seq-length 4096 --max-position-embeddings "
                 "40960 --vocab-size 151936 --untie-embeddings-and-output-weights "
                 "--normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope "
                 "--rotary-base 1000000 --swiglu --disable-bias-linear", 64, 512),
    "Qwen3-30B-A3B": ("--num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 "
                      "--num-attention-heads 32 --group-query-attention --num-query-groups 4 "
                      "--kv-channels 128 --qk-layernorm --seq-length 4096 "
                      "--max-position-embeddings 40960 --vocab-size 151936 "
                      "--untie-embeddings-and-output-weights --normalization RMSNorm "
                      "--norm-epsilon 1e-6 --position-embedding-type rope --rotary-base 1000000 "
                      "--swiglu --disable-bias-linear --num-experts 128 --moe-ffn-hidden-size 768 "
                      "--moe-router-topk 8 --moe-router-load-balancing-type aux_loss "
                      "--moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall "
                      "--moe-grouped-gemm", 128, 1024),
    "Qwen3-235B-A22B": ("--num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288 "
                        "--num-attention-heads 64 --group-query-attention --num-query-groups 4 "
                        "--kv-channels 128 --qk-layernorm --seq-length 4096 "
                        "--max-position-embeddings 40960 --vocab-size 151936 "
                        "--untie-embeddings-and-output-weights --normalization RMSNorm "
                        "--norm-epsilon 1e-6 --position-embedding-type rope "
                        "--rotary-base 1000000 --swiglu --disable-bias-linear --num-experts 128 "
                        "--moe-ffn-hidden-size 1536 --moe-router-topk 8 "
                        "--moe-token-dispatcher-type alltoall --moe-grouped-gemm", 1024, 2048),
    "Llama-3.1-8B": ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 "
                     "--num-attention-heads 32 --group-query-attention --num-query-groups 8 "
                     "--seq-length 8192 --max-position-embeddings 131072 --vocab-size 128256 "
                     "--untie-embeddings-and-output-weights --normalization RMSNorm "
                     "--norm-epsilon 1e-5 --position-embedding-type rope --rotary-base 500000 "
                     "--swiglu --disable-bias-linear", 96, 480),
    "Llama-3.2-1B": ("--num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 "
                     "--num-attention-heads 32 --group-query-attention --num-query-groups 8 "
                     "--kv-channels 64 --seq-length 8192 --max-position-embeddings 131072 "
                     "--vocab-size 128256 --normalization RMSNorm --norm-epsilon 1e-5 "
                     "--position-embedding-type rope --rotary-base 500000 --swiglu "
                     "--disable-bias-linear", 24, 96),
    "DeepSeek-V3": ("--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 "
                    "--num-attention-heads 128 --kv-channels 128 --multi-latent-attention "
                    "--q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 "
                    "--qk-pos-emb-head-dim 64 --v-head-dim 128 --seq-length 4096 "
                    "--max-position-embeddings 163840 --vocab-size 129280 "
                    "--untie-embeddings-and-output-weights --normalization RMSNorm "
                    "--norm-epsilon 1e-6 --position-embedding-type rope --rotary-base 10000 "
                    "--swiglu --disable-bias-linear --num-experts 256 --moe-ffn-hidden-size 2048 "
                    "--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 "
                    "--moe-layer-freq ([0]*3+[1]*58) --moe-router-score-function sigmoid "
                    "--moe-router-enable-expert-bias --moe-router-num-groups 8 "
                    "--moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5 "
                    "--moe-token-dispatcher-type alltoall --moe-grouped-gemm "
                    "--mtp-num-layers 1", 2048, 4096),
    "gpt-oss-120b": ("--num-layers 36 --hidden-size 2880 --ffn-hidden-size 2880 "
                     "--num-attention-heads 64 --group-query-attention --num-query-groups 8 "
                     "--kv-channels 64 --seq-length 4096 --max-position-embeddings 131072 "
                     "--vocab-size 201088 --untie-embeddings-and-output-weights "
                     "--normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope "
                     "--rotary-base 150000 --swiglu --num-experts 128 --moe-ffn-hidden-size 2880 "
                     "--moe-router-topk 4 --moe-token-dispatcher-type alltoall "
                     "--moe-grouped-gemm --add-qkv-bias --enable-gpt-oss --window-size 128,0 "
                     "--window-attn-skip-freq 2 --softmax-type learnable", 256, 512),
    "Nemotron-H-8B": ("--model-type mamba --num-layers 52 --hidden-size 4096 "
                      "--ffn-hidden-size 21504 --num-attention-heads 32 --group-query-attention "
                      "--num-query-groups 8 --kv-channels 128 --hybrid-layer-pattern "
                      "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M- "
                      "--mamba-state-dim 128 --mamba-head-dim 64 --mamba-num-groups 8 "
                      "--squared-relu --seq-length 8192 --max-position-embeddings 8192 "
                      "--vocab-size 131072 --untie-embeddings-and-output-weights "
                      "--normalization RMSNorm --position-embedding-type none "
                      "--disable-bias-linear", 384, 768),
    "Qwen2.5-32B": ("--num-layers 64 --hidden-size 5120 --ffn-hidden-size 27648 "
                    "--num-attention-heads 40 --group-query-attention --num-query-groups 8 "
                    "--seq-length 4096 --max-position-embeddings 32768 --vocab-size 152064 "
                    "--untie-embeddings-and-output-weights --normalization RMSNorm "
                    "--norm-epsilon 1e-5 --position-embedding-type rope --rotary-base 1000000 "
                    "--swiglu --disable-bias-linear --add-qkv-bias", 1536, 1536),
}


def example_cases() -> list:
    out = []
    for name, (flags, n, B) in EXAMPLE_MODELS.items():
        argv = shlex.split(flags) + ["--gpu", "H100-80GB", "--num-gpus", str(n),
                                     "--global-batch-size", str(B)]
        out.append(Case("examples-conf", name, argv, n))
    return out


# -- Hugging Face configs from transformers' own classes ----------------------------------------
def hf_configs(names=None) -> dict:
    """``{name: config dict}`` from ``transformers`` config classes at published sizes (no
    network: the classes' defaults plus the sizes); ``names``: those only."""
    import transformers as tf
    made = {
        "llama2-7b": lambda: tf.LlamaConfig(hidden_size=4096, intermediate_size=11008,
                                            num_hidden_layers=32, num_attention_heads=32,
                                            num_key_value_heads=32, vocab_size=32000,
                                            max_position_embeddings=4096),
        "llama2-70b": lambda: tf.LlamaConfig(hidden_size=8192, intermediate_size=28672,
                                             num_hidden_layers=80, num_attention_heads=64,
                                             num_key_value_heads=8, vocab_size=32000,
                                             max_position_embeddings=4096),
        "llama3-8b": lambda: tf.LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                            num_hidden_layers=32, num_attention_heads=32,
                                            num_key_value_heads=8, vocab_size=128256,
                                            max_position_embeddings=8192, rope_theta=500000.0),
        "llama3-405b": lambda: tf.LlamaConfig(hidden_size=16384, intermediate_size=53248,
                                              num_hidden_layers=126, num_attention_heads=128,
                                              num_key_value_heads=8, vocab_size=128256,
                                              max_position_embeddings=131072,
                                              rope_theta=500000.0),
        "mistral-7b": lambda: tf.MistralConfig(),
        "qwen2-7b": lambda: tf.Qwen2Config(hidden_size=3584, intermediate_size=18944,
                                           num_hidden_layers=28, num_attention_heads=28,
                                           num_key_value_heads=4, vocab_size=152064,
                                           max_position_embeddings=32768),
        "qwen3-8b": lambda: tf.Qwen3Config(hidden_size=4096, intermediate_size=12288,
                                           num_hidden_layers=36, num_attention_heads=32,
                                           num_key_value_heads=8, head_dim=128,
                                           vocab_size=151936, max_position_embeddings=40960),
        "qwen3-30b-a3b": lambda: tf.Qwen3MoeConfig(
            hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_experts=128, num_experts_per_tok=8, vocab_size=151936,
            max_position_embeddings=40960),
        "qwen2-57b-a14b": lambda: tf.Qwen2MoeConfig(
            hidden_size=3584, intermediate_size=18944, moe_intermediate_size=2560,
            shared_expert_intermediate_size=20480, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, num_experts=64,
            num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=32768),
        "mixtral-8x7b": lambda: tf.MixtralConfig(),
        "mixtral-8x22b": lambda: tf.MixtralConfig(hidden_size=6144, intermediate_size=16384,
                                                  num_hidden_layers=56, num_attention_heads=48,
                                                  num_key_value_heads=8, vocab_size=32768,
                                                  max_position_embeddings=65536),
        "deepseek-v3": lambda: tf.DeepseekV3Config(),
        "gemma3-1b": lambda: tf.Gemma3TextConfig(hidden_size=1152, intermediate_size=6912,
                                                 num_hidden_layers=26, num_attention_heads=4,
                                                 num_key_value_heads=1, head_dim=256,
                                                 vocab_size=262144,
                                                 max_position_embeddings=32768),
        "gemma3-27b": lambda: tf.Gemma3TextConfig(hidden_size=5376, intermediate_size=21504,
                                                  num_hidden_layers=62, num_attention_heads=32,
                                                  num_key_value_heads=16, head_dim=128,
                                                  vocab_size=262208,
                                                  max_position_embeddings=131072),
        "gpt-oss-20b": lambda: tf.GptOssConfig(),
        "gpt-oss-120b": lambda: tf.GptOssConfig(num_hidden_layers=36, num_local_experts=128),
        "mamba2-2.7b": lambda: tf.Mamba2Config(hidden_size=2560, num_hidden_layers=64,
                                               num_heads=80, head_dim=64, vocab_size=50288,
                                               n_groups=1, state_size=128),
        "nemotron-h-8b": lambda: tf.NemotronHConfig(  # Nemotron-H 8B: 52 layers, no MoE
            hidden_size=4096, intermediate_size=21504, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, mamba_num_heads=128, mamba_head_dim=64,
            n_groups=8, ssm_state_size=128, vocab_size=131072,
            layers_block_type=[NEMOTRON_KINDS[ch] for ch in
                               "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"]),
        "bert-large": lambda: tf.BertConfig(hidden_size=1024, num_hidden_layers=24,
                                            num_attention_heads=16, intermediate_size=4096),
        "gpt2-xl": lambda: tf.GPT2Config(n_embd=1600, n_layer=48, n_head=25),
    }
    out = {}
    for name, make in made.items():
        if names is not None and name not in names:
            continue
        try:
            out[name] = make().to_dict()
        except (AttributeError, TypeError, ValueError) as e:  # a class this transformers lacks
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


NEMOTRON_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
HF_SCALES = ((8, 256), (96, 768), (1024, 2048))


def hf_cases(names=None, scales=HF_SCALES) -> list:
    out = []
    for name, cfg in hf_configs(names).items():
        for n, B in scales:
            out.append(Case("from-hf", f"{name}@{n}", ["--from-hf", "{DIR}/" + name +
                                                        "/config.json", "--gpu", "H100-80GB",
                                                        "--num-gpus", str(n),
                                                        "--global-batch-size", str(B)], n,
                            files={f"{name}/config.json": json.dumps(cfg)}))
    return out


# -- the grid: GPUs, counts, layers, batches, given layouts -------------------------------------
COUNTS = (1, 2, 3, 6, 8, 12, 24, 96, 100, 384, 1000, 1536, 4096, 12288, 16384)
LAYERS = (1, 7, 28, 61, 126)
MODELS = ("llama3-8b", "llama3-70b", "gpt3-175b", "mixtral-8x7b", "deepseek-v3")


def grid_cases(seed: int = 0, n: int = 300) -> list:
    """``n`` random (seeded) combinations of a preset, a GPU, a count, a layer count, a batch
    and a subset of given layout flags."""
    from loom.planner.hardware import DEVICES
    rng = random.Random(seed)
    gpus = list(DEVICES)
    out = []
    for gpu in gpus:  # every GPU once, default search
        out.append(Case("grid", f"gpu:{gpu}", ["llama3-8b", "--gpu", gpu, "--num-gpus", "24",
                                                "--global-batch-size", "96"], 24))
    for i in range(n):
        model = rng.choice(MODELS)
        gpu = rng.choice(gpus)
        g = rng.choice(COUNTS)
        L = rng.choice(LAYERS)
        B = rng.choice((1, 3, g, 2 * g, 1536, 65536))
        argv = [model, "--gpu", gpu, "--num-gpus", str(g), "--num-layers", str(L),
                "--global-batch-size", str(B)]
        if rng.random() < 0.3:
            argv += ["--seq-length", str(rng.choice((512, 4096, 32768, 131072)))]
        if rng.random() < 0.5:
            argv += ["--tensor-model-parallel-size", str(rng.choice((1, 2, 4, 8)))]
        if rng.random() < 0.5:
            argv += ["--pipeline-model-parallel-size", str(rng.choice((1, 2, 3, 4, 8, 16)))]
        if rng.random() < 0.2:
            argv += ["--context-parallel-size", str(rng.choice((2, 4, 16)))]
        if rng.random() < 0.2:
            argv += ["--micro-batch-size", str(rng.choice((1, 2, 4)))]
        if rng.random() < 0.2:
            argv += ["--recompute-granularity", rng.choice(("selective", "full"))]
        if rng.random() < 0.2:
            argv += ["--sequence-parallel"]
        if rng.random() < 0.2:
            argv += ["--use-distributed-optimizer"]
        if rng.random() < 0.15:
            argv += ["--num-layers-per-virtual-pipeline-stage", str(rng.choice((1, 2, 4)))]
        if rng.random() < 0.15:
            argv += ["--decoder-first-pipeline-num-layers", str(rng.choice((1, 3, 7)))]
        if rng.random() < 0.15 and model in ("mixtral-8x7b", "deepseek-v3"):
            argv += ["--expert-model-parallel-size", str(rng.choice((2, 8, 64)))]
        more = random.Random(f"{seed}:{i}")  # later flags: the draws above stay as they were
        if more.random() < 0.1 and "--sequence-parallel" not in argv:
            argv += ["--no-sequence-parallel"]
        if more.random() < 0.2:
            argv += ["--pipeline-schedule", more.choice(("1f1b", "interleaved", "gpipe",
                                                         "zero-bubble", "zbv"))]
        if more.random() < 0.1 and "--use-distributed-optimizer" not in argv:
            argv += ["--no-use-distributed-optimizer"]
        if more.random() < 0.1:
            argv += [more.choice(("--no-overlap-grad-reduce", "--no-overlap-param-gather"))]
        out.append(Case("grid", f"grid:{i}", argv, g))
    return out


def all_cases(classes=None, seed: int = 0, grid_n: int = 300) -> list:
    makers = {"script": script_cases, "examples-conf": example_cases, "from-hf": hf_cases,
              "grid": lambda: grid_cases(seed, grid_n)}
    out = []
    for key, make in makers.items():
        if classes is None or key in classes:
            out += make()
    return out


# -- one call -----------------------------------------------------------------------------------
def call(argv: list) -> tuple:
    """``loom plan ARGV`` in-process: ``(exit code, stdout, stderr, exception or None)``."""
    from loom.cli import main
    out, err = io.StringIO(), io.StringIO()
    code, exc = 0, None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            r = main(["plan", *argv])
            code = 0 if r is None else r
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception as e:  # noqa: BLE001 - a crash is what the sweep looks for
            exc = e
    return code, out.getvalue(), err.getvalue(), exc


def _given_config(argv: list, num_gpus: int):
    """The config ``loom train`` builds from the same flags (layout and model), or the
    ConfigError text."""
    from loom.config import LoomConfig
    from loom.planner.command import command_config
    names = {f.name for sec in ("model", "parallel") for f in fields(getattr(LoomConfig(), sec))}
    names |= set(LAYOUT_FIELDS) | set(BATCH_FIELDS)
    flags = {"--" + n.replace("_", "-") for n in names}
    flags |= {"--no-" + f[2:] for f in flags} | {"--hybrid-layer-pattern", "--hybrid-override-pattern"}
    keep = [w for g in groups(argv) if g[0] in flags for w in g]
    if "--micro-batch-size" not in keep:  # loom train requires it; the plan's is compared
        keep += ["--micro-batch-size", "1"]
    text = "loom train " + " ".join(shlex.quote(w) for w in keep)
    return command_config(text, num_gpus)




def check(case: Case, tmp: Path) -> tuple:
    """``(kind, detail)``: ``ok`` / ``refused`` / ``nofit`` or a failure kind."""
    from loom.errors import ConfigError
    from loom.planner.command import command_config
    from loom.planner.predict import layout_of
    for rel, text in case.files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    argv = [w.replace("{DIR}", str(tmp)) for w in case.argv]
    code, out, err, exc = call(argv + ["--json", "--top", "1"])
    if exc is not None:
        import traceback
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        return "crash", f"{type(exc).__name__}: {exc} at {Path(tb.filename).name}:{tb.lineno}"
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("loom plan: warning: ")]
    if code == 2:  # one error line (unknown flags: one indented line more each), no output
        if out.strip() or not lines or not lines[0].startswith("loom plan: error: ") or \
                any(not ln.startswith(("  --", "  ... and ")) for ln in lines[1:]):
            return "messy-refusal", (out[-300:] + " | " + err[-600:]).strip()
        return "refused", "\n".join(lines)[len("loom plan: error: "):]
    if code not in (0, 1):
        return "crash", f"exit {code}: {err[-500:]}"
    try:
        doc = json.loads(out)
    except json.JSONDecodeError as e:
        return "bad-json", f"{e}: {out[:200]!r}"
    if not doc.get("layouts"):
        return "nofit", doc.get("error", "nothing fits")[:300]
    rec = doc["layouts"][0]
    try:
        got = command_config(rec["command"], case.num_gpus)
    except ConfigError as e:
        return "bad-command", str(e)[:400]
    except SystemExit as e:
        return "bad-command", f"flags refused (exit {e.code})"
    try:
        if argv[0].startswith("--") and "--from-hf" not in argv:
            want = _given_config(argv, case.num_gpus)
        else:  # a preset or a config.json: the plan's model with the layout flags given
            model = [w for g in groups(_words(rec["command"])) if g[0] not in LAYOUT_FLAGS
                     and g[0] not in ("--global-batch-size", "--ddp-bucket-size",
                                      "--overlap-grad-reduce", "--overlap-param-gather")
                     for w in g]
            layout = [w for g in groups(argv) if g[0] in LAYOUT_FLAGS | {"--global-batch-size"}
                      for w in g]
            want = _given_config(model + layout, case.num_gpus)
    except (ConfigError, SystemExit) as e:  # loom train refuses the given flags themselves
        return "ok:given-refused-by-train", str(e)[:300]
    if lines:
        return "stderr", "\n".join(lines)[:300]
    given = _flag_words(argv)
    lw, lg = layout_of(want, case.num_gpus), layout_of(got, case.num_gpus)
    if "--tensor-model-parallel-size" not in given:  # SP given, TP searched: SP where t > 1
        lw["tp"] = lg["tp"]
    first_last = (want.parallel.decoder_first_pipeline_num_layers,
                  want.parallel.decoder_last_pipeline_num_layers)
    if "--pipeline-model-parallel-size" not in given and lw["pp"] != lg["pp"] and any(
            v is not None for v in first_last):
        # PP searched: the given first / last stage counts, at the p the search chose
        from loom.planner.stages import given_split
        lw["lf"], lw["ll"] = given_split(want.model.num_layers, lg["pp"], *first_last) or (0, 0)
    for lay in (lw, lg):  # Megatron and loom: SP is off at TP 1 (arguments.py); expert TP 0: t
        lay["sp"] = int(bool(lay["sp"]) and lay["tp"] > 1)
        lay["etp"] = lay["etp"] or lay["tp"]
    for f, keys in LAYOUT_KEYS.items():
        if f in given:
            for k in keys:
                if lw[k] != lg[k]:
                    return f"dropped:{k}", f"{f}: given {lw[k]}, command {lg[k]}"
    flat_w, flat_g = _flat(want), _flat(got)
    for f, name in SAME_FIELDS.items():
        if name.startswith("recompute_") and flat_w["recompute_granularity"] != "full":
            continue  # the method and layer count of full recomputation only
        if f in given and flat_w[name] != flat_g[name]:
            return f"dropped:{name}", f"{f}: given {flat_w[name]!r}, command {flat_g[name]!r}"
    mw, mg = asdict(want.model), asdict(got.model)
    for k in mw:
        if mw[k] != mg[k] and k not in ("max_position_embeddings",):
            if "--from-hf" in given:  # the file's model: the command is what loom plan read
                continue
            if k == "moe_token_dispatcher_type" and "--moe-token-dispatcher-type" not in given:
                continue  # not given: the search's choice (loom.planner.moe.DISPATCHERS)
            return "dropped:model", f"{k}: given {mw[k]!r}, command {mg[k]!r}"
    return "ok", f"{rec['tp']}/{rec['pp']}/{rec['cp']}/{rec.get('ep', 1)} mfu {rec['mfu']:.3f}"


def _words(command: str) -> list:
    """The flags of a printed ``loom train`` command."""
    words = shlex.split("\n".join(ln for ln in command.splitlines()
                                   if not ln.startswith("#")).replace("\\\n", " "))
    return words[words.index("train") + 1:]


def _flat(cfg) -> dict:
    out = {}
    for sec in ("parallel", "training"):
        part = getattr(cfg, sec)
        out.update({f.name: getattr(part, f.name) for f in fields(part)})
    return out


FAILURES = ("crash", "messy-refusal", "bad-json", "bad-command", "stderr")


def is_failure(kind: str) -> bool:
    return kind in FAILURES or kind.startswith("dropped:")


def sweep(cases: list) -> dict:
    """Run every case; ``{class: {tried, failed, kinds, failures: [...], refusals: [...]}}``."""
    report: dict = {}
    with tempfile.TemporaryDirectory() as d:
        for i, case in enumerate(cases):
            tmp = Path(d) / str(i)
            tmp.mkdir()
            kind, detail = check(case, tmp)
            r = report.setdefault(case.klass, {"tried": 0, "failed": 0, "kinds": {},
                                               "failures": [], "refusals": []})
            r["tried"] += 1
            r["kinds"][kind] = r["kinds"].get(kind, 0) + 1
            row = {"case": case.name, "kind": kind, "detail": detail,
                   "argv": " ".join(shlex.quote(w) for w in case.argv)}
            if is_failure(kind):
                r["failed"] += 1
                r["failures"].append(row)
            elif kind in ("refused", "nofit", "ok:given-refused-by-train"):
                r["refusals"].append(row)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--classes", default=None,
                    help="comma-separated: script, examples-conf, from-hf, grid")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid", type=int, default=300, help="random grid cases")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--failures-only", action="store_true")
    ap.add_argument("--summary", action="store_true", help="counts only")
    args = ap.parse_args()
    classes = set(args.classes.split(",")) if args.classes else None
    cases = all_cases(classes, args.seed, args.grid)[:args.limit]
    report = sweep(cases)
    if args.summary:
        report = {k: {"tried": v["tried"], "failed": v["failed"], "kinds": v["kinds"]}
                  for k, v in report.items()}
    elif args.failures_only:
        for v in report.values():
            v.pop("refusals")
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
