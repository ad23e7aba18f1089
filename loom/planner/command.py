"""What ``loom plan`` hands over: the ``torchrun ... -m loom train`` command of a layout, the
legend of the table's columns, and a model read from a Hugging Face ``config.json``.

Torch-free (the planner imports only the config).
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import fields
from typing import Any, Sequence
from types import SimpleNamespace

from loom.config import ConfigError, ModelConfig, flag
from loom.config.model_rope import rope_fields

LEGEND = """\
columns: #  rank (best first; --command-for N prints row N's command)
  tp   --tensor-model-parallel-size t        pp   --pipeline-model-parallel-size p
  dp   data-parallel replicas d = GPUs / (t p c), derived from the world size
  ep   --expert-model-parallel-size (MoE; re-folds the tp x dp ranks, not extra GPUs);
       "etp u" after a row: --expert-tensor-parallel-size u (each expert over u ranks; else t);
       "ep D" after a row: --moe-token-dispatcher-type D (searched unless given)
  cp   --context-parallel-size c
  vp   model chunks per pipeline stage (interleaved 1F1B when > 1); loom train takes it as
       --num-layers-per-virtual-pipeline-stage = L / (p x vp) LAYERS per chunk
  mbs  --micro-batch-size b                  recompute  --recompute-granularity (none: off)
  sp   --sequence-parallel (y/n)             z    ZeRO stage (1 = --use-distributed-optimizer)
  memory per GPU, GB (1e9 bytes): W weights, G gradients, O optimizer states, A activations
       kept for the backward pass, E embedding / output-layer activations and logits,
       R reserve (CUDA context, workspaces, fragmentation); total = their sum
  iter s  predicted seconds per iteration     tok/s  tokens per second of the whole job
  TFLOP/s model FLOPs per GPU per second (6 x params x tokens plus attention, no recompute)
  hw   hardware TFLOP/s per GPU, recomputation included
  MFU  model FLOPs utilization = TFLOP/s / the GPU's peak"""


def model_flags(model: ModelConfig, seq_length: int) -> list[str]:
    """``loom train`` flags of ``model``: the shape always, every other field that differs from
    the default."""
    default = ModelConfig()
    always = {"num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"}
    out: list[str] = []
    for f in fields(ModelConfig):
        value = seq_length if f.name == "seq_length" else getattr(model, f.name)
        if f.name not in always and (value == getattr(default, f.name) or value is None):
            continue
        if isinstance(value, bool):
            out += [flag(f.name)] if value else ["--no-" + flag(f.name)[2:]]
        else:
            out += [flag(f.name), f"{value:g}" if isinstance(value, float) else str(value)]
    return out


def loom_takes_layout_string() -> bool:
    """Whether ``loom train``'s config has ``--pipeline-model-parallel-layout`` (the placement,
    :mod:`loom.config.pipeline_layout`, runs any split; the flag and its validation belong
    to :mod:`loom.config`)."""
    from loom.config import ParallelConfig
    return "pipeline_model_parallel_layout" in {f.name for f in fields(ParallelConfig)}


