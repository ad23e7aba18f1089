"""Resolution of the Megatron flags of :mod:`loom.config.script_fields` into loom's own fields,
inside the one validation pass (:func:`loom.config.validate.validate_config`), and the refusals
that depend on several flags (a single value loom refuses is a row of the flag table,
:mod:`loom.config.flag_rows`).
"""

from __future__ import annotations

import math
from typing import Any

from loom.config.batch_ramp import BatchRamp
from loom.config.debug_flags import check_debug_flags
from loom.config.evaluation import check_evaluation
from loom.config.optimizer_muon import check_muon
from loom.config.schedule import resolve_schedule
from loom.errors import ConfigError

SHARDING_TO_ZERO = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
"""``--data-parallel-sharding-strategy`` of ``--use-megatron-fsdp`` -> loom's ZeRO stage."""


def _positions(m: Any) -> None:
    if m.use_rotary_position_embeddings:
        m.position_embedding_type = "rope"  # Megatron: arguments.py, the deprecated spelling
    if m.no_position_embedding and not m.rotary:
        raise ConfigError("--no-position-embedding is deprecated in Megatron-LM and refused "
                          "without rotary embeddings: give --position-embedding-type none "
                          "(or rope)")
    if m.rotary_interleaved:
        _interleaved_rope(m)
    if m.rotary_percent > 1:
        raise ConfigError(f"--rotary-percent {m.rotary_percent} must lie in (0, 1]")
    if m.rotary_percent < 1 and m.position_embedding_type == "rope" and (
            m.num_attention_heads and m.hidden_size and m.rotary_dim % 2):
        raise ConfigError(f"--rotary-percent {m.rotary_percent} rotates {m.rotary_dim} channels "
                          f"of each head (of {m.head_dim}): RoPE needs an even number; choose "
                          f"a percent giving one")


def _interleaved_rope(m: Any) -> None:
    """``--rotary-interleaved``: refused where Megatron refuses it (multi-latent attention:
    ``TransformerConfig`` raises; YaRN, gpt-oss's included: ``YarnRotaryEmbedding`` asserts)
    and for Gemma 3, whose own RoPE rotates halves (its check, :mod:`loom.models.gemma3.config`);
    without rotary embeddings it rotates nothing (as in Megatron)."""
    drop = ": drop --rotary-interleaved"
    if m.multi_latent_attention:
        raise ConfigError("--rotary-interleaved does not work with --multi-latent-attention "
                          "(Megatron's rule: MLA lays out its own RoPE key)" + drop)
    if m.position_embedding_type == "yarn" or m.enable_gpt_oss:
        raise ConfigError("--rotary-interleaved: YaRN RoPE rotates halves (Megatron's "
                          "YarnRotaryEmbedding asserts it is not interleaved)" + drop)


def _samples(cfg: Any, world_size: int) -> None:
    t = cfg.training
    if not (t.lr_warmup_samples or t.lr_decay_samples is not None):
        return
    if t.train_samples is None:
        raise ConfigError("--lr-warmup-samples / --lr-decay-samples describe a run by samples: "
                          "give --train-samples N (or use --lr-warmup-iters / --lr-decay-iters "
                          "with --train-iters), as Megatron-LM requires")
    if t.lr_warmup_iters or t.lr_decay_iters is not None:
        raise ConfigError("--lr-warmup-iters / --lr-decay-iters and --lr-warmup-samples / "
                          "--lr-decay-samples both set the schedule: give the samples ones "
                          "with --train-samples")
    gbs = cfg.global_batch_size(world_size)
    if t.lr_warmup_samples:
        t.lr_warmup_iters = math.ceil(t.lr_warmup_samples / gbs)
    if t.lr_decay_samples is not None:
        t.lr_decay_iters = max(1, math.ceil(t.lr_decay_samples / gbs))


def _eval_batches(cfg: Any, world_size: int) -> None:
    """Evaluation batch sizes (Megatron's ``arguments.py`` rule): ``--eval-micro-batch-size``
    defaults to ``--micro-batch-size``, ``--eval-global-batch-size`` to the global batch size
    as Megatron holds it (given, or the final one of ``--rampup-batch-size``; with
    ``--step-batch-size-schedule`` Megatron's ``--global-batch-size`` is b x d; under
    ``--decrease-batch-size-if-needed`` the decreased one, where Megatron-LM keeps B and then
    fails its own divisibility assertion), and must be a multiple of the evaluation micro-batch
    times d. Run before the schedule sets B."""
    lg, t = cfg.logging, cfg.training
    if lg.eval_micro_batch_size is None:
        lg.eval_micro_batch_size = t.micro_batch_size
    dp = cfg.data_parallel_size(world_size)
    if dp < 1 or not t.micro_batch_size:  # a layout the main validation refuses
        return
    if lg.eval_global_batch_size is None:
        lg.eval_global_batch_size = t.micro_batch_size * dp if (
            t.step_batch_size_schedule and t.global_batch_size is None) else \
            cfg.running_global_batch_size(world_size)
        if lg.eval_global_batch_size % (t.micro_batch_size * dp):
            return  # the training batch itself does not divide: refused naming its own flag
    if lg.eval_global_batch_size % (lg.eval_micro_batch_size * dp):
        raise ConfigError(f"--eval-global-batch-size {lg.eval_global_batch_size} is not "
                          f"divisible by --eval-micro-batch-size {lg.eval_micro_batch_size} x "
                          f"data-parallel size {dp} = {lg.eval_micro_batch_size * dp}: use a "
                          f"multiple of {lg.eval_micro_batch_size * dp}")


