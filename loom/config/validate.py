"""The one validation pass: every field's type, choices and bounds (from its ``Literal`` type and
``metadata``), then the cross-field and layout rules. Torch-free; reads the sections from the
config object itself (it imports only the rule modules of :mod:`loom.config`: fault_spec,
fields, hybrid_pattern, pipeline, split, ...) and nothing of loom above :mod:`loom.config`.

A model family's own rules live in its folder (``loom/models/<family>/config.py``), above this
layer: they are handed in as a :class:`FamilyRules` (built by
:func:`loom.models.resolve_config` from the family registry) and run inside this same pass.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import shutil
from dataclasses import dataclass
from typing import (Any, Callable, Literal, Optional, Union, get_args, get_origin,
                    get_type_hints)

from loom.config.batch_ramp import BatchRamp
from loom.config.fault_spec import parse_fault
from loom.config.fields import flag
from loom.config.hybrid_pattern import resolve_hybrid_pattern
from loom.config.model_gptoss import check_gptoss
from loom.config.model_gdn import check_gdn
from loom.config.model_qkclip import check_qk_clip
from loom.config.model_mla import check_mla
from loom.config.model_rope import check_rope
from loom.config.model_llama4 import check_llama4_attention
from loom.config.model_variants import check_layer_variants
from loom.config.parallel_cp import check_context_parallel
from loom.config.pipeline import layout_virtual_stages, validate_pipeline
from loom.config.resilience import (check_non_persistent, check_progress_log, check_pruning,
                                    check_upcycling)
from loom.config.document_masks import check_document_masks
from loom.config.optimizer_precision import check_precision_aware
from loom.config.script_flags import resolve_script_flags
from loom.config.split import parse_split
from loom.config.limits import check_limits
from loom.errors import ConfigError


def base_type(hint: Any) -> tuple[Any, bool]:
    """(type without Optional, whether None is allowed) of a field's type hint."""
    if get_origin(hint) is Union:
        args = [a for a in get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(get_args(hint))
    return hint, False


def choices_of(hint: Any) -> Optional[tuple]:
    """The allowed values of a ``Literal[...]`` (or ``Optional[Literal[...]]``) hint, else None."""
    tp, _ = base_type(hint)
    return get_args(tp) if get_origin(tp) is Literal else None


def coerce(value: Any, hint: Any, what: str) -> Any:
    """``value`` converted to the field type ``hint`` (YAML reads ``1e-3`` as a string).

    ``what`` names the flag or ``file:line: key`` in the message. Raises ConfigError when the
    value cannot be converted or is not one of the choices.
    """
    tp, optional = base_type(hint)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{what}: needs a value")
    choices = choices_of(hint)
    if choices is not None:
        if value not in choices:
            raise ConfigError(f"{what}: {value!r} is not one of {', '.join(choices)}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{what}: expected true or false, got {value!r}")
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{what}: expected {'an integer' if tp is int else 'a number'}, "
                              f"got {value!r}")
        try:
            num = float(value) if tp is float or not isinstance(value, int) else value
        except ValueError:
            raise ConfigError(f"{what}: expected {'an integer' if tp is int else 'a number'}, "
                              f"got {value!r}") from None
        if isinstance(num, float) and not math.isfinite(num):
            raise ConfigError(f"{what}: expected a finite number, got {value!r}")
        if tp is int:
            if isinstance(num, float) and not num.is_integer():
                raise ConfigError(f"{what}: expected an integer, got {value!r}")
            return int(num)
        return float(num)
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{what}: expected a string, got {value!r}")
    return value


def check_bounds(name: str, value: Any, meta: Any) -> None:
    """Raise ConfigError naming ``--name`` when ``value`` breaks the field's
    ``ge``/``gt``/``lt``/``le``."""
    if value is None or isinstance(value, bool) or (value == 0 and meta.get("zero_is_off")):
        return  # 0 of a zero_is_off field: the feature off (stored as None by config_from_args)
    for key, ok, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                          ("lt", lambda v, b: v < b, "<"), ("le", lambda v, b: v <= b, "<=")):
        if key in meta and not ok(value, meta[key]):
            off = " (or 0: off)" if meta.get("zero_is_off") else ""
            raise ConfigError(f"{flag(name)} must be {word} {meta[key]:g}{off}, got {value}")


