"""torchtitan job configs (``--config FILE.toml``): a torchtitan user's TOML read as loom's
flat config, every key answered.

torchtitan (pytorch/torchtitan, through v0.2.2, 2026-02; TOML until its commit 9810191bb moved
configs to Python registries) configures a run with one TOML file of sections (``[model]``,
``[training]``, ``[parallelism]``, ...). :func:`read_torchtitan_config` reads one the way
torchtitan's ``JobConfig`` does (its dataclass defaults for what the file leaves out, v0.2.2's)
and returns loom's fields, Megatron's names, so ``loom train --config llama3_8b.toml`` (and
``loom plan --config ...``) runs what the file describes; torchtitan's command line works too
(``--job.config_file FILE.toml --training.steps 100``: :func:`torchtitan_argv`). Every key torchtitan's files have used
(:data:`KEYS`: the 154 keys of the 477 distinct train_configs files in its history, plus v0.2.2's
``JobConfig`` fields) is one of:

* a loom field it sets (``[training] steps`` -> ``--train-iters``), with torchtitan's meaning
  (the learning rate: Megatron's warm-up-stable-decay with torchtitan's phases, equal to
  torchtitan's LambdaLR at every step);
* a note printed once at start (:data:`NOTES`): what loom reads elsewhere or differently
  (the dataset, the tokenizer, torchtitan's op-level selective recompute);
* refused, naming the key and why (Flux and vision models, Llama 4's iRoPE past one attention
  block, a torchtitan checkpoint to load, TorchFT, ...), before anything starts. FP8
  converters are said and trained in bf16, as loom takes Megatron's ``--fp8-format``.

Models: ``[model] name`` llama3 (and the older ``llama``, ``llama2``), llama4, qwen3 (dense
and MoE), deepseek_v3 and gpt_oss, each flavor as torchtitan defines it
(:mod:`loom.config.torchtitan_models`); ``[parallelism] expert_parallel_degree`` /
``expert_tensor_parallel_degree`` are Megatron's EP / ETP. The model is torchtitan's: no
dropout, its initialization (``--torchtitan-init``), weight decay on every parameter.

Raises :class:`loom.errors.ConfigError` naming ``FILE.toml: [section] key``.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from typing import Any, Optional

from loom.config.torchtitan_models import DEEPSEEK_ROPE, FLAVORS
from loom.errors import ConfigError

TORCHTITAN = dict(repo="pytorch/torchtitan", release="v0.2.2",
                  toml_removed_by="9810191bb (2026-02-23)")


REFUSED_MODELS = {
    "flux": "a diffusion model",
    "deepseek_v2": "DeepSeek-V2 as torchtitan builds it",
    "vlm": "a vision-language model", "llama3-siglip2": "a vision-language model",
    "hf_GPT2": "a Hugging Face model wrapped by torchtitan",
}

# torchtitan v0.2.2's JobConfig defaults of the keys loom reads (what a file leaves out)
DEFAULTS = {
    "job.dump_folder": "./outputs",
    "model.name": "llama3", "model.flavor": "debugmodel",
    "optimizer.name": "AdamW", "optimizer.lr": 8e-4, "optimizer.beta1": 0.9,
    "optimizer.beta2": 0.95, "optimizer.eps": 1e-8, "optimizer.weight_decay": 0.1,
    "lr_scheduler.warmup_steps": 200, "lr_scheduler.decay_ratio": None,
    "lr_scheduler.decay_type": "linear", "lr_scheduler.min_lr_factor": 0.0,
    "lr_scheduler.total_steps": None,
    "training.local_batch_size": 8, "training.global_batch_size": -1,
    "training.seq_len": 2048, "training.max_norm": 1.0, "training.steps": 10000,
    "training.mixed_precision_param": "bfloat16", "training.mixed_precision_reduce": "float32",
    "parallelism.data_parallel_replicate_degree": 1,
    "parallelism.data_parallel_shard_degree": -1,
    "parallelism.tensor_parallel_degree": 1, "parallelism.pipeline_parallel_degree": 1,
    "parallelism.context_parallel_degree": 1, "parallelism.pipeline_parallel_schedule": "1F1B",
    "parallelism.pipeline_parallel_microbatch_size": 1,
    "parallelism.pipeline_parallel_first_stage_less_layers": 1,
    "parallelism.pipeline_parallel_last_stage_less_layers": 1,
    "parallelism.pipeline_parallel_layers_per_stage": None,
    "parallelism.expert_parallel_degree": 1, "parallelism.expert_tensor_parallel_degree": 1,
    "activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "2",
    "metrics.log_freq": 10, "metrics.enable_tensorboard": False, "metrics.save_tb_folder": "tb",
    "metrics.enable_wandb": False,
    "checkpoint.enable": False, "checkpoint.folder": "checkpoint", "checkpoint.interval": 500,
    "checkpoint.keep_latest_k": 10, "checkpoint.async_mode": "disabled",
    "checkpoint.load_step": -1,
    "validation.enable": False, "validation.freq": 10, "validation.steps": -1,
    "profiling.enable_profiling": False, "profiling.profile_freq": 10,
    "profiling.profiler_active": 1, "profiling.save_traces_folder": "profile_traces",
    "profiling.enable_memory_snapshot": False,
    "profiling.save_memory_snapshot_folder": "memory_snapshot",
}
# older spellings of a key (torchtitan 2024-25) -> the v0.2.2 key
RENAMED = {
    "training.batch_size": "training.local_batch_size",
    "training.data_parallel_degree": "parallelism.data_parallel_shard_degree",
    "training.data_parallel_shard_degree": "parallelism.data_parallel_shard_degree",
    "training.data_parallel_replicate_degree": "parallelism.data_parallel_replicate_degree",
    "training.tensor_parallel_degree": "parallelism.tensor_parallel_degree",
    "training.sequence_parallel_degree": "parallelism.tensor_parallel_degree",
    "training.pipeline_parallel_degree": "parallelism.pipeline_parallel_degree",
    "experimental.pipeline_parallel_degree": "parallelism.pipeline_parallel_degree",
    "experimental.context_parallel_degree": "parallelism.context_parallel_degree",
    "experimental.enable_async_tensor_parallel": "parallelism.enable_async_tensor_parallel",
    "training.fsdp_reshard_after_forward": "parallelism.fsdp_reshard_after_forward",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
    "training.checkpoint_folder": "checkpoint.folder",
    "training.checkpoint_interval": "checkpoint.interval",
    "training.checkpoint_interval_type": "checkpoint.interval_type",
    "checkpoint.enable_checkpoint": "checkpoint.enable",
    "checkpoint.model_weights_only": "checkpoint.last_save_model_only",
    "checkpoint.last_save_model_weights_only": "checkpoint.last_save_model_only",
    "training.compile": "compile.enable",
    "training.seed": "debug.seed",
    "profiling.run_profiler": "profiling.enable_profiling",
    "profiling.profile_every_x_iter": "profiling.profile_freq",
    "metrics.enable_color_printing": "metrics.disable_color_printing",
    "validation.enabled": "validation.enable",
    "global.dump_folder": "job.dump_folder",
    "training.enable_float8_linear": "float8.enable_float8_linear",
    "training.enable_fp8_linear": "float8.enable_float8_linear",
    "training.fp8_linear": "float8.enable_float8_linear",
}


@dataclass(frozen=True)
class Key:
    """How loom answers one torchtitan key: ``kind`` "read" (:func:`read_torchtitan_config`
    uses it), "quiet" (no effect on what runs: a label, a print option), "note" (said at
    start, :data:`NOTES`) or "refuse" (``why``, unless the value is one of ``allow``)."""
    kind: str
    why: str = ""
    allow: tuple = ()


def _refuse(why: str, *allow) -> Key:
    return Key("refuse", why, allow)


FP8 = ("FP8 / MX is not in loom: it trains in bf16 (as it takes Megatron's --fp8-format, "
       "without effect)")
KEYS: dict[str, Key] = {
    **{k: Key("read") for k in DEFAULTS},
    "job.description": Key("quiet"), "job.print_args": Key("quiet"),
    "job.print_config": Key("quiet"), "job.use_for_integration_test": Key("quiet"),
    "job.config_file": Key("quiet"), "job.save_config_file": Key("quiet"),
    "metrics.use_for_integration_test": Key("quiet"),
    "job.custom_config_module": _refuse("a torchtitan extension module", ""),
    "experimental.custom_args_module": _refuse("a torchtitan extension module", ""),
    "experimental.custom_import": _refuse("a torchtitan extension module", ""),
    "experimental.torch_spmd": _refuse("torchtitan's SPMD experiment", False),
    "profiling.profiler_warmup": Key("quiet"),
    "metrics.disable_color_printing": Key("quiet"), "metrics.save_for_all_ranks": Key("quiet"),
    "model.tokenizer_path": Key("note"), "model.hf_assets_path": Key("note"),
    "model.norm_type": Key("read"),
    "model.converters": Key("note"),
    "model.print_after_conversion": Key("quiet"),
    "model.use_flex_attn": Key("quiet"), "model.attn_mask_type": Key("read"),
    "optimizer.implementation": Key("quiet"),
    "optimizer.early_step_in_backward": Key("quiet"),
    "training.dataset": Key("note"), "training.dataset_path": Key("note"),
    "training.dtype": _refuse("parameters kept in bfloat16 without fp32 master weights "
                              "(loom keeps fp32 master weights)", "float32"),
    "training.enable_cpu_offload": _refuse("torchtitan's FSDP CPU offload (loom offloads the "
                                           "optimizer: --optimizer-cpu-offload)", False),
    "training.gc_freq": Key("quiet"), "training.gc_debug": Key("quiet"),
    "training.enable_selective_ac": Key("read"),
    "training.warmup_pct": Key("read"),  # torchtrain (2024-01): warm-up as a share of steps
    "parallelism.fsdp_reshard_after_forward": Key("quiet"),
    "parallelism.disable_loss_parallel": Key("quiet"),
    "parallelism.enable_async_tensor_parallel": Key("note"),
    "parallelism.module_fqns_per_model_part": _refuse(
        "a hand-made pipeline split: give --pipeline-model-parallel-layout", None),
    "parallelism.pipeline_parallel_schedule_csv": _refuse(
        "a schedule from a CSV file", "", None),
    "parallelism.pipeline_parallel_expert_parallel_overlap": Key("quiet"),
    "parallelism.context_parallel_load_balancer": Key("read"),
    "parallelism.context_parallel_rotate_method": Key("read"),
    "parallelism.expert_parallel_comm_backend": Key("quiet"),
    "checkpoint.interval_type": _refuse("checkpoints every so many seconds (loom saves every "
                                        "--save-interval iterations, or --save-interval-minutes"
                                        ")", "steps"),
    "checkpoint.last_save_model_only": Key("quiet"), "checkpoint.export_dtype": Key("quiet"),
    "checkpoint.enable_ft_dataloader_checkpoints": Key("quiet"),
    "checkpoint.initial_load_path": _refuse(
        "a torchtitan checkpoint (its own tensor names) to start from: convert it with `loom "
        "checkpoint convert --from-torchtitan FILE.toml STEP_DIR OUT`, then --load OUT", None),
    "checkpoint.initial_load_model_only": Key("quiet"),
    "checkpoint.initial_load_in_hf": _refuse("a Hugging Face checkpoint to start from: "
                                             "`loom checkpoint --from-hf`, then --load", False),
    "checkpoint.initial_load_in_hf_quantized": _refuse("a quantized checkpoint", False),
    "checkpoint.last_save_in_hf": _refuse("a Hugging Face export at the end: run `loom "
                                          "checkpoint --to-hf` on the last checkpoint", False),
    "checkpoint.exclude_from_loading": _refuse("loading part of a checkpoint", ()),
    "checkpoint.enable_first_step_checkpoint": _refuse("a checkpoint before the first step",
                                                       False),
    "checkpoint.create_seed_checkpoint": _refuse("torchtitan's seed checkpoint", False),
    "checkpoint.load_only": _refuse("load-only checkpointing", False),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": Key("quiet"),
    "activation_checkpoint.early_stop": Key("quiet"),
    "activation_checkpoint.memory_budget": Key("quiet"),
    "activation_checkpoint.visualize_memory_budget_pareto": Key("quiet"),
    "activation_checkpoint.preserve_rng_state": Key("quiet"),
    "activation_checkpoint.determinism_check": Key("quiet"),
    "activation_checkpoint.debug": Key("quiet"),
    "compile.enable": Key("read"), "compile.components": Key("quiet"),
    "compile.backend": _refuse("a torch.compile backend other than inductor", "inductor"),
    "comm.init_timeout_seconds": Key("read"), "comm.train_timeout_seconds": Key("note"),
    "comm.trace_buf_size": Key("quiet"), "comm.save_traces_folder": Key("quiet"),
    "comm.save_traces_file_prefix": Key("quiet"),
    "comm.mode": _refuse("a fake or local-tensor communication backend", "default"),
    "memory_estimation.enable": _refuse("torchtitan's memory estimator: run `loom train "
                                        "--dry-run` or `loom plan`", False),
    "memory_estimation.disable_fake_mode": Key("quiet"),
    "fault_tolerance.enable": _refuse("TorchFT replica groups (loom restarts from its "
                                      "checkpoints under torchrun --max-restarts)", False),
    **{f"fault_tolerance.{k}": Key("quiet") for k in (
        "process_group", "process_group_timeout_ms", "replica_id", "group_size",
        "min_replica_size", "semi_sync_method", "num_fragments", "sync_steps")},
    "validation.dataset": Key("note"), "validation.dataset_path": Key("note"),
    "validation.local_batch_size": Key("read"), "validation.seq_len": Key("quiet"),
    **{f"{split}.dataloader.{k}": Key("quiet") for split in ("training", "validation")
       for k in ("num_workers", "persistent_workers", "pin_memory", "prefetch_factor")},
    "debug.seed": Key("read"), "debug.deterministic": Key("read"),
    "debug.deterministic_warn_only": Key("quiet"),
    "debug.moe_force_load_balance": Key("read"),
    "float8.enable_float8_linear": Key("note"),
}
# FP8 / MX sections: options of a converter, which loom names and trains without (FP8)
FP8_SECTIONS = ("float8.", "quantize.", "mx.")
NOTES = {
    "model.tokenizer_path": "loom reads the tokenizer stored with its data: tokenize with "
                            "`loom preprocess --tokenizer-model PATH`",
    "training.dataset": "loom reads Megatron indexed datasets, not torchtitan's Hugging Face "
                        "ones: `loom preprocess`, then --data-path PREFIX (or --mock-data)",
    "parallelism.enable_async_tensor_parallel": "async TP (micro-pipelined TP collectives) is "
                                                "not in loom: the TP collectives run as they are",
    "comm.train_timeout_seconds": "loom's hang watchdog is --hang-timeout-s",
}
NOTES["model.converters"] = NOTES["float8.enable_float8_linear"] = FP8
NOTES["model.hf_assets_path"] = NOTES["model.tokenizer_path"]
NOTES["training.dataset_path"] = NOTES["training.dataset"]
NOTES["validation.dataset"] = NOTES["validation.dataset_path"] = NOTES["training.dataset"]


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _where(path: str, key: str) -> str:
    section, _, name = key.rpartition(".")
    return f"{path}: [{section}] {name}"


SET_FLAG = "--torchtitan-set"  # hidden: one ``section.key=value`` of torchtitan's command line


def torchtitan_argv(argv: list[str]) -> list[str]:
    """``argv`` with torchtitan's command-line spellings made loom's: ``--job.config_file
    FILE.toml`` is ``--config FILE.toml``; each ``--section.key VALUE`` (``=VALUE``; a flag
    with no value is true; hyphens or underscores) is ``--torchtitan-set section.key=VALUE``,
    applied over the file (:func:`read_torchtitan_config`'s ``overrides``), as torchtitan's
    command line is over its TOML. Other words unchanged."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        w = argv[i]
        name, eq, value = w.partition("=")
        dotted = name.startswith("--") and "." in name and not name[2:3].isdigit()
        if not dotted:
            out.append(w)
            i += 1
            continue
        key = name[2:].replace("-", "_")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and not nxt.startswith("--"):
                value, i = nxt, i + 1
            else:
                value = "true"
        i += 1
        if key in ("job.config_file",):
            out += ["--config", value]
        else:
            out += [SET_FLAG, f"{key}={value}"]
    return out


def _override_value(text: str):
    """A command-line value as torchtitan's parser types it: a TOML value where it is one
    (``100``, ``3e-4``, ``true``, ``[1, 2]``), else the string (``8B``)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def read_torchtitan_config(path: str, lines: Optional[dict] = None,
                           notes: Optional[list] = None,
                           overrides: Optional[list] = None) -> dict:
    """loom's flat ``{field: value}`` of the torchtitan TOML at ``path`` (module docstring);
    ``lines`` (if given) receives ``{field: "[section] key"}``, ``notes`` the lines loom says
    at start (what it reads elsewhere or differently).

    Raises:
        ConfigError: a syntax error, an unknown key (the closest known one named), a key
            loom refuses (the key, its value and why), an unknown model or flavor.
    """
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not a valid TOML file ({e})") from None
    for item in overrides or ():  # torchtitan's --section.key VALUE, over the file
        key, _, text = item.partition("=")
        *sections, name = key.split(".")
        d = raw
        for sec in sections:
            d = d.setdefault(sec, {})
            if not isinstance(d, dict):
                raise ConfigError(f"--{key}: {sec} is not a section of {path}")
        d[name] = _override_value(text)
    return torchtitan_fields(raw, path, lines, notes)


def torchtitan_fields(config: dict, path: str = "config", lines: Optional[dict] = None,
                      notes: Optional[list] = None) -> dict:
    """:func:`read_torchtitan_config` of a parsed TOML (``{section: {key: value}}``, sections
    nested as torchtitan's are); ``path`` names it in messages. Raises ConfigError."""
    raw = _flatten(config)
    name = raw.get("model.name")
    if name in REFUSED_MODELS:  # before its own sections' keys (Flux's [encoder], ...)
        raise ConfigError(f"{_where(path, 'model.name')} = {name!r}: {REFUSED_MODELS[name]}; "
                          f"not supported by loom's torchtitan reader")
    given: dict[str, Any] = {}
    said: set = set()
    for key, value in raw.items():
        new = RENAMED.get(key, key)
        if key == "metrics.enable_color_printing":
            value = not value
        if key in ("training.enable_float8_linear", "training.enable_fp8_linear",
                   "training.fp8_linear") and value == "":
            value = False
        if new.startswith(FP8_SECTIONS) and new != "float8.enable_float8_linear":
            continue  # options of a converter: the converter itself is named (FP8)
        if new not in KEYS:
            from loom.errors import closest
            near = closest(new, list(KEYS))
            hint = f" (did you mean [{near.rpartition('.')[0]}] {near.rpartition('.')[2]}?)" \
                if near else ": not a torchtitan key loom knows"
            raise ConfigError(f"{_where(path, key)}: unknown key{hint}")
        rule = KEYS[new]
        if rule.kind == "refuse" and value not in rule.allow:
            raise ConfigError(f"{_where(path, key)} = {value!r}: {rule.why}; not supported by "
                              f"loom")
        if rule.kind == "note" and notes is not None and NOTES[new] not in said and value \
                not in (False, "", [], None):
            said.add(NOTES[new])  # one line per difference, not per key
            notes.append(f"{path}: [{new.rpartition('.')[0]}] {new.rpartition('.')[2]} "
                         f"= {value!r}: {NOTES[new]}")
        given[new] = value
    out, where = _translate(path, {**DEFAULTS, **given}, given, notes)
    if lines is not None:
        lines.update(where)
    return out


def _translate(path: str, c: dict, given: dict, notes: Optional[list]) -> tuple[dict, dict]:
    """The loom fields of the torchtitan keys ``c`` (defaults filled in; ``given``: the file's
    own), and for each field the key it came from."""
    out: dict[str, Any] = {}
    where: dict[str, str] = {}
    say = notes.append if notes is not None else (lambda s: None)

    def put(field: str, value, key: str) -> None:
        out[field] = value
        section, _, name = key.rpartition(".")
        where[field] = f"[{section}] {name}"

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"{_where(path, key)} = {c[key]!r}: {why}")

    # model
    name, flavor = c["model.name"], str(c["model.flavor"])
    if name in REFUSED_MODELS:
        raise bad("model.name", f"{REFUSED_MODELS[name]}; not supported by loom's torchtitan "
                                f"reader")
    if name not in FLAVORS:
        raise bad("model.name", f"a model loom does not know; one of {', '.join(FLAVORS)}")
    if flavor not in FLAVORS[name]:
        raise bad("model.flavor", f"not a flavor of torchtitan's {name}; one of "
                                  f"{', '.join(FLAVORS[name])}")
    put("normalization", "RMSNorm", "model.name")
    put("swiglu", True, "model.name")
    put("disable_bias_linear", True, "model.name")
    put("untie_embeddings_and_output_weights", True, "model.name")
    put("position_embedding_type", "rope", "model.name")
    put("norm_epsilon", 1e-5, "model.name")
    put("hidden_dropout", 0.0, "model.name")  # torchtitan's models have no dropout (Megatron's
    put("attention_dropout", 0.0, "model.name")  # default is 0.1 for both)
    put("torchtitan_init", True, "model.name")  # its init_weights, not Megatron's
    for field, value in FLAVORS[name][flavor].items():
        put(field, value, "model.flavor")
    put("make_vocab_size_divisible_by", 1, "model.flavor")  # torchtitan pads no vocabulary
    if name == "deepseek_v3" and int(c["training.seq_len"]) > DEEPSEEK_ROPE["original_seq_len"]:
        r = DEEPSEEK_ROPE  # torchtitan's YaRN (frequencies and softmax scale) past 4,096
        put("rope_type", "yarn", "training.seq_len")
        put("rotary_scaling_factor", r["rope_factor"], "training.seq_len")
        put("yarn_original_max_position_embeddings", r["original_seq_len"], "training.seq_len")
        put("yarn_beta_fast", float(r["beta_fast"]), "training.seq_len")
        put("yarn_beta_slow", float(r["beta_slow"]), "training.seq_len")
    moe = "num_experts" in out
    norm = c.get("model.norm_type")
    if norm is not None:
        if norm not in ("rmsnorm", "fused_rmsnorm", "compiled_rmsnorm", "layernorm",
                        "np_layernorm"):
            raise bad("model.norm_type", "not a torchtitan norm")
        put("normalization", "RMSNorm" if "rms" in norm else "LayerNorm", "model.norm_type")
        if norm == "np_layernorm":
            raise bad("model.norm_type", "a LayerNorm without parameters; not supported by "
                                         "loom")
    if c.get("model.attn_mask_type") == "block_causal":  # (flex attention: a kernel choice)
        put("reset_attention_mask", True, "model.attn_mask_type")  # documents masked apart
        say(f"{path}: block-causal attention: loom masks at each end-of-document token "
            f"(--reset-attention-mask)")
    elif c.get("model.attn_mask_type") not in (None, "causal"):
        raise bad("model.attn_mask_type", "an attention mask loom does not have")
    seq = int(c["training.seq_len"])
    put("seq_length", seq, "training.seq_len")
    put("max_position_embeddings", seq, "training.seq_len")  # torchtitan sets max_seq_len so

    # optimizer and schedule
    opt_name = c["optimizer.name"]
    if opt_name not in ("Adam", "AdamW"):
        raise bad("optimizer.name", "an optimizer loom's torchtitan reader does not map "
                                    "(Adam, AdamW)")
    put("optimizer", "adam", "optimizer.name")
    if opt_name == "Adam":  # torch.optim.Adam: weight decay as L2 added to the gradient
        put("decoupled_weight_decay", False, "optimizer.name")
    put("lr", float(c["optimizer.lr"]), "optimizer.lr")
    put("adam_beta1", float(c["optimizer.beta1"]), "optimizer.beta1")
    put("adam_beta2", float(c["optimizer.beta2"]), "optimizer.beta2")
    put("adam_eps", float(c["optimizer.eps"]), "optimizer.eps")
    put("weight_decay", float(c["optimizer.weight_decay"]), "optimizer.weight_decay")
    put("weight_decay_norms_and_biases", True, "optimizer.weight_decay")  # torch's optimizer
    # over model.parameters(): norms and biases decayed too (Megatron skips them)
    steps = int(c["training.steps"])
    total = int(c["lr_scheduler.total_steps"] or steps)
    warmup = min(int(c["lr_scheduler.warmup_steps"]), total)
    if "training.warmup_pct" in given and "lr_scheduler.warmup_steps" not in given:
        warmup = int(steps * float(given["training.warmup_pct"]))  # torchtrain's rule
    ratio = c["lr_scheduler.decay_ratio"]
    decay = total - warmup if ratio is None else min(round(total * float(ratio)), total - warmup)
    style = {"linear": "linear", "cosine": "cosine", "sqrt": "minus_sqrt"}.get(
        c["lr_scheduler.decay_type"])
    if style is None:
        raise bad("lr_scheduler.decay_type", "one of linear, sqrt, cosine")
    put("train_iters", steps, "training.steps")
    put("lr_warmup_iters", warmup, "lr_scheduler.warmup_steps")
    put("lr_decay_iters", total, "lr_scheduler.total_steps")
    put("lr_decay_style", "WSD", "lr_scheduler.decay_ratio")  # warm-up, stable, decay
    put("lr_wsd_decay_iters", decay, "lr_scheduler.decay_ratio")
    put("lr_wsd_decay_style", style, "lr_scheduler.decay_type")
    put("min_lr", float(c["optimizer.lr"]) * float(c["lr_scheduler.min_lr_factor"]),
        "lr_scheduler.min_lr_factor")
    # Megatron's WSD with torchtitan's phases is torchtitan's LambdaLR step for step
    # (tests/unit/test_torchtitan_config.py::test_the_schedule_is_torchtitans_step_for_step)
    put("clip_grad", float(c["training.max_norm"]), "training.max_norm")

    # precision
    param = c["training.mixed_precision_param"]
    if param not in ("bfloat16", "float32"):
        raise bad("training.mixed_precision_param", "bfloat16 or float32")
    put("bf16", param == "bfloat16", "training.mixed_precision_param")
    if c["training.mixed_precision_reduce"] == "bfloat16":
        put("grad_reduce_in_bf16", True, "training.mixed_precision_reduce")
    elif c["training.mixed_precision_reduce"] != "float32":
        raise bad("training.mixed_precision_reduce", "float32 or bfloat16")

    # parallelism
    tp = int(c["parallelism.tensor_parallel_degree"])
    pp = int(c["parallelism.pipeline_parallel_degree"])
    cp = int(c["parallelism.context_parallel_degree"])
    for key in ("parallelism.expert_parallel_degree",
                "parallelism.expert_tensor_parallel_degree"):
        if int(c[key]) != 1 and not moe:
            raise bad(key, "expert parallelism of a dense model")
    if moe:  # torchtitan's default ETP is 1 (Megatron's is t)
        put("expert_model_parallel_size", int(c["parallelism.expert_parallel_degree"]),
            "parallelism.expert_parallel_degree")
        put("expert_tensor_parallel_size", int(c["parallelism.expert_tensor_parallel_degree"]),
            "parallelism.expert_tensor_parallel_degree")
    if c.get("debug.moe_force_load_balance"):
        raise bad("debug.moe_force_load_balance", "torchtitan's round-robin expert assignment "
                                                  "(Megatron's --moe-router-force-load-"
                                                  "balancing draws random logits instead)")
    put("tensor_model_parallel_size", tp, "parallelism.tensor_parallel_degree")
    put("pipeline_model_parallel_size", pp, "parallelism.pipeline_parallel_degree")
    put("context_parallel_size", cp, "parallelism.context_parallel_degree")
    if tp > 1:
        put("sequence_parallel", True, "parallelism.tensor_parallel_degree")  # torchtitan's TP
    shard = int(c["parallelism.data_parallel_shard_degree"])
    replicate = int(c["parallelism.data_parallel_replicate_degree"])
    if shard != 1 and pp > 1:
        put("use_distributed_optimizer", True, "parallelism.data_parallel_shard_degree")
        say(f"{path}: FSDP with pipeline parallelism: loom shards the optimizer states over the "
            f"data-parallel ranks (--use-distributed-optimizer), not the weights; the same "
            f"numbers")
    elif shard != 1:
        put("use_torch_fsdp2", True, "parallelism.data_parallel_shard_degree")
        if replicate > 1:
            say(f"{path}: HSDP ({replicate} replicas of {shard}-way FSDP): loom's FSDP2 shards "
                f"over every data-parallel rank; the same numbers")
    if c.get("parallelism.context_parallel_rotate_method") == "alltoall":
        put("cp_comm_type", "p2p", "parallelism.context_parallel_rotate_method")
    elif cp > 1:
        put("cp_comm_type", "allgather", "parallelism.context_parallel_rotate_method")
    balancer = c.get("parallelism.context_parallel_load_balancer", "headtail")
    if cp > 1 and balancer not in ("headtail", None):
        raise bad("parallelism.context_parallel_load_balancer",
                  "loom balances causal CP shards head-and-tail only")
    local = int(c["training.local_batch_size"])
    glob = int(c["training.global_batch_size"])
    if pp > 1:
        micro = int(c["parallelism.pipeline_parallel_microbatch_size"])
        schedule = c["parallelism.pipeline_parallel_schedule"]
        mapped = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved",
                  "ZBVZeroBubble": "zbv"}.get(schedule)
        if mapped is None:
            raise bad("parallelism.pipeline_parallel_schedule",
                      "a schedule loom does not run (1F1B, Interleaved1F1B, GPipe, "
                      "ZBVZeroBubble)")
        put("pipeline_schedule", mapped, "parallelism.pipeline_parallel_schedule")
        per_stage = c["parallelism.pipeline_parallel_layers_per_stage"]
        weights = []
        for end in ("first", "last"):
            key = f"parallelism.pipeline_parallel_{end}_stage_less_layers"
            if int(c[key]) not in (0, 1):
                raise bad(key, "loom (Megatron) counts the embedding / the loss as one layer "
                               "of its stage (0 or 1)")
            weights.append(int(c[key]))
        stages = pp * (2 if mapped in ("interleaved", "zbv") else 1)
        layers = out["num_layers"]
        uneven = not per_stage and mapped != "zbv" and (layers + sum(weights)) % stages
        if uneven:  # torchtitan's own split, as Megatron's layout string writes it
            put("pipeline_model_parallel_layout", torchtitan_split(layers, stages, *weights),
                "parallelism.pipeline_parallel_first_stage_less_layers")
        elif per_stage:
            put("num_layers_per_virtual_pipeline_stage", int(per_stage),
                "parallelism.pipeline_parallel_layers_per_stage")
        elif mapped in ("interleaved", "zbv"):
            put("num_virtual_stages_per_pipeline_rank", 2,
                "parallelism.pipeline_parallel_schedule")  # torchtitan: 2 stages per rank
        for weight, end, field in zip(weights, ("first", "last"),
                                      ("account_for_embedding_in_pipeline_split",
                                       "account_for_loss_in_pipeline_split")):
            if weight and not per_stage and not uneven:
                put(field, True, f"parallelism.pipeline_parallel_{end}_stage_less_layers")
    else:
        micro = local
    put("micro_batch_size", micro, "training.local_batch_size")
    if glob > 0:
        put("global_batch_size", glob, "training.global_batch_size")
    elif pp > 1 and local != micro:
        raise bad("training.local_batch_size",
                  f"{local} sequences per data-parallel rank in micro-batches of {micro}: loom "
                  f"needs the global batch, give [training] global_batch_size (= local_batch_"
                  f"size x data-parallel size) or --global-batch-size")

    # recomputation
    mode = c["activation_checkpoint.mode"]
    option = str(c["activation_checkpoint.selective_ac_option"])
    if c.get("training.enable_selective_ac") is False and "activation_checkpoint.mode" not in given:
        mode = "none"
    layers = out["num_layers"]
    if mode == "full":
        put("recompute_granularity", "full", "activation_checkpoint.mode")
        put("recompute_method", "uniform", "activation_checkpoint.mode")
        put("recompute_num_layers", 1, "activation_checkpoint.mode")
    elif mode == "selective" and option == "op":
        put("recompute_granularity", "selective", "activation_checkpoint.selective_ac_option")
        say(f"{path}: selective recompute 'op': loom recomputes the attention core "
            f"(Megatron's selective), not torchtitan's every-other-matmul policy; the same "
            f"numbers, other memory and time")
    elif mode == "selective":
        try:
            every = int(option)
        except ValueError:
            raise bad("activation_checkpoint.selective_ac_option", "'op' or a layer interval")
        if every >= 1:
            k = math.ceil(layers / max(1, pp) / every)
            put("recompute_granularity", "full", "activation_checkpoint.selective_ac_option")
            put("recompute_method", "block", "activation_checkpoint.selective_ac_option")
            put("recompute_num_layers", k, "activation_checkpoint.selective_ac_option")
            say(f"{path}: selective recompute of one layer in {every}: loom recomputes the "
                f"first {k} layers of each stage (--recompute-method block), as many")
    elif mode == "memory_budget":
        raise bad("activation_checkpoint.mode", "torch.compile's memory-budget recompute")
    elif mode != "none":
        raise bad("activation_checkpoint.mode", "none, selective or full")

    # logging, checkpoints, evaluation, profiling
    dump = str(c["job.dump_folder"])
    put("log_interval", int(c["metrics.log_freq"]), "metrics.log_freq")
    if c["metrics.enable_tensorboard"]:
        put("tensorboard_dir", f"{dump}/{c['metrics.save_tb_folder']}",
            "metrics.enable_tensorboard")
    if c["metrics.enable_wandb"]:
        put("wandb_project", "torchtitan", "metrics.enable_wandb")  # torchtitan's default
        put("wandb_save_dir", f"{dump}/{c['metrics.save_tb_folder']}", "metrics.enable_wandb")
    if c["checkpoint.enable"]:
        folder = f"{dump}/{c['checkpoint.folder']}"
        put("save", folder, "checkpoint.folder")
        put("load", folder, "checkpoint.folder")  # torchtitan resumes from its own folder
        put("save_interval", int(c["checkpoint.interval"]), "checkpoint.interval")
        keep = int(c["checkpoint.keep_latest_k"])
        if keep > 0:
            put("keep_last", keep, "checkpoint.keep_latest_k")
        if c["checkpoint.async_mode"] in ("async", "async_with_pinned_mem"):
            put("async_save", True, "checkpoint.async_mode")
        elif c["checkpoint.async_mode"] != "disabled":
            raise bad("checkpoint.async_mode", "disabled, async or async_with_pinned_mem")
        if int(c["checkpoint.load_step"]) >= 0:
            put("ckpt_step", int(c["checkpoint.load_step"]), "checkpoint.load_step")
    if c["validation.enable"]:
        if int(c["validation.steps"]) < 0:
            raise bad("validation.steps", "the whole validation set (loom evaluates a fixed "
                                          "number of iterations: give steps)")
        put("eval_interval", int(c["validation.freq"]), "validation.freq")
        put("eval_iters", int(c["validation.steps"]), "validation.steps")
    else:
        put("eval_iters", 0, "validation.enable")
    if c["profiling.enable_profiling"]:
        freq, active = int(c["profiling.profile_freq"]), int(c["profiling.profiler_active"])
        put("profile", True, "profiling.enable_profiling")
        put("use_pytorch_profiler", True, "profiling.enable_profiling")
        put("profile_step_start", max(1, freq - active), "profiling.profile_freq")
        put("profile_step_end", freq, "profiling.profile_freq")
        traces = f"{dump}/torch_profile" if c["metrics.enable_tensorboard"] else \
            "./torch_profile"
        say(f"{path}: profiling: one window, iterations {max(1, freq - active)}-{freq} "
            f"(torchtitan repeats it every {freq}), traces in {traces} (not "
            f"{dump}/{c['profiling.save_traces_folder']})")
    if c["profiling.enable_memory_snapshot"]:
        put("record_memory_history", True, "profiling.enable_memory_snapshot")
        put("memory_snapshot_path",
            f"{dump}/{c['profiling.save_memory_snapshot_folder']}/snapshot.pickle",
            "profiling.save_memory_snapshot_folder")

    # the rest
    if c.get("compile.enable") and out.get("use_torch_fsdp2"):
        say(f"{path}: [compile] enable: loom does not compile a model FSDP2 shards (not tested "
            f"with its gather hooks): it runs eager; the same numbers")
    elif c.get("compile.enable"):
        put("compile", True, "compile.enable")
    if c.get("debug.seed") is not None:
        put("seed", int(c["debug.seed"]), "debug.seed")
    if c.get("debug.deterministic"):
        put("deterministic_mode", True, "debug.deterministic")
    if c.get("comm.init_timeout_seconds") is not None:
        put("distributed_timeout_minutes", max(1, math.ceil(int(c["comm.init_timeout_seconds"])
                                                            / 60)), "comm.init_timeout_seconds")
    if c.get("validation.local_batch_size") is not None and c["validation.enable"]:
        put("eval_micro_batch_size", int(c["validation.local_batch_size"]),
            "validation.local_batch_size")
    return out, where


