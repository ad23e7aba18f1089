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
    "position_embedding_type": ('learned_absolute', "megatron/training/arguments.py:2397", ''),
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
    "moe_layer_freq": (1, "megatron/training/arguments.py:3520", ''),
    "moe_router_score_function": ('softmax', "megatron/core/transformer/transformer_config.py:808", ''),
    "moe_router_pre_softmax": (False, "megatron/core/transformer/transformer_config.py:799", ''),
    "moe_aux_loss_coeff": (0.0, "megatron/training/arguments.py:3536", ''),
    "moe_z_loss_coeff": (None, "megatron/core/transformer/transformer_config.py:880", "no z-loss; loom's 0.0 means the same"),
    "moe_expert_capacity_factor": (None, "megatron/core/transformer/transformer_config.py:917", ''),
    "moe_shared_expert_gate": (False, "megatron/core/transformer/transformer_config.py:713", ''),
    "rotary_scaling_factor": (1.0, "megatron/training/arguments.py:3558", "no scaling; loom's None means the same (loom: gemma3's linear scaling)"),
    "hybrid_override_pattern": (None, "megatron/training/arguments.py:3660", ''),
    "mamba_state_dim": (128, "megatron/core/transformer/transformer_config.py:1259", ''),
    "mamba_head_dim": (64, "megatron/core/transformer/transformer_config.py:1262", ''),
    "mamba_num_groups": (8, "megatron/core/transformer/transformer_config.py:1265", ''),
    "tensor_model_parallel_size": (1, "megatron/core/model_parallel_config.py:55", ''),
    "pipeline_model_parallel_size": (1, "megatron/core/model_parallel_config.py:83", ''),
    "context_parallel_size": (1, "megatron/core/model_parallel_config.py:100", ''),
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
    "ckpt_step": (None, "megatron/training/config/training_config.py:471", ''),
    "finetune": (False, "megatron/training/config/training_config.py:464", ''),
    "no_load_optim": (False, "megatron/training/arguments.py:3015", 'store_true with default None: off'),
    "no_load_rng": (False, "megatron/training/arguments.py:3017", 'store_true with default None: off'),
    "exit_interval": (None, "megatron/training/config/training_config.py:73", ''),
    "async_save": (False, "megatron/training/config/training_config.py:516", ''),
    "override_opt_param_scheduler": (False, "megatron/training/config/training_config.py:209", ''),
    "use_checkpoint_opt_param_scheduler": (False, "megatron/training/config/training_config.py:214", ''),
    "distributed_timeout_minutes": (10, "megatron/training/config/common_config.py:77", ''),
}.items()})
"""``{loom field: MegatronDefault}`` for every loom flag named like Megatron-LM's."""

SAME_MEANING = MappingProxyType({
    "moe_z_loss_coeff": 0.0,         # Megatron None: no z-loss
    "rotary_scaling_factor": None,   # Megatron 1.0: positions not scaled
    "max_position_embeddings": None,  # Megatron requires it; loom infers --seq-length
    "num_query_groups": None,         # Megatron 1 under --group-query-attention (so is
                                      # loom's None, resolved), a without it (loom: None = a)
})
"""``{field: loom default}`` where loom spells Megatron's default differently, same effect."""