@functools.lru_cache(maxsize=None)
def _hints(section: type) -> dict:
    return get_type_hints(section)


@dataclass(frozen=True)
class FamilyRules:
    """What the validation pass runs of the model family (config sits below
    :mod:`loom.models`, so the family's rules are handed in; built by
    :meth:`loom.models.FamilyRegistry.rules`): ``name``, its ``--model-type`` (a family
    registered outside the built-in choices is accepted by that name); ``check(cfg,
    world_size)``, its own rules (may fill in values its layout fixes); ``others``, every other
    registered family's ``refuse_own_flags(model_cfg)``; ``replicates_kv_heads``: TP may exceed
    and be a multiple of ``--num-query-groups`` (the family replicates K/V heads);
    ``document_masks``: its model reads the document starts and reset positions of
    ``--reset-attention-mask`` / ``--reset-position-ids``; ``attention_logits``: its attention
    layers record the maximum logits of ``--qk-clip`` / ``--log-max-attention-logit``."""

    name: str
    check: Callable[[Any, int], None]
    others: tuple = ()
    replicates_kv_heads: bool = False
    document_masks: bool = False
    attention_logits: bool = False


def check_fields(cfg: Any, model_type: Optional[str] = None) -> None:
    """Coerce every field of every section to its type and check its choices and bounds;
    ``model_type``: a family name accepted besides the built-in ``--model-type`` choices."""
    for section in dataclasses.fields(cfg):
        if section.name in ("derived", "megatron_no_effect", "config_notes"):  # not sections
            continue
        obj = getattr(cfg, section.name)
        hints = _hints(type(obj))
        for f in dataclasses.fields(obj):
            if f.metadata.get("auto") and getattr(obj, f.name) == "auto":
                continue  # an "N or auto" field (--save-interval)
            if f.name == "model_type" and model_type is not None and obj.model_type == model_type:
                continue  # a registered family's name (FamilyRules.name)
            value = coerce(getattr(obj, f.name), hints[f.name], flag(f.name))
            check_bounds(f.name, value, f.metadata)
            setattr(obj, f.name, value)


# Flags Megatron-LM refuses to run without (megatron/training/arguments.py validate_args; see
# the flag table, loom.config.flag_rows): no silent toy default stands in for them.
REQUIRED_MODEL = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def _required(name: str, example: str, hint: str = "") -> ConfigError:
    return ConfigError(f"{flag(name)} is required (Megatron-LM has no default for it): give "
                       f"{flag(name)} {example}{hint}, or a --config FILE.yaml (or --load "
                       f"checkpoint, for the model shape) that sets it")


