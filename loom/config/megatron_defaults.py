"""Megatron-LM's defaults of every loom flag that carries a Megatron-LM name: one immutable
table, ``{field: (Megatron's default or REQUIRED, "file:line", note)}``, read from Megatron-LM
at commit d98e8a64ddf3 (``megatron/training/arguments.py`` and the config dataclasses its flags
are generated from). Each loom default equals its row (tests/unit/test_megatron_defaults.py checks
the dataclass default and what validation resolves, and that docs/megatron-defaults.md lists
every row); a REQUIRED flag is refused when omitted, naming it. ``SAME_MEANING`` lists the few
fields whose loom value spells Megatron's default differently (``None`` for "off" and the like).
Flags loom has that Megatron lacks (``--model-type``, ``--zero-stage``, ...) are not here.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, NamedTuple

COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
"""The NVIDIA/Megatron-LM commit the rows were read from."""


class _Required:
    """Marker: Megatron-LM refuses to run without the flag."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


class MegatronDefault(NamedTuple):
    """One row: Megatron's default (or :data:`REQUIRED`), its source ``file:line``, a note."""

    default: Any
    source: str
    note: str


MEGATRON_DEFAULTS = MappingProxyType({name: MegatronDefault(*row) for name, row in {
    "num_layers": (REQUIRED, "megatron/training/arguments.py:1314", "required; a hybrid stack's depth is the length of --hybrid-override-pattern"),
    "hidden_size": (REQUIRED, "megatron/training/arguments.py:1314", ''),
    "num_attention_heads": (REQUIRED, "megatron/training/arguments.py:1314", ''),
    "num_query_groups": (1, "megatron/core/transformer/transformer_config.py:175", 'used only with --group-query-attention; without it a (megatron/training/argument_utils.py:330)'),
    "group_query_attention": (False, "megatron/training/arguments.py:2382", ''),
    "ffn_hidden_size": (None, "megatron/core/transformer/transformer_config.py:180", ''),
    "kv_channels": (None, "megatron/core/transformer/transformer_config.py:184", ''),
    "seq_length": (REQUIRED, "megatron/training/arguments.py:1350", ''),
    "max_position_embeddings": (REQUIRED, "megatron/training/arguments.py:1314", 'loom infers --seq-length when omitted (every Megatron command line gives it, so none changes meaning)'),
    "vocab_size": (None, "megatron/training/config/training_config.py:679", ''),
    "make_vocab_size_divisible_by": (128, "megatron/training/arguments.py:2441", ''),
    "normalization": ('LayerNorm', "megatron/core/transformer/transformer_config.py:256", ''),
    "norm_epsilon": (1e-05, "megatron/core/transformer/transformer_config.py:201", ''),
    "position_embedding_type": ('learned_absolute', "megatron/training/arguments.py:2397", 'mrope and relative not in loom'),
    "rotary_base": (10000.0, "megatron/training/arguments.py:2418", 'an int in Megatron'),
    "swiglu": (False, "megatron/training/arguments.py:2450", ''),
    "openai_gelu": (False, "megatron/training/arguments.py:2444", ''),
    "untie_embeddings_and_output_weights": (False, "megatron/training/arguments.py:2460", ''),
    "disable_bias_linear": (False, "megatron/core/transformer/transformer_config.py:212", "Megatron's dest add_bias_linear defaults to True: the flag is off"),
    "hidden_dropout": (0.1, "megatron/core/transformer/transformer_config.py:188", ''),
    "attention_dropout": (0.1, "megatron/core/transformer/transformer_config.py:191", ''),
    "init_method_std": (0.02, "megatron/core/transformer/transformer_config.py:400", ''),
    "add_qkv_bias": (False, "megatron/core/transformer/transformer_config.py:218", ''),
    "num_experts": (None, "megatron/training/arguments.py:3518", ''),
    "moe_router_topk": (2, "megatron/core/transformer/transformer_config.py:760", ''),
    "moe_ffn_hidden_size": (None, "megatron/core/transformer/transformer_config.py:740", ''),
    "moe_shared_expert_intermediate_size": (None, "megatron/core/transformer/transformer_config.py:701", ''),
    "moe_layer_freq": (1, "megatron/training/arguments.py:3520", "loom holds the text '1' (the flag also takes a list expression)"),
    "moe_router_score_function": ('softmax', "megatron/core/transformer/transformer_config.py:808", ''),
    "moe_router_pre_softmax": (False, "megatron/core/transformer/transformer_config.py:799", ''),
    "moe_aux_loss_coeff": (0.0, "megatron/training/arguments.py:3536", ''),
    "moe_z_loss_coeff": (None, "megatron/core/transformer/transformer_config.py:880", "no z-loss; loom's 0.0 means the same"),
    "moe_expert_capacity_factor": (None, "megatron/core/transformer/transformer_config.py:917", ''),
    "moe_shared_expert_gate": (False, "megatron/core/transformer/transformer_config.py:713", ''),
    "moe_router_load_balancing_type": ('aux_loss', "megatron/core/transformer/transformer_config.py:743", 'one type (Megatron also takes a list; quantile_balancing is not in loom)'),
    "moe_router_enable_expert_bias": (False, "megatron/core/transformer/transformer_config.py:816", ''),
    "moe_router_bias_update_rate": (0.001, "megatron/core/transformer/transformer_config.py:821", ''),
    "moe_router_num_groups": (None, "megatron/core/transformer/transformer_config.py:780", ''),
    "moe_router_group_topk": (None, "megatron/core/transformer/transformer_config.py:796", ''),
    "moe_router_topk_scaling_factor": (None, "megatron/core/transformer/transformer_config.py:804", ''),
    "moe_router_dtype": (None, "megatron/core/transformer/transformer_config.py:811", 'Megatron None routes in the input dtype, loom None in fp32 (same under fp32 training)'),
    "moe_token_dispatcher_type": ('allgather', "megatron/core/transformer/transformer_config.py:891", 'flex (DeepEP / HybridEP kernels) runs as alltoall (same numbers)'),
    "moe_grouped_gemm": (False, "megatron/core/transformer/transformer_config.py:850", ''),
    "moe_shared_expert_overlap": (False, "megatron/core/transformer/transformer_config.py:717", ''),
    "moe_router_force_load_balancing": (False, "megatron/core/transformer/transformer_config.py:833", 'benchmarks only'),
    "qk_layernorm": (False, "megatron/core/transformer/transformer_config.py:259", ''),
    "rotary_scaling_factor": (1.0, "megatron/training/arguments.py:3558", "no scaling; loom's None means the same (YaRN's factor; gemma3's linear scaling)"),
    "multi_latent_attention": (False, "megatron/core/transformer/transformer_config.py:288", ''),
    "q_lora_rank": (None, "megatron/training/arguments.py:3548", ''),
    "kv_lora_rank": (32, "megatron/training/arguments.py:3550", ''),
    "qk_head_dim": (128, "megatron/training/arguments.py:3552", ''),
    "qk_pos_emb_head_dim": (64, "megatron/training/arguments.py:3554", ''),
    "v_head_dim": (128, "megatron/training/arguments.py:3556", ''),
    "rope_type": (None, "megatron/training/arguments.py:2906", 'None: yarn with MLA (MLATransformerConfig), rope otherwise'),
    "mscale": (1.0, "megatron/training/arguments.py:3560", ''),
    "mscale_all_dim": (0.0, "megatron/training/arguments.py:3562", ''),
    "yarn_original_max_position_embeddings": (None, "megatron/training/arguments.py:2400", 'None: 4096 (Megatron reads it for non-MLA YaRN; its MLA uses MLATransformerConfig.original_max_position_embeddings 4096, loom this flag)'),
    "yarn_beta_fast": (None, "megatron/training/arguments.py:2402", 'None: 32'),
    "yarn_beta_slow": (None, "megatron/training/arguments.py:2404", 'None: 1'),
    "yarn_correction_range_round_to_int": (None, "megatron/training/arguments.py:2406", 'None: True (argument_utils.py:413); MLA always rounds'),
    "mtp_num_layers": (None, "megatron/core/transformer/transformer_config.py:68", ''),
    "mtp_loss_scaling_factor": (0.1, "megatron/core/transformer/transformer_config.py:75", ''),
    "hybrid_override_pattern": (None, "megatron/training/arguments.py:3660", ''),
    "mamba_state_dim": (128, "megatron/core/transformer/transformer_config.py:1259", ''),
    "mamba_head_dim": (64, "megatron/core/transformer/transformer_config.py:1262", ''),
    "mamba_num_groups": (8, "megatron/core/transformer/transformer_config.py:1265", ''),
    "tensor_model_parallel_size": (1, "megatron/core/model_parallel_config.py:55", ''),
    "pipeline_model_parallel_size": (1, "megatron/core/model_parallel_config.py:83", ''),
    "context_parallel_size": (1, "megatron/core/model_parallel_config.py:100", ''),
    "cp_comm_type": (['p2p'], "megatron/training/arguments.py:3221", 'a list (one value or one per layer); loom stores the words joined by spaces'),
    "hierarchical_context_parallel_sizes": (None, "megatron/core/model_parallel_config.py:103", 'a list of ints [A, B] in Megatron; loom stores "A B"'),
    "num_layers_per_virtual_pipeline_stage": (None, "megatron/training/arguments.py:3114", ''),
    "decoder_first_pipeline_num_layers": (None, "megatron/training/arguments.py:3095", ''),
    "decoder_last_pipeline_num_layers": (None, "megatron/training/arguments.py:3099", ''),
    "sequence_parallel": (False, "megatron/core/model_parallel_config.py:94", ''),
    "expert_model_parallel_size": (1, "megatron/core/model_parallel_config.py:127", ''),
    "expert_tensor_parallel_size": (None, "megatron/core/model_parallel_config.py:130", ''),
    "ddp_bucket_size": (None, "megatron/training/arguments.py:3125", ''),
    "overlap_grad_reduce": (False, "megatron/training/arguments.py:3121", ''),
    "distributed_backend": ('nccl', "megatron/training/config/common_config.py:74", "loom's --device cpu (which Megatron lacks) uses gloo"),
    "micro_batch_size": (REQUIRED, "megatron/training/arguments.py:693", ''),
    "global_batch_size": (None, "megatron/training/config/training_config.py:15", ''),
    "train_iters": (REQUIRED, "megatron/training/training.py:2174", 'this or --train-samples; not needed with --skip-train'),
    "lr": (REQUIRED, "megatron/training/arguments.py:2984", 'default None, which the LR scheduler cannot use (megatron/training/training.py:2591); not needed with --skip-train'),
    "min_lr": (0.0, "megatron/training/arguments.py:2991", ''),
    "lr_warmup_iters": (0, "megatron/training/config/training_config.py:190", ''),
    "lr_decay_iters": (None, "megatron/training/config/training_config.py:175", ''),
    "lr_decay_style": ('linear', "megatron/training/config/training_config.py:169", ''),
    "weight_decay": (0.01, "megatron/training/arguments.py:2611", ''),
    "adam_beta1": (0.9, "megatron/training/arguments.py:2617", ''),
    "adam_beta2": (0.999, "megatron/training/arguments.py:2620", ''),
    "adam_eps": (1e-08, "megatron/training/arguments.py:2623", ''),
    "clip_grad": (1.0, "megatron/training/arguments.py:2615", ''),
    "use_distributed_optimizer": (False, "megatron/training/arguments.py:3156", ''),
    "use_torch_fsdp2": (False, "megatron/training/config/common_config.py:95", ''),
    "overlap_param_gather": (False, "megatron/training/arguments.py:3148", ''),
    "seed": (1234, "megatron/training/config/common_config.py:10", ''),
    "bf16": (False, "megatron/core/model_parallel_config.py:180", ''),
    "fp16": (False, "megatron/core/model_parallel_config.py:177", ''),
    "accumulate_allreduce_grads_in_fp32": (False, "megatron/training/arguments.py:3069", 'forced on with --bf16 (arguments.py:1216)'),
    "loss_scale": (None, "megatron/training/arguments.py:3055", ''),
    "initial_loss_scale": (4294967296.0, "megatron/training/arguments.py:3059", '2**32'),
    "min_loss_scale": (1.0, "megatron/training/arguments.py:3061", ''),
    "loss_scale_window": (1000, "megatron/training/arguments.py:3063", ''),
    "hysteresis": (2, "megatron/training/arguments.py:3065", ''),
    "recompute_granularity": (None, "megatron/core/transformer/transformer_config.py:532", ''),
    "recompute_method": (None, "megatron/core/transformer/transformer_config.py:543", ''),
    "recompute_num_layers": (None, "megatron/core/transformer/transformer_config.py:551", ''),
    "train_samples": (None, "megatron/training/config/training_config.py:69", ''),
    "lr_warmup_fraction": (None, "megatron/training/config/training_config.py:187", ''),
    "recompute_activations": (False, "megatron/training/arguments.py:2869", ''),
    "skip_train": (False, "megatron/training/config/training_config.py:141", ''),
    "data_path": (None, "megatron/training/arguments.py:3255", ''),
    "valid_data_path": (None, "megatron/training/arguments.py:3274", ''),
    "train_data_path": (None, "megatron/training/arguments.py:3271", ''),
    "test_data_path": (None, "megatron/training/arguments.py:3277", ''),
    "split": (None, "megatron/training/arguments.py:669", "None: the legacy '969, 30, 1' with --data-path (so in loom)"),
    "tokenizer_type": (None, "megatron/training/config/training_config.py:698", ''),
    "mask_prob": (0.15, "megatron/training/arguments.py:3315", ''),
    "short_seq_prob": (0.1, "megatron/training/arguments.py:3317", ''),
    "mock_data": (False, "megatron/training/arguments.py:3302", ''),
    "log_interval": (100, "megatron/training/config/training_config.py:247", ''),
    "eval_interval": (None, "megatron/training/config/training_config.py:119", 'no periodic evaluation (megatron/training/training.py:4915); one at the end'),
    "eval_iters": (100, "megatron/training/config/training_config.py:115", ''),
    "tensorboard_dir": (None, "megatron/training/config/training_config.py:283", ''),
    "save": (None, "megatron/training/config/training_config.py:395", ''),
    "load": (None, "megatron/training/config/training_config.py:430", ''),
    "save_interval": (None, "megatron/training/config/training_config.py:398", ''),
    "save_retain_interval": (None, "megatron/training/config/training_config.py:416", 'checkpoints at its multiples are kept when older ones are deleted (megatron/training/checkpointing.py:1108)'),
    "ckpt_step": (None, "megatron/training/config/training_config.py:471", ''),
    "finetune": (False, "megatron/training/config/training_config.py:464", ''),
    "no_load_optim": (False, "megatron/training/arguments.py:3015", 'store_true with default None: off'),
    "no_load_rng": (False, "megatron/training/arguments.py:3017", 'store_true with default None: off'),
    "exit_interval": (None, "megatron/training/config/training_config.py:73", ''),
    "async_save": (False, "megatron/training/config/training_config.py:516", ''),
    "override_opt_param_scheduler": (False, "megatron/training/config/training_config.py:209", ''),
    "use_checkpoint_opt_param_scheduler": (False, "megatron/training/config/training_config.py:214", ''),
    "distributed_timeout_minutes": (10, "megatron/training/config/common_config.py:77", ''),
    "exit_signal_handler": (False, "megatron/training/config/training_config.py:79", 'SIGTERM: finish the iteration, save (with --save), exit; loom also takes SIGINT'),
    # -- issue 23: the flags of Megatron-LM's example scripts (config/compat.py, script_fields.py)
    "use_mcore_models": (False, "megatron/training/arguments.py:2949", 'no effect in loom'),
    "transformer_impl": ('transformer_engine', "megatron/core/transformer/transformer_config.py:1314", 'no effect in loom'),
    "attention_backend": ('auto', "megatron/core/transformer/transformer_config.py:151", 'an AttnBackend enum in Megatron; no effect in loom'),
    "no_masked_softmax_fusion": (False, "megatron/training/arguments.py:2887", 'dest masked_softmax_fusion=True; no effect in loom'),
    "no_rope_fusion": (False, "megatron/training/arguments.py:2902", 'no effect in loom'),
    "no_bias_swiglu_fusion": (False, "megatron/training/arguments.py:2895", 'no effect in loom'),
    "no_bias_gelu_fusion": (False, "megatron/training/arguments.py:2892", 'no effect in loom'),
    "no_bias_dropout_fusion": (False, "megatron/training/arguments.py:2899", 'no effect in loom'),
    "no_gradient_accumulation_fusion": (False, "megatron/training/arguments.py:2944", 'no effect in loom'),
    "cross_entropy_loss_fusion": (False, "megatron/core/model_parallel_config.py:320", 'no effect in loom'),
    "use_flash_attn": (False, "megatron/training/arguments.py:2910", 'no effect in loom'),
    "cuda_graph_impl": ('none', "megatron/core/transformer/transformer_config.py:1075", 'no effect in loom'),
    "disable_gloo_process_groups": (False, "megatron/training/config/common_config.py:109", 'dest use_gloo_process_groups=True; no effect in loom'),
    "manual_gc": (False, "megatron/training/config/training_config.py:91", 'no effect in loom'),
    "manual_gc_interval": (0, "megatron/training/config/training_config.py:97", 'no effect in loom'),
    "empty_unused_memory_level": (0, "megatron/training/config/training_config.py:48", 'no effect in loom'),
    "attention_softmax_in_fp32": (False, "megatron/training/arguments.py:3067", 'no effect in loom'),
    "apply_query_key_layer_scaling": (False, "megatron/core/transformer/transformer_config.py:481", 'no effect in loom: its kernel computes scores and softmax in fp32'),
    "grad_reduce_in_bf16": (False, "megatron/training/arguments.py:3053", 'no effect: loom reduces gradients in fp32'),
    "fp8_format": (None, "megatron/core/transformer/transformer_config.py:587", "Megatron's field fp8; no effect in loom"),
    "fp8_amax_history_len": (1, "megatron/core/transformer/transformer_config.py:621", 'no effect in loom'),
    "fp8_amax_compute_algo": ('most_recent', "megatron/core/transformer/transformer_config.py:624", 'no effect in loom'),
    "fp8_param_gather": (False, "megatron/training/arguments.py:2016", 'no effect in loom'),
    "init_model_with_meta_device": (False, "megatron/core/distributed/fsdp/src/megatron_fsdp/fully_shard.py:90", 'no effect: loom always builds on meta'),
    "use_nccl_ub": (False, "megatron/training/arguments.py:3171", 'no effect in loom'),
    "fsdp_double_buffer": (False, "megatron/training/arguments.py:3202", 'no effect in loom'),
    "fsdp_manual_registration": (False, "megatron/training/arguments.py:3184", 'no effect in loom'),
    "megatron_fsdp_grad_comm_dtype": ('auto', "megatron/training/arguments.py:3695", 'no effect in loom'),
    "megatron_fsdp_main_grads_dtype": ('auto', "megatron/training/arguments.py:3691", 'no effect in loom'),
    "enable_experimental": (False, "megatron/training/arguments.py:3643", 'no effect in loom'),
    "spec": (None, "megatron/training/arguments.py:3645", "nargs '*'; no effect in loom"),
    "recompute_modules": (None, "megatron/core/transformer/transformer_config.py:560", "no effect: loom's selective recomputation is the attention core"),
    "no_check_for_nan_in_loss_and_grad": (False, "megatron/training/arguments.py:2872", 'dest check_for_nan_in_loss_and_grad=True; no effect: loom skips non-finite steps'),
    "profile": (False, "megatron/training/config/common_config.py:28", "Megatron's field use_nsys_profiler: nsys capture range unless --use-pytorch-profiler"),
    "use_pytorch_profiler": (False, "megatron/training/config/common_config.py:41", ''),
    "profile_step_start": (10, "megatron/training/config/common_config.py:35", ''),
    "profile_step_end": (12, "megatron/training/config/common_config.py:38", ''),
    "profile_ranks": (None, "megatron/training/config/common_config.py:53", '[] in Megatron: every rank'),
    "pytorch_profiler_collect_shapes": (False, "megatron/training/config/common_config.py:44", ''),
    "pytorch_profiler_collect_callstack": (False, "megatron/training/config/common_config.py:47", ''),
    "record_memory_history": (False, "megatron/training/config/common_config.py:56", 'needs CUDA'),
    "memory_snapshot_path": ('snapshot.pickle', "megatron/training/config/common_config.py:59", ''),
    "timing_log_level": (0, "megatron/training/config/training_config.py:267", ''),
    "timing_log_option": ('minmax', "megatron/training/config/training_config.py:276", ''),
    "log_timers_to_tensorboard": (False, "megatron/training/config/training_config.py:294", ''),
    "no_barrier_with_level_1_timing": (False, "megatron/training/config/training_config.py:330", 'dest barrier_with_L1_time=True'),
    "log_memory_to_tensorboard": (False, "megatron/training/config/training_config.py:303", 'CUDA allocator statistics'),
    "deterministic_mode": (False, "megatron/core/model_parallel_config.py:229", ''),
    "optimizer": ('adam', "megatron/training/arguments.py:2913", 'adam and sgd; the others refused'),
    "sgd_momentum": (0.9, "megatron/training/arguments.py:2626", ''),
    "log_validation_ppl_to_tensorboard": (False, "megatron/training/config/training_config.py:300", 'no effect: loom logs it always'),
    "log_throughput": (False, "megatron/training/config/training_config.py:253", 'no effect: loom logs it always'),
    "logging_level": (None, "megatron/training/config/training_config.py:351", 'no effect in loom'),
    "num_workers": (2, "megatron/training/arguments.py:3319", 'no effect in loom'),
    "no_create_attention_mask_in_dataloader": (False, "megatron/training/arguments.py:3332", 'dest create_attention_mask_in_dataloader=True; no effect in loom'),
    "no_mmap_bin_files": (False, "megatron/training/arguments.py:3299", 'dest mmap_bin_files=True; no effect in loom'),
    "data_cache_path": (None, "megatron/training/arguments.py:3297", 'no effect in loom'),
    "dataloader_type": (None, "megatron/training/arguments.py:2936", 'single accepted, cyclic / external refused'),
    "apply_layernorm_1p": (False, "megatron/core/transformer/transformer_config.py:206", "Megatron's field layernorm_zero_centered_gamma; trains identically without weight decay on norms"),
    "auto_detect_ckpt_format": (False, "megatron/training/config/training_config.py:493", 'loom always detects its formats'),
    "dist_ckpt_strictness": ('assume_ok_unexpected', "megatron/training/config/training_config.py:603", "loom's loading is strict"),
    "rotary_percent": (1.0, "megatron/training/arguments.py:2420", 'values below 1 refused'),
    "use_rotary_position_embeddings": (False, "megatron/training/arguments.py:2415", '= --position-embedding-type rope'),
    "no_position_embedding": (False, "megatron/training/arguments.py:2437", 'dest add_position_embedding=True'),
    "squared_relu": (False, "megatron/training/arguments.py:2448", 'not with --swiglu (as Megatron); the experts too'),
    "lr_warmup_samples": (0, "megatron/training/config/training_config.py:193", ''),
    "lr_decay_samples": (None, "megatron/training/config/training_config.py:178", ''),
    "lr_warmup_init": (0.0, "megatron/training/config/training_config.py:196", ''),
    "decoupled_lr": (None, "megatron/training/arguments.py:2994", 'word embedding and output layer weights'),
    "decoupled_min_lr": (None, "megatron/training/arguments.py:2996", 'None: --min-lr'),
    "exit_duration_in_mins": (None, "megatron/training/config/training_config.py:76", 'an int in Megatron'),
    "calculate_per_token_loss": (False, "megatron/core/transformer/transformer_config.py:284", ''),
    "rampup_batch_size": (None, "megatron/training/config/training_config.py:20", 'nargs 3; refused in training'),
    "step_batch_size_schedule": (None, "megatron/training/config/training_config.py:32", 'one batch size accepted in training'),
    "log_num_zeros_in_grad": (False, "megatron/training/config/training_config.py:318", ''),
    "log_params_norm": (False, "megatron/training/config/training_config.py:250", ''),
    "use_megatron_fsdp": (False, "megatron/training/config/common_config.py:92", 'loom: --zero-stage from the sharding strategy'),
    "data_parallel_sharding_strategy": ('optim_grads_params', "megatron/training/arguments.py:3190", ''),
    "ckpt_format": ('torch_dist', "megatron/training/config/training_config.py:486", "loom's default is its own loom_dcp (LOOM_OWN); torch_dist writes Megatron's format; torch_dcp / fsdp_dtensor write loom_dcp; torch refused (read by --load)"),
    "pretrained_checkpoint": (None, "megatron/training/config/training_config.py:468", ''),
    "use_checkpoint_args": (False, "megatron/training/config/training_config.py:474", ''),
    "tokenizer_model": (None, "megatron/training/config/training_config.py:714", ''),
    "eod_mask_loss": (False, "megatron/training/arguments.py:3330", 'GPT-style families; input tokens == eod'),
    "vocab_file": (None, "megatron/training/config/training_config.py:689", ''),
    "merge_file": (None, "megatron/training/config/training_config.py:692", ''),
    "tiktoken_pattern": (None, "megatron/training/config/training_config.py:724", ''),
    "wandb_project": (None, "megatron/training/config/training_config.py:339", ''),
    "wandb_exp_name": (None, "megatron/training/config/training_config.py:342", ''),
    "wandb_save_dir": (None, "megatron/training/config/training_config.py:345", ''),
    "wandb_entity": (None, "megatron/training/config/training_config.py:348", ''),
    "moe_permute_fusion": (False, "megatron/core/transformer/transformer_config.py:941", 'no effect in loom'),
    "moe_flex_dispatcher_backend": ('deepep', "megatron/core/transformer/transformer_config.py:898", 'no effect in loom'),
    "moe_token_drop_policy": ('probs', "megatron/core/transformer/transformer_config.py:932", 'position refused'),
    "moe_per_layer_logging": (False, "megatron/core/transformer/transformer_config.py:914", "moe/<loss>_layer_<i> to the JSON log, TensorBoard and W&B"),
    "mamba_num_heads": (None, "megatron/core/transformer/transformer_config.py:1268", "d_inner = heads x --mamba-head-dim, any h"),
    "quick_geglu": (False, "megatron/training/arguments.py:2452", ''),
    "glu_linear_offset": (0.0, "megatron/core/transformer/transformer_config.py:231", ''),
    "activation_func_clamp_value": (None, "megatron/core/transformer/transformer_config.py:235", ''),
    "softmax_type": ('vanilla', "megatron/core/transformer/transformer_config.py:170", ''),
    "window_size": (None, "megatron/training/arguments.py:2384", "loom holds the text 'LEFT,RIGHT'"),
    "window_attn_skip_freq": (None, "megatron/training/arguments.py:2387", 'loom holds the text (an int or a list)'),
    "padded_vocab_size": (None, "megatron/training/config/training_config.py:682", ''),
    "enable_gpt_oss": (False, "megatron/post_training/arguments.py:153", "ModelOpt's flag: YaRN RoPE with gpt-oss's values"),
    "export_force_local_attention": (False, "megatron/post_training/arguments.py:38", 'no effect in loom'),
}.items()})
"""``{loom field: MegatronDefault}`` for every loom flag named like Megatron-LM's."""

SAME_MEANING = MappingProxyType({
    "moe_z_loss_coeff": 0.0,         # Megatron None: no z-loss
    "moe_layer_freq": "1",           # Megatron 1: the flag is a string (an int or a list)
    "rotary_scaling_factor": None,   # Megatron 1.0: positions not scaled
    "yarn_correction_range_round_to_int": True,  # Megatron None, read as True
    "max_position_embeddings": None,  # Megatron requires it; loom infers --seq-length
    "cp_comm_type": "p2p",            # Megatron ['p2p']: the words joined by spaces
    "num_query_groups": None,         # Megatron 1 under --group-query-attention (so is
                                      # loom's None, resolved), a without it (loom: None = a)
})
"""``{field: loom default}`` where loom spells Megatron's default differently, same effect."""

LOOM_OWN = MappingProxyType({
    "ckpt_format": "loom_dcp",  # Megatron torch_dist: the run trains the same; only the files
                                # differ (loom's own keep generators, data identities, checksums,
                                # async saves); --ckpt-format torch_dist writes Megatron's
})
"""``{field: loom default}`` where loom's default differs from Megatron's on purpose without
changing the run (what a save writes), each with its reason."""