def torchtitan_split(layers: int, stages: int, first: int = 1, last: int = 1) -> str:
    """torchtitan's pipeline split (v0.2.2 ``generate_llm_fqn_per_model_part``) as a Megatron
    ``--pipeline-model-parallel-layout``: ``layers + first + last`` "layers" (the embedding
    and the output counted ``first`` / ``last``) over ``stages`` stages, the first
    ``remainder`` stages one more, the embedding on the first, the loss on the last (48 layers
    over 4 stages: ``Et*12|t*13|t*12|t*11L``)."""
    per, extra = divmod(layers + first + last, stages)
    parts = []
    for stage in range(stages):
        n = per + (stage < extra) - (first if stage == 0 else 0) - \
            (last if stage == stages - 1 else 0)
        parts.append(("E" if stage == 0 else "") + (f"t*{n}" if n else "") +
                     ("L" if stage == stages - 1 else ""))
    return "|".join(parts)


def is_torchtitan_config(path: Optional[str]) -> bool:
    """Whether ``--config PATH`` names a torchtitan TOML (by its ``.toml`` suffix)."""
    return bool(path) and str(path).lower().endswith(".toml")


# what each "read" key becomes (docs/torchtitan.md); the keys renamed from older spellings
# point here through RENAMED
READ_AS = {
    "job.dump_folder": "the directory of --save / --load, --tensorboard-dir, snapshots",
    "model.name": "the family's shape: RMSNorm, SwiGLU, RoPE, untied, no biases",
    "model.flavor": "--num-layers, --hidden-size, heads, groups, --ffn-hidden-size, "
                    "--vocab-size, --rotary-base, --use-rope-scaling; MoE: --num-experts, "
                    "--moe-router-topk, --moe-ffn-hidden-size, the router flags, "
                    "--moe-router-enable-expert-bias; DeepSeek: --multi-latent-attention and "
                    "its ranks, --moe-layer-freq",
    "model.norm_type": "--normalization",
    "model.attn_mask_type": "--reset-attention-mask (block_causal)",
    "optimizer.name": "--optimizer adam (AdamW's decoupled decay)", "optimizer.lr": "--lr",
    "optimizer.beta1": "--adam-beta1", "optimizer.beta2": "--adam-beta2",
    "optimizer.eps": "--adam-eps", "optimizer.weight_decay": "--weight-decay",
    "lr_scheduler.warmup_steps": "--lr-warmup-iters",
    "lr_scheduler.decay_ratio": "--lr-decay-style WSD --lr-wsd-decay-iters",
    "lr_scheduler.decay_type": "--lr-wsd-decay-style (sqrt: minus_sqrt)",
    "lr_scheduler.min_lr_factor": "--min-lr (= lr x factor)",
    "lr_scheduler.total_steps": "--lr-decay-iters",
    "training.local_batch_size": "--micro-batch-size (the global batch: local x DP)",
    "training.global_batch_size": "--global-batch-size", "training.seq_len": "--seq-length "
                                                                           "(DeepSeek past "
                                                                           "4,096: YaRN)",
    "training.max_norm": "--clip-grad", "training.steps": "--train-iters",
    "training.mixed_precision_param": "--bf16", "training.mixed_precision_reduce":
        "--grad-reduce-in-bf16 (bfloat16)", "training.enable_selective_ac": "recompute off",
    "training.warmup_pct": "--lr-warmup-iters (steps x pct)",
    "parallelism.data_parallel_replicate_degree": "FSDP2 over all DP ranks",
    "parallelism.data_parallel_shard_degree": "--use-torch-fsdp2 (with PP: "
                                              "--use-distributed-optimizer)",
    "parallelism.tensor_parallel_degree": "--tensor-model-parallel-size --sequence-parallel",
    "parallelism.pipeline_parallel_degree": "--pipeline-model-parallel-size",
    "parallelism.context_parallel_degree": "--context-parallel-size",
    "parallelism.pipeline_parallel_schedule": "--pipeline-schedule",
    "parallelism.pipeline_parallel_microbatch_size": "--micro-batch-size (with PP)",
    "parallelism.pipeline_parallel_first_stage_less_layers":
        "--account-for-embedding-in-pipeline-split",
    "parallelism.pipeline_parallel_last_stage_less_layers":
        "--account-for-loss-in-pipeline-split",
    "parallelism.pipeline_parallel_layers_per_stage": "--num-layers-per-virtual-pipeline-stage",
    "parallelism.expert_parallel_degree": "--expert-model-parallel-size (1 for dense models)",
    "parallelism.expert_tensor_parallel_degree": "--expert-tensor-parallel-size (1 for dense "
                                                 "models)",
    "debug.moe_force_load_balance": "refused when true: torchtitan's round-robin assignment",
    "parallelism.context_parallel_load_balancer": "loom's head-and-tail CP shards",
    "parallelism.context_parallel_rotate_method": "--cp-comm-type allgather / p2p",
    "activation_checkpoint.mode": "--recompute-granularity (full: uniform, 1 layer)",
    "activation_checkpoint.selective_ac_option": "op: selective; N: --recompute-method block",
    "metrics.log_freq": "--log-interval", "metrics.enable_tensorboard": "--tensorboard-dir",
    "metrics.save_tb_folder": "--tensorboard-dir", "metrics.enable_wandb":
        "--wandb-project torchtitan",
    "checkpoint.enable": "--save / --load", "checkpoint.folder": "--save / --load",
    "checkpoint.interval": "--save-interval", "checkpoint.keep_latest_k": "--keep-last",
    "checkpoint.async_mode": "--async-save", "checkpoint.load_step": "--ckpt-step",
    "validation.enable": "--eval-iters 0 when off", "validation.freq": "--eval-interval",
    "validation.steps": "--eval-iters", "validation.local_batch_size":
        "--eval-micro-batch-size",
    "profiling.enable_profiling": "--profile --use-pytorch-profiler",
    "profiling.profile_freq": "--profile-step-start / --profile-step-end",
    "profiling.profiler_active": "--profile-step-start",
    "profiling.save_traces_folder": "said at start: loom's traces go to torch_profile beside "
                                    "--tensorboard-dir",
    "profiling.enable_memory_snapshot": "--record-memory-history",
    "profiling.save_memory_snapshot_folder": "--memory-snapshot-path",
    "compile.enable": "--compile (not with FSDP2)", "comm.init_timeout_seconds":
        "--distributed-timeout-minutes", "debug.seed": "--seed",
    "debug.deterministic": "--deterministic-mode",
}