def resolve_megatron(cfg: Any) -> None:
    """Megatron's required flags and the values it infers: the depth of a Mamba stack from
    ``--hybrid-override-pattern``; ``--num-query-groups`` 1 under ``--group-query-attention``;
    ``--split`` "969, 30, 1"; fp32 gradient accumulation under ``--bf16``; ``--lr`` and
    ``--train-iters`` not needed under ``--skip-train``. Raises ConfigError
    naming a missing required flag (or a hybrid pattern loom cannot lay out)."""
    m, t = cfg.model, cfg.training
    resolve_hybrid_pattern(m, cfg.parallel)
    for name in REQUIRED_MODEL:
        if getattr(m, name) is None:
            hint = " (or, for a hybrid stack, --hybrid-override-pattern, one character per " \
                "layer)" if name == "num_layers" else ""
            raise _required(name, "N", hint)
    if t.micro_batch_size is None:
        raise _required("micro_batch_size", "N")
    if t.skip_train:  # evaluation only: --lr and --train-iters are about training (Megatron's
        # rule is too); the optimizer and its schedule are built but never stepped, so absent
        # ones get placeholders: the learning rate --min-lr (1e-4 when 0), one iteration
        if t.lr is None:
            t.lr = t.min_lr or 1e-4
        if t.train_iters is None and t.train_samples is None:
            t.train_iters = 1
    if t.lr is None:
        raise _required("lr", "X (the peak learning rate, e.g. 3e-4)")
    if t.train_iters is None and t.train_samples is None:
        raise _required("train_iters", "N", " (or --train-samples N)")
    if m.group_query_attention and m.num_query_groups is None:
        m.num_query_groups = 1  # Megatron's default of --num-query-groups
    if cfg.data.split is None:
        cfg.data.split = "969, 30, 1"  # Megatron's (legacy) default with --data-path
    if t.bf16:  # Megatron (arguments.py:1209-1216): bf16 reduces in fp32 unless asked not to
        if t.accumulate_allreduce_grads_in_fp32 and t.main_grads_dtype != "fp32":
            raise ConfigError("--main-grads-dtype bf16 with --accumulate-allreduce-grads-in-fp32: "
                              "the main gradients cannot be both bf16 and fp32; drop one "
                              "(Megatron-LM arguments.py:1210)")
        t.accumulate_allreduce_grads_in_fp32 = not t.grad_reduce_in_bf16 and (
            t.accumulate_allreduce_grads_in_fp32 or t.main_grads_dtype == "fp32")
    if t.recompute_granularity == "full":
        for name, example in (("recompute_method", "uniform (or block)"),
                              ("recompute_num_layers", "1")):
            if getattr(t, name) is None:
                raise ConfigError(f"--recompute-granularity full needs {flag(name)} "
                                  f"(Megatron's rule; no default): give {flag(name)} {example}")