def _batch_ramp(t: Any) -> None:
    """A malformed ramp refused naming its flag; a step schedule sets the global batch size
    to its last (the final one of ``--rampup-batch-size`` is ``--global-batch-size``)."""
    ramp = BatchRamp.from_training(t, None)
    if ramp is None or ramp.steps is None:
        return
    final = ramp.final
    if t.global_batch_size is None:
        t.global_batch_size = final
    elif t.global_batch_size != final:  # Megatron refuses both flags; loom accepts agreement
        raise ConfigError(f"--step-batch-size-schedule ends at {final} but --global-batch-size "
                          f"is {t.global_batch_size}: drop --global-batch-size (the schedule "
                          f"sets it) or make them agree")


def _virtual_stages(cfg: Any) -> None:
    """``--num-virtual-stages-per-pipeline-rank v`` (Megatron's other spelling of interleaving):
    ``--num-layers-per-virtual-pipeline-stage L / (p v)``; v = 1 is no interleaving, and so is
    ``--num-layers-per-virtual-pipeline-stage L / p`` (one chunk per stage, as in Megatron)."""
    p, L = cfg.parallel, cfg.model.num_layers
    v, pp = p.num_virtual_stages_per_pipeline_rank, p.pipeline_model_parallel_size
    lpv = p.num_layers_per_virtual_pipeline_stage
    if v is None:
        if lpv is not None and lpv * pp == L and p.pipeline_schedule is None:
            p.num_layers_per_virtual_pipeline_stage = None  # one chunk per stage: Megatron's
        return                                           # virtual size 1, not interleaved
    if lpv is not None:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage and "
                          "--num-virtual-stages-per-pipeline-rank both set the interleaving: "
                          "give one (Megatron's rule)")
    if v == 1:
        return
    if p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split:
        return  # the embedding / loss count as layers: _account_in_split lays the stages out
    if L % (pp * v):
        raise ConfigError(f"--num-virtual-stages-per-pipeline-rank {v}: --num-layers {L} is not "
                          f"divisible by --pipeline-model-parallel-size {pp} x {v} (loom's "
                          f"model chunks hold equal numbers of layers)")
    p.num_layers_per_virtual_pipeline_stage = L // (pp * v)


def _account_in_split(p: Any, L: int, mtp: int = 0) -> None:
    """``--account-for-embedding/loss-in-pipeline-split`` (Megatron's rule): the embedding and
    the loss count as layers, (L + e + l) / (p v) "layers" a virtual stage, the first one e and
    the last l real layers fewer. Without interleaving that is
    ``--decoder-first/last-pipeline-num-layers``; with v > 1 virtual stages
    (``--num-virtual-stages-per-pipeline-rank``) a ``--pipeline-model-parallel-layout`` (a
    virtual stage may then hold only the embedding or the loss)."""
    e, loss = int(bool(p.account_for_embedding_in_pipeline_split)), \
        int(bool(p.account_for_loss_in_pipeline_split))
    pp = p.pipeline_model_parallel_size
    if not (e or loss) or pp == 1:
        return
    v = p.num_virtual_stages_per_pipeline_rank or 1
    if p.num_layers_per_virtual_pipeline_stage is not None or p.pipeline_model_parallel_layout \
            or p.decoder_first_pipeline_num_layers or p.decoder_last_pipeline_num_layers:
        raise ConfigError("--account-for-embedding/loss-in-pipeline-split sets the stage split: "
                          "not with --num-layers-per-virtual-pipeline-stage (give "
                          "--num-virtual-stages-per-pipeline-rank), "
                          "--pipeline-model-parallel-layout or "
                          "--decoder-first/last-pipeline-num-layers")
    if (L + e + loss) % (pp * v):
        raise ConfigError(f"--num-layers {L} plus the embedding / loss counted as layers "
                          f"({L + e + loss}) is not divisible by --pipeline-model-parallel-size "
                          f"{pp}" + (f" x --num-virtual-stages-per-pipeline-rank {v}" if v > 1
                                     else "") + " (Megatron's rule)")
    per = (L + e + loss) // (pp * v)
    if v > 1:
        from loom.config.pipeline_layout import layout_from_counts
        counts = [per] * (pp * v)
        counts[0] -= e
        counts[-1] -= loss
        p.pipeline_model_parallel_layout = layout_from_counts(counts, pp, mtp).to_string()
        p.num_virtual_stages_per_pipeline_rank = None
        return
    if per - e < 1 or per - loss < 1:
        raise ConfigError(f"--account-for-embedding/loss-in-pipeline-split leaves a stage "
                          f"without layers ({per} a stage): lower the pipeline size")
    p.decoder_first_pipeline_num_layers = per - e if e else None
    p.decoder_last_pipeline_num_layers = per - loss if loss else None


