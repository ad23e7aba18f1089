"""``loom plan``'s flags -> the search's fixed dimensions (:func:`fixed_from_args`) and the CP
communication type (:func:`cp_comm_type_of`); ConfigError naming the flag for a contradiction.
And what loom plan does with every other flag of loom train: read, free in a step, or named on
stderr as not in the prediction (:data:`PLAN_READS` ... :func:`unmodelled_note`).
"""

from __future__ import annotations

from types import SimpleNamespace

from loom.config import ConfigError, ModelConfig, flag
from loom.config.optimizer_muon import check_muon
from loom.config.optimizer_precision import STATE_DTYPE_FLAGS, check_precision_aware


def fixed_from_args(args, model: ModelConfig) -> dict:
    """The layout dimensions the flags fix (:func:`loom.planner.search.enumerate_layouts`'s
    ``fixed``): sizes, micro-batch, recompute, SP, ZeRO stage, EP, expert TP (MoE models
    only: loom train ignores it for a dense model, as Megatron does), the pipeline split
    (first/last layers, accounting, a layout string, virtual stages), the schedule and the
    interleaved schedule's micro-batch group (``vpg``); ``--pipeline-schedule 1f1b`` fixes one
    chunk per rank (``vp`` 1), ``interleaved`` more than one (``interleaved``), as loom train
    reads them."""
    fixed = {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
             "cp": args.context_parallel_size, "dp": args.data_parallel_size,
             "mbs": args.micro_batch_size,
             # --recompute-activations: Megatron's selective recompute (arguments.py);
             # --checkpoint-activations: v1-v2's full recompute (every layer)
             "recompute": args.recompute_granularity or (
                 "selective" if getattr(args, "recompute_activations", None) else None) or (
                 "full" if getattr(args, "checkpoint_activations", None) else None),
             # Megatron turns --sequence-parallel off at TP 1 (arguments.py): not a constraint;
             # --no-sequence-parallel (False, not None) fixes it off
             "sp": 0 if args.sequence_parallel is False else
             1 if args.sequence_parallel and args.tensor_model_parallel_size != 1
             else None, "zero": args.zero_stage,
             "ep": args.expert_model_parallel_size}
    if model.num_experts:
        # the dispatcher the flag names, else one a config file or preset gave the model (not
        # Megatron's default allgather), else None: searched (loom.planner.moe.DISPATCHERS)
        fixed["disp"] = getattr(args, "moe_token_dispatcher_type", None) or (
            model.moe_token_dispatcher_type
            if model.moe_token_dispatcher_type != ModelConfig().moe_token_dispatcher_type
            or model.moe_shared_expert_overlap else None)
        fixed["etp"] = getattr(args, "expert_tensor_parallel_size", None)
        if fixed["etp"] and fixed["tp"] and fixed["tp"] % fixed["etp"]:
            raise ConfigError(f"--expert-tensor-parallel-size {fixed['etp']} must divide "
                              f"--tensor-model-parallel-size {fixed['tp']} (loom train's rule)")
    if args.use_distributed_optimizer:
        fixed["zero"] = 1
    elif args.use_distributed_optimizer is False and fixed["zero"] is None and not (
            args.use_torch_fsdp2 or getattr(args, "use_megatron_fsdp", False)):
        fixed["zero"] = 0  # --no-use-distributed-optimizer: plain data parallelism
    if args.use_torch_fsdp2:
        fixed["zero"] = 3
    if getattr(args, "use_megatron_fsdp", False) and not args.zero_stage and \
            not args.use_torch_fsdp2:  # its sharding strategy is a ZeRO stage (loom train's map)
        from loom.config.script_flags import SHARDING_TO_ZERO
        fixed["zero"] = SHARDING_TO_ZERO[getattr(args, "data_parallel_sharding_strategy", None)
                                         or "optim_grads_params"]
    if fixed["zero"] not in (None, 0, 1, 2, 3):
        raise ConfigError(f"--zero-stage {fixed['zero']} must be 0, 1, 2 or 3")
    if getattr(args, "use_precision_aware_optimizer", False) and fixed["zero"] is None:
        fixed["zero"] = 1  # Megatron: it needs --use-distributed-optimizer
    check_muon(SimpleNamespace(  # loom train's Muon refusals (--fp16, FSDP) on the plan's flags
        optimizer=getattr(args, "optimizer", None) or "adam", fp16=bool(getattr(args, "fp16", 0)),
        use_torch_fsdp2=bool(args.use_torch_fsdp2), zero_stage=fixed["zero"],
        use_megatron_fsdp=bool(getattr(args, "use_megatron_fsdp", False)),
        use_distributed_optimizer=fixed["zero"] in (1, 2)))
    check_precision_aware(SimpleNamespace(  # loom train's check on the plan's flags
        **{name: getattr(args, name, None) or "fp32" for name, _ in STATE_DTYPE_FLAGS},
        use_precision_aware_optimizer=bool(getattr(args, "use_precision_aware_optimizer", False)),
        optimizer_cpu_offload=bool(getattr(args, "optimizer_cpu_offload", False)),
        optimizer=getattr(args, "optimizer", None) or "adam", zero_stage=fixed["zero"],
        use_torch_fsdp2=bool(args.use_torch_fsdp2),
        decoupled_weight_decay=getattr(args, "decoupled_weight_decay", True) is not False,
        use_distributed_optimizer=fixed["zero"] in (1, 2)))
    if args.expert_model_parallel_size and args.expert_model_parallel_size > 1 and \
            not model.num_experts:
        raise ConfigError("--expert-model-parallel-size needs an MoE model: give --num-experts E "
                          "or an MoE preset (mixtral-8x7b, deepseek-v3, ...)")
    fixed["first_layers"] = getattr(args, "decoder_first_pipeline_num_layers", None)
    fixed["last_layers"] = getattr(args, "decoder_last_pipeline_num_layers", None)
    fixed["account_embedding"] = bool(getattr(args, "account_for_embedding_in_pipeline_split",
                                              False)) or None
    fixed["account_loss"] = bool(getattr(args, "account_for_loss_in_pipeline_split", False)) or None
    if (fixed["account_embedding"] or fixed["account_loss"]) and \
            (fixed["first_layers"] is not None or fixed["last_layers"] is not None):
        raise ConfigError("--account-for-*-in-pipeline-split and --decoder-first/last-pipeline-"
                          "num-layers both set the first/last stage: give one of them")
    fixed["layout"] = getattr(args, "pipeline_model_parallel_layout", None)
    if fixed["layout"] and (fixed["first_layers"] is not None or fixed["last_layers"] is not None
                            or fixed["account_embedding"] or fixed["account_loss"]
                            or args.num_layers_per_virtual_pipeline_stage):
        raise ConfigError("--pipeline-model-parallel-layout places every layer itself: drop "
                          "--decoder-first/last-pipeline-num-layers, --account-for-*-in-"
                          "pipeline-split and --num-layers-per-virtual-pipeline-stage")
    chunks = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    if chunks is not None:  # Megatron's other spelling of interleaving: v chunks per rank
        if args.num_layers_per_virtual_pipeline_stage:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage and "
                              "--num-virtual-stages-per-pipeline-rank both set the "
                              "interleaving: give one (Megatron's rule)")
        fixed["vp"] = chunks
    if chunks and chunks > 1 and (fixed["account_embedding"] or fixed["account_loss"]) and \
            args.pipeline_model_parallel_size:  # a chunk may hold only the embedding / loss
        fixed["layout"] = accounted_layout(args, model, chunks)
        for k in ("account_embedding", "account_loss", "vp"):
            fixed.pop(k)
    if args.num_layers_per_virtual_pipeline_stage:
        if not args.pipeline_model_parallel_size:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage needs "
                              "--pipeline-model-parallel-size in loom plan")
        from loom.planner.stages import accounted_split, given_split
        pp, per_chunk = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
        split = (accounted_split(model.num_layers, pp, fixed["account_embedding"],
                                 fixed["account_loss"])
                 if fixed["account_embedding"] or fixed["account_loss"] else
                 given_split(model.num_layers, pp, fixed["first_layers"], fixed["last_layers"]))
        lf, ll = split or (0, 0)
        # uneven first/last stages: N layers per chunk of a middle stage (Megatron-Core)
        stage = ((model.num_layers - lf - ll) // (pp - 2) if pp > 2 else max(lf, ll)) if lf \
            else model.num_layers // pp
        fixed["vp"] = stage // per_chunk
    group = getattr(args, "microbatch_group_size_per_virtual_pipeline_stage", None)
    if group is not None:  # the interleaved rows' micro-batch group N (loom train's flag)
        pp = args.pipeline_model_parallel_size
        if pp and group < pp:
            raise ConfigError(f"--microbatch-group-size-per-virtual-pipeline-stage {group} is "
                              f"below --pipeline-model-parallel-size {pp}: the interleaved "
                              f"schedule needs N >= p (Megatron-Core); raise N or drop it")
        fixed["vpg"] = group
    sched = getattr(args, "pipeline_schedule", None)
    if sched in ("zero-bubble", "zbv"):  # ZB-H1 / ZB-V (1F1B, interleaved: searched as 0)
        fixed["zb"] = 1 if sched == "zero-bubble" else 2
    elif sched in ("1f1b", "interleaved"):  # loom train: 1f1b one chunk, interleaved > 1
        fixed["zb"] = 0
        vp = fixed.get("vp")  # a layout string places its own chunks: left to it
        if sched == "1f1b" and vp not in (None, 1):
            raise ConfigError("--pipeline-schedule 1f1b runs one model chunk per rank, which "
                              "conflicts with the virtual stages given: drop "
                              "--pipeline-schedule (or set it to interleaved), or drop the "
                              "virtual-stage flag (loom train's rule)")
        if sched == "1f1b" and vp is None and not fixed.get("layout"):
            fixed["vp"] = 1
        if sched == "interleaved":
            if args.pipeline_model_parallel_size == 1:
                raise ConfigError("--pipeline-schedule interleaved needs "
                                  "--pipeline-model-parallel-size > 1 (loom train's rule)")
            fixed["interleaved"] = True  # v > 1 (enumerate_layouts)
    elif sched == "gpipe":
        fixed["zb"] = 3
    if getattr(args, "recompute_method", None) == "block" and \
            getattr(args, "recompute_num_layers", None):
        fixed["recompute"], fixed["rcl"] = "full", args.recompute_num_layers
    if args.recompute_granularity not in (None, "none", "selective", "full"):
        raise ConfigError("--recompute-granularity must be selective or full")
    return {k: v for k, v in fixed.items() if v is not None}


def accounted_layout(args, model: ModelConfig, chunks: int) -> str:
    """The ``--pipeline-model-parallel-layout`` loom train lays out for
    ``--account-for-embedding/loss-in-pipeline-split`` with ``chunks`` > 1 virtual stages per
    rank (:mod:`loom.config.script_flags`, Megatron's rule); ConfigError where it does not
    divide."""
    from types import SimpleNamespace
    from loom.config.script_flags import _account_in_split
    par = SimpleNamespace(
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        num_virtual_stages_per_pipeline_rank=chunks, num_layers_per_virtual_pipeline_stage=None,
        pipeline_model_parallel_layout=None, decoder_first_pipeline_num_layers=None,
        decoder_last_pipeline_num_layers=None)
    _account_in_split(par, model.num_layers, model.mtp_num_layers or 0)
    return par.pipeline_model_parallel_layout


def cp_comm_type_of(args) -> str | None:
    """``--cp-comm-type`` (the first entry when the config gives one per layer); None when not
    given: the search tries every type (:func:`loom.planner.refine.cp_types`)."""
    v = getattr(args, "cp_comm_type", None)  # config: words, one per layer allowed
    if not v:
        return None
    return (v[0] if isinstance(v, (list, tuple)) else str(v).split()[0])


def cp_a2a_size_of(args) -> int:
    """a2a+p2p's all-to-all group A of ``--hierarchical-context-parallel-sizes A B`` (0 when
    not given: the planner takes a node's CP ranks), which fixes ``--context-parallel-size``
    to A x B where it is not given (``args`` changed in place); ConfigError naming the flags
    when a given CP size differs."""
    from loom.config.parallel_cp import hierarchical_sizes
    sizes = hierarchical_sizes(args)
    if sizes is None:
        return 0
    a, b = sizes
    cp = args.context_parallel_size
    if cp is None:
        args.context_parallel_size = a * b
    elif cp != a * b:
        raise ConfigError(f"--hierarchical-context-parallel-sizes {a} {b} multiply to {a * b}, "
                          f"not --context-parallel-size {cp}: give sizes whose product is {cp}")
    return a


# -- what loom plan does with each of loom train's flags ---------------------------------------
# Every config field outside the model section is in exactly one of PLAN_READS, NO_STEP_COST (or
# a NO_STEP_COST_SECTIONS section) and UNMODELLED; every model field is read by the planner's
# formulas, or in NO_STEP_COST_MODEL or UNPRICED_MODEL. tests/planner/test_plan_flag_coverage.py
# checks both partitions against the config, so a new field needs a decision here.
PLAN_READS = frozenset({
    # the layout: fixed_from_args, cp_comm_type_of, cp_a2a_size_of
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "data_parallel_size", "num_layers_per_virtual_pipeline_stage", "pipeline_schedule",
    "pipeline_model_parallel_layout", "microbatch_group_size_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "sequence_parallel", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "cp_comm_type", "hierarchical_context_parallel_sizes",
    "micro_batch_size", "global_batch_size", "use_distributed_optimizer", "zero_stage",
    "use_torch_fsdp2", "use_megatron_fsdp", "data_parallel_sharding_strategy",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_activations",
    "checkpoint_activations",
    # data-parallel overlap and buckets (loom.planner.cli: dp_overlap_of and run's Options)
    "overlap_grad_reduce", "overlap_param_gather", "ddp_bucket_size",
    # 16-bit weights, the gradient buffer's dtype (gradient_option) and the optimizer's states
    # are what it counts (the printed command carries --bf16, or --fp16 when given, and the flag
    # that sets the gradients' dtype); --optimizer adam / sgd's states
    "bf16", "fp16", "accumulate_allreduce_grads_in_fp32", "grad_reduce_in_bf16", "sgd_momentum",
    # --optimizer and Muon's step (optimizer_option: its states and Newton-Schulz iterations)
    "optimizer", "muon_num_ns_steps", "muon_split_qkv", "muon_fp32_matmul_prec", "muon_tp_mode",
    # the precision-aware optimizer's stored bytes (optimizer_option, gradient_option)
    "use_precision_aware_optimizer", "main_grads_dtype", "main_params_dtype", "exp_avg_dtype",
    "exp_avg_sq_dtype", "optimizer_offload_fraction",
})
NO_STEP_COST = frozenset({
    # --checkpoint-activations' chunk (uniform full recompute): every layer recomputed alike
    "checkpoint_num_layers",
    # the schedule of values, not the cost of a step
    "lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "lr_warmup_samples",
    "lr_decay_samples", "lr_warmup_init", "lr_warmup_fraction", "decoupled_lr",
    "decoupled_min_lr", "weight_decay", "weight_decay_norms_and_biases",
    "decoupled_weight_decay", "lr_wsd_decay_style",
    "lr_wsd_decay_iters", "lr_wsd_decay_samples", "start_weight_decay", "end_weight_decay", "weight_decay_incr_style",
    "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
    "seed", "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window",
    "hysteresis", "calculate_per_token_loss", "muon_momentum",
    "muon_nesterov", "muon_scale_mode", "muon_coefficient_type",
    "muon_extra_scale_factor", "muon_scalar_optimizer",
    # how long, from where, and what happens around the steps (the step itself is unchanged;
    # a batch ramp-up's smaller first batches are before the planned step)
    "train_iters", "train_samples", "exit_duration_in_mins", "exit_on_nonfinite", "skip_train",
    "rampup_batch_size", "step_batch_size_schedule", "ckpt_format", "pretrained_checkpoint",
    "use_checkpoint_args", "log_num_zeros_in_grad", "log_params_norm", "iterations_to_skip",
    "distributed_backend", "device",
})
NO_STEP_COST_SECTIONS = ("data", "logging", "checkpoint", "fault_tolerance")
"""Sections whose every field is outside the step's time and memory (data, logging, checkpoint
and failure handling; profiling and memory history slow only the steps they record)."""
UNMODELLED = {
    "compile": "priced as eager PyTorch kernels",
    "optimizer_cpu_offload": "its memory is priced (the offloaded states off the GPU), the host "
                             "step and the gradient and weight copies are not",
    "deterministic_mode": "priced at the default kernels' speed",
    "export_kd_teacher_load": "the distillation teacher's forward and weights are not priced",
    "export_kd_cfg": "the distillation losses are not priced",
    "decrease_batch_size_if_needed": "only layouts whose micro-batch x data-parallel size "
                                     "divides --global-batch-size are searched (none that "
                                     "would decrease it)",
}
"""Config fields that change a step's time or memory and that the planner does not price:
named once on stderr when given (:func:`unmodelled_note`)."""
UNPRICED_MODEL = {
    "window_size": "sliding-window attention, priced as full causal attention",
    "attention_chunk_size": "chunked attention, priced as full causal attention",
    "sliding_window": "Gemma 3's sliding-window layers, priced as full causal attention",
    "attn_logit_softcapping": "attention soft-capping, priced as fused attention",
    "attention_output_gate": "the attention output gate's saved activations (its parameters "
                             "and FLOPs are priced)",
    "linear_attention_freq": "Gated DeltaNet layers' activation memory and kernel speed, "
                             "priced as attention layers' (their parameters and FLOPs are "
                             "Megatron's)",
    "experimental_attention_variant": "DeepSeek sparse attention priced as dense attention; "
                                      "Gated DeltaNet layers' memory as attention's",
    "moe_shared_expert_overlap": "the shared expert's overlap with the dispatch",
    "fp32_residual_connection": "the fp32 residual stream, priced as 16-bit activations",
    "qk_clip": "the recorded attention logits' extra q k^T and the clip after the step",
}
"""Model fields that change a step's time or memory and that the planner does not price:
named once on stderr when they differ from the default (:func:`unpriced_model_note`)."""
NO_STEP_COST_MODEL = frozenset({
    # initialization, losses' scales, router details and numerics of the same shapes
    "init_method_std", "exclude_padded_vocab", "apply_layernorm_1p", "post_layernorm",
    "embedding_init_method_std", "init_method_xavier_uniform", "torchtitan_init",
    "apply_residual_connection_post_layernorm", "qk_l2_norm", "qk_l2_norm_rope_layers_only",
    "moe_router_pre_softmax", "moe_z_loss_coeff", "moe_router_load_balancing_type",
    "moe_router_bias_update_rate", "moe_router_dtype", "moe_router_force_load_balancing",
    "moe_router_force_biased", "moe_input_jitter_eps",
    "moe_token_drop_policy", "mtp_loss_scaling_factor", "bert_binary_head",
    "query_pre_attn_scalar", "apply_wd_to_qk_layernorm",
    "use_mup", "mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult",
    "mup_base_head_dim", "mup_attn_scale_power",
    # positions: elementwise work the elementwise term already counts
    "rotary_base_local", "rotary_percent", "rotary_interleaved", "yarn_beta_fast",
    "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
    "rope_scaling_original_max_position_embeddings",
    "yarn_beta_slow", "yarn_correction_range_round_to_int", "use_rope_scaling",
    "rope_scaling_factor", "rotary_seq_len_interpolation_factor", "no_rope_freq",
    "attn_temperature_floor_scale", "attn_temperature_scale",
    # activations of the same widths (the gated / ungated choice itself is priced)
    "quick_geglu", "glu_linear_offset", "activation_func_clamp_value", "squared_relu",
    # spellings resolved into priced fields by loom's config (a bundle, a head count, ...)
    "enable_gpt_oss", "mamba_num_heads", "use_rotary_position_embeddings",
    "no_position_embedding",
    # details of layers that are themselves named as not priced
    "sliding_window_pattern", "layer_types", "window_attn_skip_freq", "dsa_indexer_topk", "dsa_indexer_loss_coeff",
    "dsa_indexer_use_sparse_loss", "no_dsa_indexer_rotate_activation",
    "no_dsa_indexer_scoring_relu", "dsa_indexer_k_norm_epsilon", "dsa_indexer_k_norm_fp32",
    "qk_clip_alpha", "qk_clip_threshold",
})
"""Model fields outside the planner's formulas that cost nothing it prices; every other model
field is read by them (``tests/planner/test_plan_flag_coverage.py`` checks both)."""


def unpriced_model_note(model) -> str | None:
    """``not in the prediction: --flag value (why); ...`` for the :data:`UNPRICED_MODEL` fields of
    ``model`` (a ModelConfig) that differ from the default, or None."""
    from loom.config import ModelConfig
    default = ModelConfig()
    return _not_priced([_given(model, name, why) for name, why in UNPRICED_MODEL.items()
                        if getattr(model, name, None) not in (None, False,
                                                              getattr(default, name, None))])


def _given(values, name: str, why: str) -> str:
    """``--flag [value] (why)`` of field ``name`` as ``values`` holds it."""
    v = getattr(values, name)
    return flag(name) + ("" if v is True else f" {v}") + f" ({why})"


def _not_priced(items: list) -> str | None:
    """``not in the prediction: item; ...``, or None without items."""
    return "not in the prediction: " + "; ".join(items) if items else None


def unmodelled_note(args, no_effect: dict, model=None) -> list[str]:
    """The lines loom plan prints on stderr (``loom plan: warning: ...``) for flags given that
    its prediction does not include: loom train's own no-effect report of the Megatron flags
    (:func:`loom.config.flag_table.no_effect_report`: the plan is for loom train, which runs
    without them, e.g. ``--distribute-saved-activations``, which the planner prices only for
    published Megatron runs), and the config fields of :data:`UNMODELLED` (``--optimizer adam``
    and ``sgd`` are priced: :func:`optimizer_option`)."""
    from loom.config.flag_table import no_effect_report
    no_effect = dict(no_effect)
    out = list(no_effect.pop("config_notes", ()))  # a torchtitan --config FILE.toml's
    report = no_effect_report(no_effect, command="loom plan")
    if report:
        out.append(report)
    notes = (unpriced_note(args), None if model is None else unpriced_model_note(model))
    return out + [n for n in notes if n]


def unpriced_note(values) -> str | None:
    """``not in the prediction: --flag value (why); ...`` for the :data:`UNMODELLED` fields set
    in ``values`` (loom plan's parsed flags, or a config's ``training`` section: the same
    names) and for fp32 training (``bf16`` False, not None: ``--no-bf16`` given to loom plan,
    or a run's config without ``--bf16`` / ``--fp16``), or None."""
    items = [_given(values, name, why) for name, why in UNMODELLED.items()
             if getattr(values, name, None) not in (None, False)]
    if getattr(values, "bf16", None) is False and not getattr(values, "fp16", None):
        items.append("fp32, no --bf16 / --fp16 (priced as 16-bit training)")
    return _not_priced(items)


def gradient_option(values) -> dict:
    """``{"grad_bytes": 2 or 4}``: the gradient buffer's bytes per parameter under Megatron's
    rule (arguments.py:1204-1216), from ``values`` (loom plan's parsed flags, or a run's
    TrainingConfig): with bf16 (the planner's 16-bit default when neither ``--bf16`` nor
    ``--fp16`` is given) fp32 unless ``--grad-reduce-in-bf16`` or ``--main-grads-dtype bf16``;
    with ``--fp16`` fp16 unless ``--accumulate-allreduce-grads-in-fp32``; in an fp32 run fp32
    (4)."""
    fp16 = bool(getattr(values, "fp16", False))
    bf16 = getattr(values, "bf16", None) is not False and not fp16
    in_fp32 = (not getattr(values, "grad_reduce_in_bf16", False) and
               (getattr(values, "main_grads_dtype", None) or "fp32") == "fp32" if bf16
               else bool(getattr(values, "accumulate_allreduce_grads_in_fp32", False)))
    return {"grad_bytes": 4 if in_fp32 or not (bf16 or fp16) else 2}


def optimizer_option(args) -> dict:
    """``{"optimizer_state_bytes": bytes, "master_bytes": bytes}`` for ``--optimizer`` adam (the
    default) or sgd (with ``--sgd-momentum``, Megatron's default 0.9):
    :func:`loom.planner.memory.optimizer_state_bytes`, and with
    ``--use-precision-aware-optimizer`` the stored bytes of its dtypes
    (:func:`loom.planner.memory.precision_aware_bytes`); for Muon (``muon`` / ``dist_muon``)
    AdamW's states, which its embeddings, output layer and vectors keep, and its step
    (``muon_ns_steps`` from ``--muon-num-ns-steps``, ``--muon-split-qkv``,
    ``--muon-fp32-matmul-prec``, ``--muon-tp-mode``: :mod:`loom.planner.muon`)."""
    from loom.planner.memory import optimizer_state_bytes, precision_aware_bytes
    momentum = getattr(args, "sgd_momentum", None)
    state = optimizer_state_bytes(getattr(args, "optimizer", None) or "adam",
                                  0.9 if momentum is None else momentum)
    if state is None:  # Muon: its momentum on the layers' weights, AdamW's states elsewhere
        prec = getattr(args, "muon_fp32_matmul_prec", None) or "medium"
        steps = getattr(args, "muon_num_ns_steps", None)
        return {"optimizer_state_bytes": optimizer_state_bytes("adam"),
                "muon_ns_steps": 5 if steps is None else steps,
                "muon_split_qkv": getattr(args, "muon_split_qkv", None) is not False,
                "muon_fp32": prec != "medium",
                "muon_blockwise": getattr(args, "muon_tp_mode", None) == "blockwise"}
    if not getattr(args, "use_precision_aware_optimizer", False):
        return {"optimizer_state_bytes": state}
    fp16 = bool(getattr(args, "fp16", False))
    frac = getattr(args, "optimizer_offload_fraction", None)  # Megatron's default 1.0
    offload = {"optimizer_offload_fraction": 1.0 if frac is None else frac} \
        if getattr(args, "optimizer_cpu_offload", False) else {}
    return offload | precision_aware_bytes(
        *(getattr(args, name, None) or "fp32" for name in ("exp_avg_dtype", "exp_avg_sq_dtype",
                                                           "main_params_dtype")),
        bf16=getattr(args, "bf16", None) is not False and not fp16)