def _check_model(m: Any, tp: int, replicates_kv_heads: bool = False) -> None:
    """The shape against TP: heads, query groups (unless the family replicates K/V heads and TP
    is a multiple of the groups), FFN, positions, RoPE's even head dimension."""
    if m.num_attention_heads % m.num_kv_groups:
        raise ConfigError(
            f"--num-attention-heads {m.num_attention_heads} is not divisible by "
            f"--num-query-groups {m.num_kv_groups}: choose G dividing the head count")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads and \
            not m.multi_latent_attention:  # MLA's head dims are its own flags
        raise ConfigError(
            f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
            f"{m.num_attention_heads}: choose a head count dividing h (or set --kv-channels)")
    if m.num_attention_heads % tp:
        raise ConfigError(
            f"--num-attention-heads {m.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}: choose a TP size dividing the head count")
    if m.num_kv_groups % tp and not (replicates_kv_heads and tp % m.num_kv_groups == 0):
        raise ConfigError(
            f"--num-query-groups {m.num_kv_groups} is not divisible by "
            f"--tensor-model-parallel-size {tp}: use a TP size that divides the query groups")
    if m.ffn_size % tp:
        raise ConfigError(f"--ffn-hidden-size {m.ffn_size} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    if m.seq_length > m.max_positions:
        raise ConfigError(
            f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
            f"{m.max_positions}: raise --max-position-embeddings or shorten --seq-length")
    if m.rotary and m.head_dim % 2 and not m.multi_latent_attention:
        raise ConfigError(f"RoPE needs an even head dimension, got {m.head_dim}")


def _check_moe(cfg: Any, world_size: int) -> None:
    m, p = cfg.model, cfg.parallel
    e = p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size
    if not m.num_experts:
        if e > 1:
            raise ConfigError("--expert-model-parallel-size needs --num-experts E")
        p.expert_tensor_parallel_size = None  # no experts: no effect (Megatron's too; said at
        return                                # start, loom.training.script_checks.start_notes)
    E, k = m.num_experts, m.moe_router_topk
    if k > E:
        raise ConfigError(f"--moe-router-topk {k} must lie in [1, --num-experts {E}]")
    if E % e:
        raise ConfigError(f"--num-experts {E} is not divisible by --expert-model-parallel-size "
                          f"{e}: choose an EP size dividing the expert count")
    t, c = p.tensor_model_parallel_size, p.context_parallel_size
    d = cfg.data_parallel_size(world_size)
    u = t if etp is None else etp  # Megatron's expert grid: u x e x expert-DP = t c d
    if (t * c * d) % (u * e):
        raise ConfigError(f"--expert-tensor-parallel-size {u} x --expert-model-parallel-size {e} "
                          f"must divide the {t * c * d} ranks of a pipeline stage (TP {t} x CP "
                          f"{c} x DP {d}; Megatron's rule): launch more ranks or lower EP")
    if t % u:
        raise ConfigError(f"--expert-tensor-parallel-size {u} must divide "
                          f"--tensor-model-parallel-size {t}: loom shards an expert only over "
                          f"ranks holding the same tokens (Megatron also across TP groups)")
    shared = m.moe_shared_expert_intermediate_size or 0
    if m.moe_ffn_size % u or shared % t:
        raise ConfigError(f"--moe-ffn-hidden-size {m.moe_ffn_size} must be divisible by "
                          f"--expert-tensor-parallel-size {u} and "
                          f"--moe-shared-expert-intermediate-size {shared} by "
                          f"--tensor-model-parallel-size {t}")
    m.check_moe_fields(t, cfg.training.zero_stage == 3 or cfg.training.use_torch_fsdp2)
    if c > 1 and m.moe_expert_capacity_factor is not None:
        raise ConfigError("--moe-expert-capacity-factor with --context-parallel-size > 1 would "
                          "drop tokens per sequence shard: use dropless routing (omit the "
                          "factor) or CP 1")


def _check_zero(cfg: Any) -> None:
    """``--zero-stage``: 1 is ``--use-distributed-optimizer`` (and that flag alone means 1), 2 is
    it with gradients kept sharded, 3 (= ``--use-torch-fsdp2``) is FSDP2
    (:mod:`loom.parallel.fsdp`), refused where it does not compose."""
    t = cfg.training
    if t.use_torch_fsdp2 and t.zero_stage not in (0, 3):
        raise ConfigError(f"--use-torch-fsdp2 is ZeRO-3 but --zero-stage is {t.zero_stage}: "
                          f"give one of them")
    if t.zero_stage in (1, 2):
        t.use_distributed_optimizer = True
    elif t.zero_stage == 0 and t.use_distributed_optimizer:
        t.zero_stage = 1
    if not (t.use_torch_fsdp2 or t.zero_stage == 3):
        return
    t.zero_stage = 3
    flag = "--zero-stage 3 / --use-torch-fsdp2"
    if cfg.fault_tolerance.check_weight_hash_across_dp_replicas_interval:
        raise ConfigError(f"--check-weight-hash-across-dp-replicas-interval with {flag}: FSDP "
                          f"shards the weights, so there are no replicas to compare (Megatron "
                          f"refuses it with optim_grads_params); drop the check or use ZeRO-1/2")
    if t.use_distributed_optimizer:
        raise ConfigError(f"{flag} already shards the Adam states: drop "
                          f"--use-distributed-optimizer")
    if t.recompute_granularity == "full" and t.recompute_method == "uniform" and \
            t.recompute_num_layers > 1:
        raise ConfigError(f"{flag} gathers each layer's parameters in its own forward, which "
                          f"--recompute-method uniform --recompute-num-layers "
                          f"{t.recompute_num_layers} bypasses: use --recompute-num-layers 1 or "
                          f"--recompute-method block")
    if t.compile:
        raise ConfigError(f"{flag} with --compile is not tested yet (the compiled layer call "
                          f"would trace FSDP2's gather hooks): drop --compile, or use "
                          f"--use-distributed-optimizer (ZeRO-1) with it")


def _check_decrease(t: Any, gbs: int, b_d: int) -> None:
    """``--decrease-batch-size-if-needed``: not with a batch-size ramp (Megatron-Core refuses
    it with ``--step-batch-size-schedule``; Megatron-LM ignores ``--rampup-batch-size`` since
    532ad926), and at least one micro-batch per DP rank (Megatron-Core asserts it)."""
    for flag, value in (("--step-batch-size-schedule", t.step_batch_size_schedule),
                        ("--rampup-batch-size", t.rampup_batch_size)):
        if value:
            raise ConfigError(f"--decrease-batch-size-if-needed rounds a constant global batch: "
                              f"drop it or {flag}")
    _check_sample_schedule(t, "--decrease-batch-size-if-needed")
    if gbs < b_d:
        raise ConfigError(f"--decrease-batch-size-if-needed: --global-batch-size {gbs} is less "
                          f"than one micro-batch per data-parallel rank (--micro-batch-size x "
                          f"data-parallel size = {b_d}): give at least {b_d}, or fewer ranks")


def _resolve_training(cfg: Any, world_size: int) -> None:
    """Megatron's alternative spellings: ``--train-samples`` -> ``--train-iters`` (samples / B),
    ``--recompute-activations`` -> ``--recompute-granularity selective``; checks
    ``--lr-warmup-fraction``. Raises ConfigError naming the flags."""
    t = cfg.training
    ramp = BatchRamp.from_training(t, cfg.model.seq_length)
    if t.train_samples is not None:
        gbs = ramp.batch_at(0) if ramp else cfg.global_batch_size(world_size)
        if t.train_samples < gbs:
            raise ConfigError(f"--train-samples {t.train_samples} is less than one global batch "
                              f"({gbs} samples): give at least {gbs}")
        t.train_iters = ramp.train_iters(t.train_samples) if ramp else t.train_samples // gbs
    if t.lr_warmup_fraction is not None:
        if t.lr_warmup_fraction > 1:
            raise ConfigError(f"--lr-warmup-fraction {t.lr_warmup_fraction} must lie in [0, 1]")
        if t.lr_warmup_iters:
            raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters both set the warm-up: "
                              "give one")
    if t.checkpoint_activations:  # Megatron-LM v1-v2's spelling of full recompute
        if t.recompute_activations or t.recompute_granularity or t.recompute_method:
            raise ConfigError("--checkpoint-activations (Megatron-LM v1-v2) is --recompute-"
                              "granularity full --recompute-method uniform: drop it or the "
                              "--recompute-* flags")
        t.recompute_granularity, t.recompute_method = "full", "uniform"
        t.recompute_num_layers = t.checkpoint_num_layers
    if t.recompute_activations:
        if t.recompute_granularity == "full":
            raise ConfigError("--recompute-activations means --recompute-granularity selective; "
                              "it contradicts --recompute-granularity full: give one")
        t.recompute_granularity = "selective"
    d = cfg.data
    if d.mock_data and (d.train_data_path or d.valid_data_path or d.test_data_path):
        raise ConfigError("--mock-data excludes --train-data-path / --valid-data-path / "
                          "--test-data-path: give one source of data")
    if d.data_path and d.train_data_path:
        raise ConfigError("--data-path and --train-data-path both give the training data: use "
                          "--data-path with --split, or the separate --train/valid/test-data-path")
    _check_fim(d)
    check_sft(d)


