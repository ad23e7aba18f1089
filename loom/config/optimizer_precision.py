"""The precision-aware optimizer's flags (``--use-precision-aware-optimizer``,
``--main-grads-dtype``, ``--main-params-dtype``, ``--exp-avg-dtype``, ``--exp-avg-sq-dtype``;
Megatron-LM d98e8a6's names, choices and defaults: ``megatron/training/arguments.py``
``_add_experimental_args``), a mixin of :class:`~loom.config.sections.TrainingConfig`, and their
check (:func:`check_precision_aware`, part of the one validation pass). The storage itself:
:mod:`loom.training.state_precision`.

Megatron hands these to Transformer Engine's ``FusedAdam`` (``master_weight_dtype``,
``exp_avg_dtype``, ``exp_avg_sq_dtype``, ``store_param_remainders``): the states are *stored*
in the given dtype and computed in fp32. Bytes per parameter kept by the optimizer (1/d of
them with the distributed optimizer): the master copy 4 (fp32), 2 (fp32 kept as the 16 bits
a bf16 parameter lacks, TE's ``store_param_remainders``, Megatron's default with ``--bf16``) or
2 (fp16, scaled); each moment 4, 2 (fp16 scaled, bf16) or 1 (fp8 E4M3, scaled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from loom.config.fields import opt
from loom.errors import ConfigError

MainGradsDtype = Literal["fp32", "bf16"]
MainParamsDtype = Literal["fp32", "fp16"]
StateDtype = Literal["fp32", "fp16", "bf16", "fp8"]

STATE_DTYPE_FLAGS = (("main_grads_dtype", "--main-grads-dtype"),
                     ("main_params_dtype", "--main-params-dtype"),
                     ("exp_avg_dtype", "--exp-avg-dtype"),
                     ("exp_avg_sq_dtype", "--exp-avg-sq-dtype"))
"""The dtype fields and their flags: each fp32 unless ``--use-precision-aware-optimizer``."""


@dataclass
class PrecisionAwareFields:
    """What the optimizer stores in lower precision (Megatron's precision-aware optimizer)."""

    use_precision_aware_optimizer: bool = opt(
        False, "store the optimizer's master weights and moments in the dtypes of "
               "--main-params-dtype / --exp-avg-dtype / --exp-avg-sq-dtype (computed in fp32); "
               "with --bf16 the fp32 masters keep only the 16 bits the bf16 weights lack (2 "
               "bytes, lossless; Transformer Engine's store_param_remainders). Needs "
               "--optimizer adam and --use-distributed-optimizer")
    main_grads_dtype: MainGradsDtype = opt(
        "fp32", "with --use-precision-aware-optimizer: the main gradients' dtype; bf16 keeps "
                "and reduces bf16 gradients under --bf16 (as --grad-reduce-in-bf16)")
    main_params_dtype: MainParamsDtype = opt(
        "fp32", "with --use-precision-aware-optimizer: the master weights' dtype; fp16 stores "
                "them scaled per tensor (2 bytes, lossy)")
    exp_avg_dtype: StateDtype = opt(
        "fp32", "with --use-precision-aware-optimizer: Adam's first moment's storage dtype "
                "(fp16 and fp8 E4M3 scaled per tensor; bf16 cast)")
    exp_avg_sq_dtype: StateDtype = opt(
        "fp32", "with --use-precision-aware-optimizer: Adam's second moment's storage dtype "
                "(fp16 and fp8 E4M3 scaled per tensor; bf16 cast)")
    optimizer_cpu_offload: bool = opt(
        False, "keep the fp32 master weights and Adam states of the first "
               "--optimizer-offload-fraction of this rank's parameters in host memory and step "
               "them there (torch's AdamW on the CPU; gradients copied to the host, weights "
               "back); needs --use-precision-aware-optimizer, as in Megatron")
    optimizer_offload_fraction: float = opt(
        1.0, "with --optimizer-cpu-offload: the share of this rank's optimizer parameters "
             "(counted in elements, in parameter order) whose states live on the CPU",
        ge=0, le=1)


def check_precision_aware(t: Any) -> None:
    """Megatron's checks (``OptimizerConfig.__post_init__``): a dtype
    other than fp32 needs ``--use-precision-aware-optimizer``, which needs ``--optimizer adam``
    and ``--use-distributed-optimizer`` (not FSDP: loom's ZeRO-3 is FSDP2, whose optimizer
    steps the sharded parameters themselves). (``--main-grads-dtype bf16`` against
    ``--accumulate-allreduce-grads-in-fp32``: :func:`loom.config.validate.resolve_megatron`, with
    the bf16 rule.) Raises ConfigError naming the flag and the fix."""
    decoupled = getattr(t, "decoupled_weight_decay", True)
    if not decoupled and t.optimizer != "adam":
        raise ConfigError(f"--no-decoupled-weight-decay picks the original Adam's L2 decay; "
                          f"--optimizer {t.optimizer} has its own: drop it")
    if not decoupled and t.optimizer_cpu_offload:
        raise ConfigError("--optimizer-cpu-offload with --no-decoupled-weight-decay: the offload "
                          "steps AdamW (Megatron-Core refuses the pair too): drop one of them")
    if t.optimizer_cpu_offload and not t.use_precision_aware_optimizer:
        raise ConfigError("--optimizer-cpu-offload needs --use-precision-aware-optimizer (as in "
                          "Megatron-LM, arguments.py:1884: the offload reuses its code path): "
                          "add it (with --use-distributed-optimizer)")
    if not t.use_precision_aware_optimizer:
        given = [f"{flag} {getattr(t, name)}" for name, flag in STATE_DTYPE_FLAGS
                 if getattr(t, name) != "fp32"]
        if given:
            raise ConfigError(f"{', '.join(given)} needs --use-precision-aware-optimizer (as in "
                              "Megatron-LM: the dtypes are the precision-aware optimizer's): "
                              "add it, or drop the dtype flags")
        return
    if t.optimizer != "adam":
        raise ConfigError(f"--use-precision-aware-optimizer with --optimizer {t.optimizer}: "
                          "only Adam's states have lower-precision storage (as in Megatron-LM): "
                          "use --optimizer adam or drop --use-precision-aware-optimizer")
    if t.zero_stage == 3 or t.use_torch_fsdp2:
        raise ConfigError("--use-precision-aware-optimizer with --use-torch-fsdp2 / --zero-stage "
                          "3: FSDP2's optimizer steps the sharded parameters themselves; use "
                          "--use-distributed-optimizer (ZeRO-1/2) instead")
    if not t.use_distributed_optimizer:
        raise ConfigError("--use-precision-aware-optimizer needs --use-distributed-optimizer "
                          "(as in Megatron-LM): add it")