def docs_markdown() -> str:
    """docs/torchtitan.md: every key and what loom does with it (``python -m
    loom.config.torchtitan docs/torchtitan.md``)."""
    lines = ["# torchtitan job configs in loom", "",
             "<!-- generated by `python -m loom.config.torchtitan docs/torchtitan.md` from "
             "loom/config/torchtitan.py; do not edit -->", "",
             "`loom train --config FILE.toml` (or torchtitan's own `--job.config_file FILE.toml "
             "--section.key VALUE`) and `loom plan --config FILE.toml` read a torchtitan job "
             "config with torchtitan v0.2.2's defaults for what it leaves out; `loom checkpoint "
             "convert --from-torchtitan FILE.toml STEP_DIR OUT` reads its Llama 2 / 3 / 4, "
             "Qwen3, Qwen3-MoE, DeepSeek-V3 and gpt-oss checkpoints. "
             "The model is torchtitan's: no dropout, torchtitan's initialization "
             "(`--torchtitan-init`: its `init_weights`, depth-scaled), weight decay on every "
             "parameter, norms included (`--weight-decay-norms-and-biases`: its optimizer "
             "is torch's over `model.parameters()`). "
             "Models: " + ", ".join(f"{n} ({', '.join(FLAVORS[n])})" for n in FLAVORS) + ". "
             "Each key below is read (as the loom flag named), said once at start, taken "
             "without effect on what runs, or refused naming why.", "",
             "| key | loom |", "|---|---|"]
    old = {}
    for o, new in RENAMED.items():
        old.setdefault(new, []).append(o)
    for key in sorted(KEYS):
        rule = KEYS[key]
        sec, _, name = key.rpartition(".")
        what = {"read": READ_AS.get(key, "read"), "quiet": "no effect on what runs",
                "note": "said at start: " + NOTES.get(key, ""),
                "refuse": "refused: " + rule.why}[rule.kind]
        if rule.kind == "refuse" and rule.allow:
            what += " (accepted: " + ", ".join(repr(a) for a in rule.allow) + ")"
        also = f" (also `{'`, `'.join(sorted(old[key]))}`)" if key in old else ""
        lines.append(f"| `[{sec}] {name}`{also} | {what} |")
    lines += ["", "Sections `[float8]`, `[quantize.*]`, `[mx]`: options of an FP8 / MX "
              "converter, which loom names at start and trains without (bf16)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys
    text = docs_markdown()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)