SFT_PROMPT_FORMATS = ("nemotron-h-aligned", "nemotron-nano-v2", "identity", "default")
"""Megatron-LM d98e8a6's SFTTokenizer prompt formats (their templates: loom.data.sft)."""


def check_sft(data: Any) -> None:
    """Megatron's ``--sft`` pairing: the SFT dataset tokenizes conversations with
    ``--tokenizer-type SFTTokenizer`` (no other tokenizer can), from a JSONL file (no mock
    conversations at d98e8a6), with a known ``--sft-tokenizer-prompt-format``. ConfigError
    naming the flag. The data: :mod:`loom.data.sft`."""
    if data.sft_tokenizer_prompt_format not in SFT_PROMPT_FORMATS:
        raise ConfigError(f"--sft-tokenizer-prompt-format {data.sft_tokenizer_prompt_format}: "
                          f"unknown; choose one of {', '.join(SFT_PROMPT_FORMATS)}")
    sft_tok = data.tokenizer_type == "SFTTokenizer"
    if data.sft and not sft_tok:
        raise ConfigError("--sft needs --tokenizer-type SFTTokenizer --tokenizer-model DIR (the "
                          "chat template that tokenizes the conversations)")
    if sft_tok and not data.sft:
        raise ConfigError("--tokenizer-type SFTTokenizer tokenizes conversations: give --sft "
                          "with a JSONL --data-path (pretraining data: --tokenizer-type "
                          "HuggingFaceTokenizer)")
    if data.sft and data.mock_data:
        raise ConfigError("--sft with --mock-data: the SFT dataset reads conversations "
                          "(Megatron has no mock ones either); give --data-path FILE.jsonl")