def read_data_args(data: Any) -> None:
    """``--data-args-path`` / ``--per-split-data-args-path`` read into ``--data-path`` /
    ``--train-data-path``, ``--valid-data-path``, ``--test-data-path`` of ``data`` (a
    DataConfig, in place; Megatron's ``get_blend_and_blend_per_split``: the file's words, and
    the JSON's ``train``, ``valid``, ``test`` keys, each a list or a string of words). Idempotent.
    Raises ConfigError naming the flag for an unreadable file, a missing key, or a path also
    given directly (Megatron asserts one of the two)."""
    import json
    if data.data_args_path is not None:
        text = _read(data.data_args_path, "--data-args-path")
        words = " ".join(text.split())
        if data.data_path not in (None, words):
            raise ConfigError("--data-args-path and --data-path both give the data: give one")
        if not words:
            raise ConfigError(f"--data-args-path {data.data_args_path}: the file is empty")
        data.data_path = words
    if data.per_split_data_args_path is not None:
        flag = "--per-split-data-args-path"
        try:
            split = json.loads(_read(data.per_split_data_args_path, flag))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag} {data.per_split_data_args_path}: not JSON ({e})") from None
        for key in ("train", "valid", "test"):
            if not isinstance(split, dict) or key not in split:
                raise ConfigError(f"{flag} {data.per_split_data_args_path}: no {key!r} key (the "
                                  f"file holds {{\"train\", \"valid\", \"test\"}})")
            value = split[key]
            words = " ".join(value.split() if isinstance(value, str) else map(str, value))
            field = f"{key}_data_path"
            if getattr(data, field) not in (None, words):
                raise ConfigError(f"{flag} and --{key}-data-path both give the {key} data: "
                                  f"give one")
            setattr(data, field, words or None)


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror})") from None


def resolve_script_flags(cfg: Any, world_size: int) -> None:
    """Megatron's spellings into loom's fields (in place, inside validation): rotary-embedding
    aliases, schedules in samples -> iterations (B samples each, rounded up; the WSD and
    weight-decay schedule flags: :func:`loom.config.schedule.resolve_schedule`), the final batch
    size of a ramp, ``--use-megatron-fsdp`` -> ``--zero-stage``. Raises ConfigError naming the
    flag for values loom refuses (partial rotary embeddings of an odd width, ...)."""
    m, t = cfg.model, cfg.training
    read_data_args(cfg.data)
    _positions(m)
    _eval_batches(cfg, world_size)
    _batch_ramp(t)
    _samples(cfg, world_size)
    resolve_schedule(cfg, world_size)  # WSD's annealing, the weight-decay schedule
    if t.use_megatron_fsdp and not t.zero_stage and not t.use_torch_fsdp2:
        t.zero_stage = SHARDING_TO_ZERO[t.data_parallel_sharding_strategy]
        if t.zero_stage in (1, 2):
            t.use_distributed_optimizer = True
        elif t.zero_stage == 3:  # FSDP2 shards the optimizer and gathers parameters itself
            t.use_distributed_optimizer = False  # (prefetching the next layer's: Megatron
            t.overlap_param_gather = False       # FSDP's --overlap-param-gather)
    check_muon(t)  # --optimizer dist_muon: muon with --use-distributed-optimizer
    _virtual_stages(cfg)
    _account_in_split(cfg.parallel, m.num_layers, m.mtp_num_layers or 0)
    if m.squared_relu and m.gated_linear_unit:  # Megatron: assert not args.swiglu
        raise ConfigError("--squared-relu replaces GeLU in the MLP and the experts: drop "
                          + ("--swiglu" if m.swiglu else "--quick-geglu"))
    if cfg.logging.moe_per_layer_logging and not m.num_experts:
        raise ConfigError("--moe-per-layer-logging logs the losses of each MoE layer: this "
                          "model has none (add --num-experts or drop --moe-per-layer-logging)")
    if m.moe_token_drop_policy == "position" and m.moe_expert_capacity_factor is not None:
        raise ConfigError("--moe-token-drop-policy position: loom drops the tokens of lowest "
                          "router score over capacity; give --moe-token-drop-policy probs")
    if t.decoupled_min_lr is not None and t.decoupled_lr is None:
        raise ConfigError("--decoupled-min-lr needs --decoupled-lr")
    check_debug_flags(cfg, world_size)  # --profile*, --deterministic-mode
    check_evaluation(cfg)  # --full-validation, --multiple-validation-sets, --iterations-to-skip