def split_flags(rec: dict, model: ModelConfig) -> list[str]:
    """The pipeline-split flags of a record: none for the even split;
    ``--num-layers-per-virtual-pipeline-stage N`` for even chunks; ``--decoder-first/last-
    pipeline-num-layers`` for uneven ends with even middle ranks and one chunk; otherwise (any
    other split, or one given as a layout) Megatron's ``--pipeline-model-parallel-layout``."""
    p, v = rec["pp"], rec["vp"]
    chunks = rec.get("chunk_layers")
    if p == 1 or rec.get("pipeline_schedule") == "zbv":
        return []
    if chunks is None:  # a record without its layout: the even split or the first/last flags
        chunks = [model.num_layers // (p * v)] * (p * v)
        if rec.get("first_stage_layers"):
            return ["--decoder-first-pipeline-num-layers", str(rec["first_stage_layers"]),
                    "--decoder-last-pipeline-num-layers", str(rec["last_stage_layers"])]
    if not rec.get("layout_given"):
        if len(set(chunks)) == 1:
            return ["--num-layers-per-virtual-pipeline-stage", str(chunks[0])] if v > 1 else []
        ranks = [sum(chunks[k * p + r] for k in range(v)) for r in range(p)]
        middle = set(ranks[1:-1])
        if v == 1 and len(middle) <= 1:
            mid = middle.pop() if middle else None
            out = []
            if ranks[0] != mid:
                out += ["--decoder-first-pipeline-num-layers", str(ranks[0])]
            if ranks[-1] != mid:
                out += ["--decoder-last-pipeline-num-layers", str(ranks[-1])]
            return out
    return ["--pipeline-model-parallel-layout", rec["pipeline_layout"]]


def dp_overlap_flags(rec: dict, opts=None) -> list[str]:
    """The data-parallel overlap flags the planner's time of ``rec`` assumed under ``opts`` (a
    :class:`~loom.planner.layout.Options`; None: its defaults, both overlapped):
    ``--overlap-grad-reduce`` where a gradient reduction exists (``d x c > 1``) and loom's
    gradient buffer runs it (ZeRO 0-2; FSDP2 overlaps its own, ZeRO-3 ignores the flag),
    ``--overlap-param-gather`` where the distributed optimizer all-gathers the weights (ZeRO 1
    and 2, ``d x c > 1``; loom train refuses it without that optimizer)."""
    from loom.planner.layout import Options, param_gather_overlapped
    opts = opts or Options()
    if rec.get("dp", 1) * rec["cp"] <= 1 or rec["zero"] >= 3:
        return []
    out = ["--overlap-grad-reduce"] if opts.overlap_grad_reduce else []
    if rec["zero"] >= 1 and param_gather_overlapped(opts):
        out.append("--overlap-param-gather")
    return out


def bucket_flags(rec: dict, opts=None) -> list[str]:
    """``--ddp-bucket-size N``: the gradient bucket the plan's DP time assumed (the overlap's
    exposed last bucket, one latency per bucket), where loom's gradient buffer reduces (``d x c
    > 1``, ZeRO 0-2) and the plan used Megatron-Core's ``max(40M, 1M d)`` rather than loom
    train's own default (``Options.ddp_bucket_count``; :func:`loom.planner.dp_overlap.bucket_elems`)."""
    from loom.planner.layout import Options
    from loom.planner.dp_overlap import bucket_elems
    opts = opts or Options()
    n_dp = rec.get("dp", 1) * rec["cp"]
    if n_dp <= 1 or rec["zero"] >= 3 or opts.ddp_bucket_count:
        return []
    return ["--ddp-bucket-size", str(int(bucket_elems(n_dp, opts)))]


def layout_flags(rec: dict, model: ModelConfig, global_batch_size: int,
                 opts=None) -> list[str]:
    """``loom train`` flags of one planner record (:func:`loom.planner.search.record`), planned
    under ``opts`` (:class:`~loom.planner.layout.Options`, None: the defaults): its DP overlap
    flags and bucket size too (:func:`dp_overlap_flags`, :func:`bucket_flags`), so the command
    runs what the plan timed."""
    out = ["--tensor-model-parallel-size", str(rec["tp"]),
           "--pipeline-model-parallel-size", str(rec["pp"]),
           "--context-parallel-size", str(rec["cp"])]
    if rec.get("ep", 1) > 1:
        out += ["--expert-model-parallel-size", str(rec["ep"])]
    if rec.get("etp", rec["tp"]) != rec["tp"]:  # expert TP other than Megatron's default t
        out += ["--expert-tensor-parallel-size", str(rec["etp"])]
    disp = rec.get("moe_token_dispatcher_type", model.moe_token_dispatcher_type)
    if model.num_experts and disp != model.moe_token_dispatcher_type:  # the search chose it
        out += ["--moe-token-dispatcher-type", disp]
    out += split_flags(rec, model)
    if rec.get("pipeline_schedule", "1f1b") != "1f1b":  # ZB-H1 / ZB-V (loom's names)
        out += ["--pipeline-schedule", rec["pipeline_schedule"]]
    if rec.get("microbatch_group_size", rec["pp"]) != rec["pp"]:  # interleaved, N > p
        out += ["--microbatch-group-size-per-virtual-pipeline-stage",
                str(rec["microbatch_group_size"])]
    if rec["sequence_parallel"]:
        out.append("--sequence-parallel")
    if rec["recompute"] != "none":
        out += ["--recompute-granularity", rec["recompute"]]
    if rec["recompute"] == "full" and rec.get("recompute_num_layers"):  # the first N of a chunk
        out += ["--recompute-method", "block", "--recompute-num-layers",
                str(rec["recompute_num_layers"])]
    elif rec["recompute"] == "full":  # what the planner models (each layer's input kept);
        out += ["--recompute-method", "uniform", "--recompute-num-layers", "1"]  # Megatron: both
    if rec["cp"] > 1 and rec.get("cp_comm_type", "p2p") != "p2p":
        out += ["--cp-comm-type", rec["cp_comm_type"]]
        if rec["cp_comm_type"] == "a2a+p2p":  # all-to-all inside the node, ring across
            k = rec.get("cp_a2a_size", 1)
            out += ["--hierarchical-context-parallel-sizes", str(k), str(rec["cp"] // k)]
    if rec["zero"] >= 2:
        out += ["--zero-stage", str(rec["zero"])]  # 2: gradients sharded; 3: FSDP2
    elif rec["zero"] == 1:
        out.append("--use-distributed-optimizer")
    out += dp_overlap_flags(rec, opts) + bucket_flags(rec, opts)
    return out + ["--micro-batch-size", str(rec["micro_batch_size"]),
                  "--global-batch-size", str(global_batch_size)]


def grad_dtype_flags(opts, precision: str | None) -> list[str]:
    """The flag that makes loom train keep the gradient buffer the plan priced
    (``opts.grad_bytes``; :func:`loom.planner.cli_args.gradient_option`): ``--grad-reduce-in-bf16``
    for 2-byte gradients under bf16, ``--accumulate-allreduce-grads-in-fp32`` for 4-byte ones
    under fp16; none where the precision's default already is it."""
    grad = opts.grad_bytes if opts is not None else 4
    if precision == "bf16" and grad == 2:
        return ["--grad-reduce-in-bf16"]
    if precision == "fp16" and grad == 4:
        return ["--accumulate-allreduce-grads-in-fp32"]
    return []


def optimizer_flags(args) -> list[str]:
    """The optimizer flags of ``args`` (loom plan's) whose states the plan priced
    (:func:`loom.planner.cli_args.optimizer_option`), for loom train to keep the same:
    ``--optimizer`` other than adam (with ``--sgd-momentum`` when given; Muon with the
    ``--muon-*`` flags its step was priced with), and
    ``--use-precision-aware-optimizer`` with its dtypes other than fp32."""
    from loom.config.optimizer_precision import STATE_DTYPE_FLAGS
    out = []
    name = getattr(args, "optimizer", None)
    if name and name != "adam":
        out += ["--optimizer", name]
        if getattr(args, "sgd_momentum", None) is not None and name == "sgd":
            out += ["--sgd-momentum", str(args.sgd_momentum)]
    if name in ("muon", "dist_muon"):  # the settings its step was priced with
        for field in ("muon_num_ns_steps", "muon_tp_mode", "muon_fp32_matmul_prec"):
            if getattr(args, field, None) is not None:
                out += [flag(field), str(getattr(args, field))]
        if getattr(args, "muon_split_qkv", None) is False:
            out.append("--muon-no-split-qkv")
    if getattr(args, "use_precision_aware_optimizer", False):
        out.append("--use-precision-aware-optimizer")
        for field, flag_name in STATE_DTYPE_FLAGS:
            value = getattr(args, field, None)
            if value and value != "fp32":
                out += [flag_name, value]
        if getattr(args, "optimizer_cpu_offload", False):
            out.append("--optimizer-cpu-offload")
            if getattr(args, "optimizer_offload_fraction", None) is not None:
                out += ["--optimizer-offload-fraction", str(args.optimizer_offload_fraction)]
    return out


def train_command(rec: dict, model: ModelConfig, global_batch_size: int, seq_length: int,
                  num_gpus: int, gpus_per_node: int, opts=None, precision: str = "bf16",
                  optimizer: Sequence[str] = ()) -> str:
    """The shell command that runs layout ``rec``: ``torchrun [--standalone] --nproc-per-node G [--nnodes N
    --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500] -m loom train FLAGS``, one flag per
    continued line; data, length and learning rate (``--data-path`` / ``--train-iters`` /
    ``--lr``, which Megatron requires) are for the user to
    add. A split that only ``--pipeline-model-parallel-layout`` expresses is given as that
    flag; while loom train's config lacks it (:func:`loom_takes_layout_string`) a comment line
    says so. ``opts``: the :class:`~loom.planner.layout.Options` the plan used (its DP
    overlap flags, :func:`dp_overlap_flags`, and gradient dtype, :func:`grad_dtype_flags`; None:
    the defaults). ``precision``: ``--bf16``
    or ``--fp16``, the 16-bit training the planner prices (loom train, as Megatron, trains in
    fp32 without either); None when the user asked for fp32 (``--no-bf16``), which the plan
    names as not priced. ``optimizer``: the optimizer flags the plan priced
    (:func:`optimizer_flags`)."""
    if precision not in ("bf16", "fp16", None):
        raise ValueError(f"precision {precision!r}: the planner prices bf16 or fp16 (None: the "
                         f"user asked for fp32, no flag)")
    if "dp" not in rec:  # a hand-made record: d from the world size
        rec = dict(rec, dp=num_gpus // (rec["tp"] * rec["pp"] * rec["cp"]))
    per_node = min(num_gpus, gpus_per_node)
    nodes = math.ceil(num_gpus / per_node)
    launch = ["torchrun", "--nproc-per-node", str(per_node)]
    if nodes == 1:
        launch.insert(1, "--standalone")  # a local rendezvous on a free port
    else:
        launch += ["--nnodes", str(nodes), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", "$MASTER_ADDR:29500"]
    words = [shlex.quote(w) for w in
             model_flags(model, seq_length) + layout_flags(rec, model, global_batch_size, opts)
             + ([f"--{precision}"] if precision else []) + grad_dtype_flags(opts, precision)
             + list(optimizer)]
    pairs, i = [], 0
    while i < len(words):  # "--flag value [value ...]" together on one line
        take = 1
        while i + take < len(words) and not words[i + take].startswith("--"):
            take += 1
        pairs.append(" ".join(words[i:i + take]))
        i += take
    lines = [" ".join(launch) + " -m loom train"] + pairs
    text = " \\\n    ".join(lines)
    if "--pipeline-model-parallel-layout" in words and not loom_takes_layout_string():
        text = ("# this split needs --pipeline-model-parallel-layout, which Megatron-LM takes and "
                "loom train's config does not yet (loom.config.pipeline_layout places it)\n"
                + text)
    return text


def command_config(text: str, num_gpus: int):
    """The validated :class:`~loom.config.LoomConfig` that ``loom train`` would build from a
    :func:`train_command` text (its flags after ``-m loom train`` plus ``--mock-data``,
    ``--train-iters 1``, ``--lr 3e-4``) at ``num_gpus`` ranks; raises ConfigError as loom train
    would. How the tests check that every ranked row's command runs."""
    import argparse
    from loom.config import add_config_arguments, config_from_args
    from loom.models import resolve_config
    words = shlex.split("\n".join(ln for ln in text.splitlines()
                                   if not ln.startswith("#")).replace("\\\n", " "))
    argv = words[words.index("train") + 1:] + ["--mock-data", "--train-iters", "1",
                                                "--lr", "3e-4"]
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_config_arguments(parser)
    return resolve_config(config_from_args(parser.parse_args(argv)), num_gpus)


# Hugging Face config.json keys -> loom fields, per layout (LLaMA family, GPT-2)
_LLAMA_KEYS = {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size",
               "num_attention_heads": "num_attention_heads",
               "num_key_value_heads": "num_query_groups", "intermediate_size": "ffn_hidden_size",
               "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings",
               "rms_norm_eps": "norm_epsilon", "rope_theta": "rotary_base",
               "head_dim": "kv_channels", "num_local_experts": "num_experts",
               "num_experts_per_tok": "moe_router_topk",
               "router_aux_loss_coef": "moe_aux_loss_coeff"}
_GPT2_KEYS = {"n_layer": "num_layers", "n_embd": "hidden_size", "n_head": "num_attention_heads",
              "n_inner": "ffn_hidden_size", "vocab_size": "vocab_size",
              "n_positions": "max_position_embeddings", "layer_norm_epsilon": "norm_epsilon"}
LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "qwen3")  # qwen3: with --qk-layernorm
HF_SEQ_LENGTH_CAP = 4096  # tokens: s when the config's context is longer (give --seq-length)


def hf_model_config(path: str) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json``: ``model_type`` gpt2, llama,
    mistral, mixtral, qwen2 or qwen3 read here (torch-free), any other type a loom family
    imports by that family's reader (``HFConversion.read_config``: Qwen2/3-MoE, DeepSeek-V3,
    gpt-oss, Gemma 3, Mamba-2, Nemotron-H, BERT; imports torch). ``seq_length`` is the context
    length, capped at ``HF_SEQ_LENGTH_CAP`` tokens. Raises ConfigError naming ``--from-hf`` for
    an unreadable file, another model type or a missing key."""
    try:
        with open(path, encoding="utf-8") as fh:
            hf: dict[str, Any] = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--from-hf {path}: cannot read it as JSON ({e})") from None
    kind = str(hf.get("model_type", "")).lower()
    if kind not in LLAMA_LIKE + ("gpt2",):
        return _family_model_config(hf, kind, path)
    keys = _GPT2_KEYS if kind == "gpt2" else _LLAMA_KEYS
    kw = {ours: hf[theirs] for theirs, ours in keys.items() if hf.get(theirs) is not None}
    for need in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        if need not in kw:
            raise ConfigError(f"--from-hf {path}: no {need.replace('_', ' ')} "
                              f"({[k for k, v in keys.items() if v == need][0]!r}) in the file")
    kw["seq_length"] = min(int(kw.get("max_position_embeddings") or 1024), HF_SEQ_LENGTH_CAP)
    kw["hidden_dropout"] = kw["attention_dropout"] = 0.0
    if kind == "gpt2":
        kw["openai_gelu"] = hf.get("activation_function") in ("gelu_new", "gelu_pytorch_tanh")
        return ModelConfig.gpt2(**kw)
    if kw.get("num_query_groups") == kw["num_attention_heads"]:
        kw.pop("num_query_groups")
    elif "num_query_groups" in kw:
        kw["group_query_attention"] = True
    if kw.get("kv_channels") == kw["hidden_size"] // kw["num_attention_heads"]:
        kw.pop("kv_channels")
    kw["untie_embeddings_and_output_weights"] = not hf.get("tie_word_embeddings", False)
    if kind == "qwen2":
        kw["add_qkv_bias"] = True
    if kind == "qwen3":  # Qwen3: RMSNorm on each head's query and key, no QKV biases
        kw["qk_layernorm"] = True
    if "num_experts" in kw:
        kw["moe_ffn_hidden_size"] = kw.get("ffn_hidden_size")
    kw.update(rope_fields(SimpleNamespace(**hf), f"--from-hf {path}"))  # and rope_scaling
    return ModelConfig.llama(**kw)


def _family_model_config(hf: dict, kind: str, path: str) -> ModelConfig:
    """The model of a ``config.json`` whose ``model_type`` a loom family imports (its
    ``HFConversion.read_config``), at ``HF_SEQ_LENGTH_CAP`` tokens at most, no dropout."""
    from dataclasses import replace
    from loom.models import FamilyRegistry
    families = FamilyRegistry()
    family = families.for_hf(kind)
    if family is None or family.hf.read_config is None:
        known = list(LLAMA_LIKE + ("gpt2",)) + [
            t for f in families.families() if f.hf and f.hf.read_config
            for t in f.hf.model_types if t not in LLAMA_LIKE + ("gpt2",)]
        raise ConfigError(f"--from-hf {path}: model_type {kind!r} is not one of "
                          f"{', '.join(known)}; give the model flags instead")
    try:
        model = family.hf.read_config(hf, f"--from-hf {path}")
    except (KeyError, AttributeError) as e:  # a key the reader needs is missing
        name = e.args[0] if isinstance(e, KeyError) else getattr(e, "name", None) or e
        raise ConfigError(f"--from-hf {path}: no {name!r} in this {kind} config.json") from None
    length = model.max_position_embeddings or model.seq_length or 1024
    return replace(model, seq_length=min(int(length), HF_SEQ_LENGTH_CAP), hidden_dropout=0.0,
                   attention_dropout=0.0)