def _check_fim(data: Any) -> None:
    """Megatron's rules for ``--fim-data`` (megatron/training/arguments.py:1684): real data
    (a tokenizer to cut text with), nonzero ``--fim-rate`` and ``--fim-spm-rate``; and
    ``--fim-split-sample`` needs ``--fim-fragment-rate`` (Megatron would fail drawing with
    none). ConfigError naming the flag. The transform: :mod:`loom.data.fim`."""
    if not data.fim_data:
        return
    if data.mock_data:
        raise ConfigError("--fim-data with --mock-data: fill-in-the-middle cuts the text of "
                          "real documents (Megatron refuses it too); give --data-path")
    for flag, value in (("--fim-rate", data.fim_rate), ("--fim-spm-rate", data.fim_spm_rate),
                        ("--fim-fragment-rate", data.fim_fragment_rate)):
        if value is not None and not 0 <= value <= 1:
            raise ConfigError(f"{flag} {value}: a probability, in [0, 1]")
        if not value and flag != "--fim-fragment-rate":
            raise ConfigError(f"{flag} {value}: --fim-data needs a nonzero {flag} (as Megatron; "
                              f"for no FIM drop --fim-data)")
    if data.fim_split_sample is not None and data.fim_fragment_rate is None:
        raise ConfigError("--fim-split-sample needs --fim-fragment-rate (the FIM rate of each "
                          "fragment)")


def _check_precision(t: Any) -> None:
    """``--bf16`` / ``--fp16`` exclusive; ``--overlap-param-gather`` needs the distributed
    optimizer (run after :func:`_check_zero`)."""
    if t.bf16 and t.fp16:
        raise ConfigError("--bf16 and --fp16 exclude each other: give one")
    if t.overlap_param_gather and not t.use_distributed_optimizer:
        raise ConfigError("--overlap-param-gather overlaps the distributed optimizer's "
                          "parameter all-gather: add --use-distributed-optimizer")
    if t.loss_scale is not None and not t.fp16:
        raise ConfigError("--loss-scale scales the loss of --fp16 training: add --fp16")
    top, tiny = 65504.0, 2.0 ** -24  # fp16's largest value and smallest subnormal
    if t.loss_scale is not None and t.loss_scale * tiny > top:
        raise ConfigError(f"--loss-scale {t.loss_scale:g} with --fp16: even fp16's smallest "
                          f"gradient ({tiny:.2g}) times it exceeds fp16's largest value {top:g}, "
                          f"so every step would overflow and be skipped; give at most "
                          f"{top / tiny:.3g} (2**16 and below are usual), or drop --loss-scale")


