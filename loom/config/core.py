""":class:`LoomConfig`: the six sections together, flat (Megatron-style) access, derived sizes."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Optional

from loom.config.fields import flag
from loom.config.sections import (GROUPS, CheckpointConfig, DataConfig,
                                  FaultToleranceConfig, LoggingConfig, ModelConfig,
                                  ParallelConfig, TrainingConfig)
from loom.config.validate import validate_config
from loom.errors import ConfigError


def field_section() -> dict[str, str]:
    """``{field name: section name}`` over every section."""
    return {f.name: g for g, dc in GROUPS.items() for f in fields(dc)}


# Fields that older loom versions stored; a checkpoint's stored config may still hold them: the
# Megatron flags loom accepts without effect were config fields before issue 42 (they are rows
# of loom.config.flag_table now, never stored). A name that is a field again is kept.
RETIRED_FIELDS = ("dry_run",
    "use_mcore_models", "transformer_impl", "attention_backend", "no_masked_softmax_fusion",
    "no_rope_fusion", "no_bias_swiglu_fusion", "no_bias_gelu_fusion",
    "no_bias_dropout_fusion", "no_gradient_accumulation_fusion",
    "cross_entropy_loss_fusion", "use_flash_attn", "export_force_local_attention",
    "cuda_graph_impl", "disable_gloo_process_groups", "manual_gc", "manual_gc_interval",
    "empty_unused_memory_level", "attention_softmax_in_fp32",
    "apply_query_key_layer_scaling",
    "fp8_format", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_param_gather",
    "init_model_with_meta_device", "use_nccl_ub", "fsdp_double_buffer",
    "fsdp_manual_registration", "megatron_fsdp_grad_comm_dtype",
    "megatron_fsdp_main_grads_dtype", "moe_permute_fusion", "moe_flex_dispatcher_backend",
    "enable_experimental", "spec", "recompute_modules", "no_check_for_nan_in_loss_and_grad",
    "profile", "profile_step_start", "profile_step_end", "profile_ranks",
    "record_memory_history", "log_timers_to_tensorboard", "log_memory_to_tensorboard",
    "log_validation_ppl_to_tensorboard", "log_throughput", "logging_level", "num_workers",
    "no_create_attention_mask_in_dataloader", "no_mmap_bin_files", "data_cache_path",
    "dataloader_type", "auto_detect_ckpt_format",
    "dist_ckpt_strictness")


@dataclass(frozen=True)
class Derived:
    """The sizes a resolved config derives from its world size, computed once by
    :meth:`LoomConfig.validate` (Megatron's ``args.data_parallel_size``,
    ``get_num_microbatches()``): d = world / (t p c), B = ``--global-batch-size`` or b d,
    m = B / (b d), and the pipeline schedule ``--pipeline-schedule`` resolves to; evaluation's
    own: B_eval = ``--eval-global-batch-size`` samples an evaluation iteration, in m_eval =
    B_eval / (b_eval d) micro-batches of ``--eval-micro-batch-size`` b_eval per DP rank.
    ``running_global_batch_size``: the samples an iteration trains on, B but under
    ``--decrease-batch-size-if-needed`` (Megatron's ``current_running_global_batch_size``),
    and m = running / (b d)."""

    world_size: int
    data_parallel_size: int
    global_batch_size: int
    num_microbatches: int
    pipeline_schedule: str
    eval_global_batch_size: int = 0
    eval_num_microbatches: int = 0
    running_global_batch_size: int = 0


@dataclass
class LoomConfig:
    """Every option of a run, by concern. Build it with the section dataclasses, or flat with
    :meth:`from_flat`; :meth:`validate` refuses bad values before any process group starts."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    derived: Optional[Derived] = field(default=None, compare=False, repr=False)
    """The sizes of the world this config was resolved for; None until :meth:`validate`."""
    megatron_no_effect: dict = field(default_factory=dict, compare=False, repr=False)
    """The Megatron flags of the command line that loom accepts without effect, ``{flag:
    value}`` (:func:`loom.config.flag_table.no_effect_report` names them once at start); not
    options of the run: never stored in a checkpoint."""
    config_notes: list = field(default_factory=list, compare=False, repr=False)
    """What loom says at start about a ``--config`` file of another trainer (a torchtitan
    TOML: :mod:`loom.config.torchtitan`), one line each; not options of the run."""

    # -- flat (Megatron-style) access -------------------------------------------------------
    def to_flat(self) -> dict:
        """``{flag_name: value}`` over every section."""
        out = {}
        for g in GROUPS:
            out.update(dataclasses.asdict(getattr(self, g)))
        return out

    @classmethod
    def from_flat(cls, values: dict, *, ignore_retired: bool = False) -> "LoomConfig":
        """Build from a flat ``{flag_name: value}`` dict; unknown keys raise ConfigError.

        ``ignore_retired`` drops fields older versions stored (checkpoints written before the
        config was filed by concern).
        """
        values = {k.replace("-", "_"): v for k, v in values.items()}
        known = field_section()
        if ignore_retired:
            values = {k: v for k, v in values.items() if k not in RETIRED_FIELDS or k in known}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(flag(u) for u in unknown)}")
        parts: dict = {g: {} for g in GROUPS}
        for k, v in values.items():
            parts[known[k]][k] = v
        return cls(**{g: GROUPS[g](**parts[g]) for g in GROUPS})

    # -- derived sizes -------------------------------------------------------------------------
    def data_parallel_size(self, world_size: int) -> int:
        """d = world / (t c p)."""
        p = self.parallel
        return world_size // (p.tensor_model_parallel_size * p.context_parallel_size
                              * p.pipeline_model_parallel_size)

    def global_batch_size(self, world_size: int) -> int:
        """B: ``--global-batch-size`` or b d."""
        return self.training.global_batch_size or (
            self.training.micro_batch_size * self.data_parallel_size(world_size))

    def running_global_batch_size(self, world_size: int) -> int:
        """The samples an iteration trains on: B, or under ``--decrease-batch-size-if-needed``
        the largest multiple of b d at most B (Megatron-Core's
        ``ConstantNumMicroBatchesCalculator``: ``(B // (b d)) x b d``; 0 when b d > B, which
        validation refuses)."""
        b_d = self.training.micro_batch_size * self.data_parallel_size(world_size)
        gbs = self.global_batch_size(world_size)
        return gbs // b_d * b_d if self.training.decrease_batch_size_if_needed and b_d else gbs

    def num_microbatches(self, world_size: int) -> int:
        """m = B / (b d) (of the running batch, :meth:`running_global_batch_size`)."""
        return self.running_global_batch_size(world_size) // (
            self.training.micro_batch_size * self.data_parallel_size(world_size))

    # -- validation ----------------------------------------------------------------------------
    def validate(self, world_size: int, family=None) -> "LoomConfig":
        """The resolved config for ``world_size`` ranks: a new object (this one is not
        changed) with every value checked, every Megatron inference filled in (required flags,
        ``--pipeline-schedule``, ``--zero-stage``, ``--train-iters`` from ``--train-samples``,
        ...) and :attr:`derived` computed. Raises :class:`ConfigError` naming the flag and the
        fix. Validating a resolved config again (e.g. for another world size) resolves anew.
        ``family``: the model family's own rules (:class:`loom.config.validate.FamilyRules`);
        :func:`loom.models.resolve_config` passes those of ``--model-type``'s family.
        """
        resolved = copy.deepcopy(self)
        resolved.derived = None
        validate_config(resolved, world_size, family)
        t, lg = resolved.training, resolved.logging
        dp = resolved.data_parallel_size(world_size)
        gbs = resolved.global_batch_size(world_size)
        running = resolved.running_global_batch_size(world_size)
        resolved.derived = Derived(world_size=world_size, data_parallel_size=dp,
                                   global_batch_size=gbs,
                                   num_microbatches=running // (t.micro_batch_size * dp),
                                   running_global_batch_size=running,
                                   pipeline_schedule=resolved.parallel.pipeline_schedule,
                                   eval_global_batch_size=lg.eval_global_batch_size,
                                   eval_num_microbatches=lg.eval_global_batch_size // (
                                       lg.eval_micro_batch_size * dp))
        return resolved

    def require_derived(self) -> Derived:
        """:attr:`derived`; raises ConfigError for a config that was never resolved."""
        if self.derived is None:
            raise ConfigError("this LoomConfig was never resolved: train on the config that "
                              "cfg.validate(world_size) returns (validate does not change cfg)")
        return self.derived
