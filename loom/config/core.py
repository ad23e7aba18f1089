""":class:`LoomConfig`: the six sections together, flat (Megatron-style) access, derived sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from loom.config.fields import flag
from loom.config.sections import (GROUPS, CheckpointConfig, DataConfig,
                                  FaultToleranceConfig, LoggingConfig, ModelConfig,
                                  ParallelConfig, TrainingConfig)
from loom.config.validate import validate_config
from loom.errors import ConfigError


def field_section() -> dict[str, str]:
    """``{field name: section name}`` over every section."""
    return {f.name: g for g, dc in GROUPS.items() for f in fields(dc)}


# Fields that older loom versions kept elsewhere; a checkpoint's stored config may still hold them.
RETIRED_FIELDS = ("dry_run", "num_workers")


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
        if ignore_retired:
            values = {k: v for k, v in values.items() if k not in RETIRED_FIELDS}
        known = field_section()
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

    def num_microbatches(self, world_size: int) -> int:
        """m = B / (b d)."""
        return self.global_batch_size(world_size) // (
            self.training.micro_batch_size * self.data_parallel_size(world_size))

    # -- validation ----------------------------------------------------------------------------
    def validate(self, world_size: int) -> "LoomConfig":
        """Check every value and the layout for ``world_size`` ranks; returns self.

        Resolves ``--pipeline-schedule`` (interleaved when
        ``--num-layers-per-virtual-pipeline-stage`` is given, else 1f1b). Raises
        :class:`ConfigError` naming the flag and the fix.
        """
        validate_config(self, world_size)
        return self
