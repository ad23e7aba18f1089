"""Muon's flags (``--optimizer muon`` / ``dist_muon``; Megatron-LM d98e8a6's names, meanings
and defaults: ``megatron/training/arguments.py`` ``_add_regularization_args``), a mixin of
:class:`~loom.config.sections.TrainingConfig`, and their check (:func:`check_muon`, part of the
one validation pass). The optimizer itself: :mod:`loom.training.muon`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from loom.config.fields import opt
from loom.errors import ConfigError

MuonScaleMode = Literal["spectral", "unit_rms_norm", "shape_scaling"]
MuonMatmulPrec = Literal["low", "medium", "high"]
MuonCoefficients = Literal["simple", "quintic", "polar_express", "cans", "aol", "deepseekv4"]
MuonTpMode = Literal["blockwise", "duplicated", "distributed"]
ScalarOptimizer = Literal["adam", "lion"]


@dataclass
class MuonFields:
    """``--muon-*``: read with ``--optimizer muon`` (or ``dist_muon``) only, as in Megatron."""

    muon_momentum: float = opt(0.9, "Muon: momentum mu of the EMA M = mu M + (1 - mu) G",
                               ge=0, lt=1)
    muon_split_qkv: bool = opt(True, "Muon: orthogonalize the fused QKV weight's query, key "
                                     "and value rows each on its own (--muon-no-split-qkv: as "
                                     "one matrix)")
    muon_nesterov: bool = opt(False, "Muon: Nesterov momentum, update (1 - mu) G + mu M "
                                     "instead of M")
    muon_scale_mode: MuonScaleMode = opt(
        "spectral", "Muon: update scale of an m x n matrix: spectral sqrt(max(m, n)), "
                    "unit_rms_norm sqrt(m / n), shape_scaling sqrt(max(1, m / n))")
    muon_fp32_matmul_prec: MuonMatmulPrec = opt(
        "medium", "Muon: Newton-Schulz precision: medium runs the iterations in bf16 "
                  "(Megatron's default), high in fp32 (TF32 on CUDA), low in fp32 at torch's "
                  "current precision (torch ignores 'low')")
    muon_coefficient_type: MuonCoefficients = opt(
        "quintic", "Muon: Newton-Schulz coefficient set (emerging_optimizers 0.3.0's: simple, "
                   "quintic, polar_express, cans, aol, deepseekv4)")
    muon_num_ns_steps: int = opt(5, "Muon: Newton-Schulz iterations", ge=1)
    muon_tp_mode: MuonTpMode = opt(
        "duplicated", "Muon under TP: duplicated orthogonalizes the whole matrix (shards "
                      "all-gathered), distributed computes the same (gathered here too), "
                      "blockwise each shard on its own (the update depends on the layout)")
    muon_extra_scale_factor: float = opt(1.0, "Muon: extra factor of the update (0.2 matches "
                                              "AdamW's update RMS)", gt=0)
    muon_scalar_optimizer: ScalarOptimizer = opt(
        "adam", "optimizer of what Muon does not orthogonalize (embeddings, output layer, "
                "norms, biases): adam (AdamW); lion refused")


MUON_EXCLUDED = ("mixer.in_proj.weight", "mixer.conv1d.weight")
"""2-D weights Muon leaves to AdamW (Megatron: Mamba's ``in_proj`` ``use_muon=False``; its
conv1d weight is ``[c, 1, k]``, not a matrix)."""


def muon_managed(name: str, ndim: int, decoupled: bool) -> bool:
    """Whether ``--optimizer muon`` orthogonalizes the update of parameter ``name`` of ``ndim``
    dimensions (Megatron's ``is_managed_by_layer_wise_optimizer``): a 2-D weight, not the word
    embeddings or the output layer (``decoupled``: they are,
    :attr:`loom.parallel.registry.ParamMeta.embedding_or_output`, whether ``--decoupled-lr`` is
    given or not), not one of :data:`MUON_EXCLUDED`. Used by the optimizer's groups
    (:mod:`loom.training.param_groups`) and the planner's exact count
    (:mod:`loom.planner.meta_count`)."""
    return ndim == 2 and not decoupled and not name.endswith(MUON_EXCLUDED)


def check_muon(t: Any) -> None:
    """``--optimizer dist_muon`` is ``muon`` with ``--use-distributed-optimizer`` (Megatron's
    deprecated spelling; resolved in place); Muon is refused where Megatron refuses its
    emerging optimizers: ``--fp16``, FSDP (``--use-torch-fsdp2``, ``--zero-stage 3``,
    ``--use-megatron-fsdp``)."""
    if t.optimizer == "dist_muon":
        t.optimizer, t.use_distributed_optimizer = "muon", True
    if t.optimizer != "muon":
        return
    if t.fp16:
        raise ConfigError("--optimizer muon with --fp16: Megatron's Muon does not train in "
                          "fp16; use --bf16")
    if t.use_torch_fsdp2 or t.use_megatron_fsdp or t.zero_stage == 3:
        raise ConfigError("--optimizer muon orthogonalizes whole matrices, not FSDP shards "
                          "(Megatron refuses it with FSDP): use --use-distributed-optimizer "
                          "(ZeRO-1) instead of --use-torch-fsdp2 / --zero-stage 3 / "
                          "--use-megatron-fsdp")
