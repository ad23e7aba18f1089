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


# Fields that older loom versions kept elsewhere; a checkpoint's stored config may still hold them.
RETIRED_FIELDS = ("dry_run", "num_workers")


@dataclass(frozen=True)
class Derived:
    """The sizes a resolved config derives from its world size, computed once by
    :meth:`LoomConfig.validate` (Megatron's ``args.data_parallel_size``,
    ``get_num_microbatches()``): d = world / (t p c), B = ``--global-batch-size`` or b d,
    m = B / (b d), and the pipeline schedule ``--pipeline-schedule`` resolves to."""

    world_size: int
    data_parallel_size: int
    global_batch_size: int
    num_microbatches: int
    pipeline_schedule: str


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
        """The resolved config for ``world_size`` ranks: a new object (this one is not
        changed) with every value checked, every Megatron inference filled in (required flags,
        ``--pipeline-schedule``, ``--zero-stage``, ``--train-iters`` from ``--train-samples``,
        ...) and :attr:`derived` computed. Raises :class:`ConfigError` naming the flag and the
        fix. Validating a resolved config again (e.g. for another world size) resolves anew.
        """
        resolved = copy.deepcopy(self)
        resolved.derived = None
        validate_config(resolved, world_size)
        t = resolved.training
        dp = resolved.data_parallel_size(world_size)
        gbs = resolved.global_batch_size(world_size)
        resolved.derived = Derived(world_size=world_size, data_parallel_size=dp,
                                   global_batch_size=gbs,
                                   num_microbatches=gbs // (t.micro_batch_size * dp),
                                   pipeline_schedule=resolved.parallel.pipeline_schedule)
        return resolved

    def require_derived(self) -> Derived:
        """:attr:`derived`; raises ConfigError for a config that was never resolved."""
        if self.derived is None:
            raise ConfigError("this LoomConfig was never resolved: train on the config that "
                              "cfg.validate(world_size) returns (validate does not change cfg)")
        return self.derived