def _check_sample_schedule(t: Any, flag: str) -> None:
    """With ``--train-samples`` under ``flag`` (a batch-size ramp, ``--decrease-batch-size-if-
    needed``) the schedule counts samples (loom/training/param_schedule.py), as Megatron-LM's
    does: a length given in iterations would be read as none; refused naming its samples flag."""
    if t.train_samples is None:
        return
    by_iters = [name for name, iters, samples in (
        ("--lr-warmup-iters", t.lr_warmup_iters, t.lr_warmup_samples),
        ("--lr-decay-iters", t.lr_decay_iters, t.lr_decay_samples),
        ("--lr-wsd-decay-iters", t.lr_wsd_decay_iters, t.lr_wsd_decay_samples))
        if iters and not samples]
    if by_iters:
        raise ConfigError(f"{by_iters[0]} with {flag} and --train-samples: the learning-rate "
                          f"schedule then counts samples, as Megatron-LM's does: give "
                          f"{by_iters[0].replace('-iters', '-samples')}")


def _check_ramp(cfg: Any, world_size: int, pipelined: bool) -> None:
    """Every global batch size a batch-size ramp reaches within the run
    (:class:`~loom.config.batch_ramp.BatchRamp`) is a multiple of b x d and, pipelined, a
    micro-batch count the schedule takes (:func:`validate_pipeline` at that size). Raises
    ConfigError naming the ramp's flag and the size."""
    t = cfg.training
    ramp = BatchRamp.from_training(t, cfg.model.seq_length)
    if ramp is None:
        return
    _check_sample_schedule(t, ramp.flag)
    unit = t.micro_batch_size * cfg.data_parallel_size(world_size)
    for b in ramp.sizes(t.train_iters):
        if b % unit:
            raise ConfigError(f"{ramp.flag}: the global batch size {b} it reaches is not "
                              f"divisible by --micro-batch-size {t.micro_batch_size} x "
                              f"data-parallel size {unit // t.micro_batch_size} = {unit} (every "
                              f"size must be, as in Megatron-LM): use sizes that are multiples "
                              f"of {unit}")
        if pipelined and b != t.global_batch_size:
            trial = copy.copy(cfg)
            trial.training = copy.copy(t)
            trial.training.global_batch_size = b
            try:
                validate_pipeline(trial, world_size)
            except ConfigError as e:
                raise ConfigError(f"{ramp.flag}, at global batch size {b} ({b // unit} "
                                  f"micro-batches): {e}") from None


def validate_config(cfg: Any, world_size: int, family: Optional[FamilyRules] = None) -> None:
    """Refuse bad values and impossible layouts of a LoomConfig for ``world_size`` ranks.

    Raises :class:`ConfigError` naming the flag and the fix. Fills the resolved values
    (``--pipeline-schedule``, ``--zero-stage``, ...) into ``cfg`` itself: call it on a copy, as
    :meth:`LoomConfig.validate` does, which returns that copy. ``family``: the model family's
    own rules (:class:`FamilyRules`), run after the shape rules; None runs none of them.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}")
    check_fields(cfg, family.name if family else None)
    resolve_megatron(cfg)
    resolve_script_flags(cfg, world_size)  # Megatron's script flags (config/script_flags.py)
    m, p, t = cfg.model, cfg.parallel, cfg.training
    tp, pp, cp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                  p.context_parallel_size)
    _check_model(m, tp, family is not None and family.replicates_kv_heads)
    if family is not None:
        for refuse_own_flags in family.others:  # another family's flags: "drop it"
            refuse_own_flags(m)
        family.check(cfg, world_size)
    check_mla(m, tp, cp, pp)
    check_gdn(m, tp, cp)
    check_gptoss(m, tp, cp)
    check_rope(m)  # after check_gptoss: --enable-gpt-oss sets rope
    check_context_parallel(m, p)
    check_document_masks(cfg, family is None or family.document_masks)
    if world_size % (tp * pp * cp):
        raise ConfigError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = "
            f"{tp * pp * cp}: launch a multiple of {tp * pp * cp} ranks or change the sizes")
    dp = cfg.data_parallel_size(world_size)
    if p.data_parallel_size is not None and p.data_parallel_size != dp:
        raise ConfigError(f"--data-parallel-size {p.data_parallel_size} disagrees with the "
                          f"world size {world_size} / (t p c) = {dp}")
    if m.num_layers % pp and p.decoder_first_pipeline_num_layers is None and \
            p.decoder_last_pipeline_num_layers is None and not p.pipeline_model_parallel_layout:
        raise ConfigError(
            f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size "
            f"{pp}: choose a PP size dividing L, or set --decoder-first-pipeline-num-layers")
    if m.seq_length % (2 * cp) and cp > 1:
        raise ConfigError(f"--seq-length {m.seq_length} must be divisible by 2 x "
                          f"--context-parallel-size {cp} for causal load balancing")
    if p.sequence_parallel and m.seq_length % (tp * cp):
        raise ConfigError(f"--sequence-parallel needs --seq-length {m.seq_length} divisible by "
                          f"--tensor-model-parallel-size {tp} x --context-parallel-size {cp}")
    gbs = cfg.global_batch_size(world_size)
    _resolve_training(cfg, world_size)
    if t.decrease_batch_size_if_needed:
        _check_decrease(t, gbs, t.micro_batch_size * dp)
    elif gbs % (t.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp} = {t.micro_batch_size * dp}: "
            f"use a multiple of {t.micro_batch_size * dp}")
    _check_zero(cfg)
    check_precision_aware(t)  # after --zero-stage resolved --use-distributed-optimizer
    check_qk_clip(cfg, family is None or family.attention_logits)  # after --zero-stage
    _check_moe(cfg, world_size)
    _check_precision(t)
    check_layer_variants(cfg)
    check_llama4_attention(cfg)
    parse_fault(cfg.fault_tolerance.inject_fault)
    ck = cfg.checkpoint
    if ck.override_opt_param_scheduler and ck.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler "
                          "exclude each other: give one")
    if ck.save_interval == "auto" and not (ck.mtbf_hours_per_node or ck.mtbf_hours):
        raise ConfigError("--save-interval auto needs the failure rate: give "
                          "--mtbf-hours-per-node H (or --mtbf-hours H for the whole job)")
    check_non_persistent(ck)
    check_pruning(ck)
    check_upcycling(cfg)
    check_progress_log(cfg)
    if t.lr is not None and t.min_lr > t.lr:
        raise ConfigError(f"--min-lr {t.min_lr} exceeds --lr {t.lr}: lower --min-lr")
    if t.compile and p.device != "cuda" and not (
            os.environ.get("CXX") or any(shutil.which(c) for c in ("g++", "clang++", "c++"))):
        raise ConfigError("--compile on CPU needs a C++ compiler for torch.compile's inductor "
                          "backend (none of $CXX, g++, clang++, c++ found): install one (e.g. "
                          "apt-get install g++) or drop --compile")
    parse_split(cfg.data.split)
    check_limits(cfg)
    if cfg.checkpoint.ckpt_step is not None and not cfg.checkpoint.load:
        raise ConfigError("--ckpt-step needs --load DIR")
    if p.pipeline_schedule is None:  # Megatron: the virtual-stage size alone selects interleaving
        lpv = p.num_layers_per_virtual_pipeline_stage
        many = lpv is not None or (p.pipeline_model_parallel_layout is not None
                                   and layout_virtual_stages(p, cfg.model) > 1)
        p.pipeline_schedule = "interleaved" if many else "1f1b"
    if pp > 1 or p.num_layers_per_virtual_pipeline_stage is not None or \
            p.pipeline_schedule != "1f1b" or p.pipeline_model_parallel_layout:
        validate_pipeline(cfg, world_size)
        _check_ramp(cfg, world_size, pipelined=True)
    else:
        _check_ramp(cfg, world_size, pipelined=False)
