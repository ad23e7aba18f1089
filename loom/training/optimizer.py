"""AdamW (or SGD, ``--optimizer sgd``, or Muon, ``--optimizer muon``) with Megatron's parameter
groups (:mod:`loom.training.param_groups`), global-norm clipping across TP/PP; the learning-rate
and weight-decay schedule is :mod:`loom.training.param_schedule`.

Per-step costs are kept out of Python loops: AdamW and SGD run fused (one kernel per parameter on
devices ``torch.optim`` has fused kernels for, CPU included; else ``foreach``), the global norm
is one ``torch._foreach_norm`` over gradient blocks, and clipping one ``torch._foreach_mul_``
(``torch.nn.utils.clip_grads_with_norm_``), skipped when the norm is already within bounds.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from loom.checkpoint.optimizer_state import (  # noqa: F401 - moved, re-exported
    load_optimizer_state_by_name, optimizer_state_by_name)
from loom.config import ModelConfig, TrainingConfig
from loom.parallel.fsdp import is_sharded, local_tensor
from loom.parallel.mesh import ParallelMesh
from loom.parallel.registry import ParamMeta, named_parameters
from loom.training.distributed_optimizer import (NORM_BLOCK, DistributedOptimizer,  # noqa: F401
                                                _sum_of_squares, reduce_grad_sums)
from loom.training.muon import Muon, MuonSettings, matrix_info
from loom.training.param_groups import build_groups, group_plan
from loom.training.param_schedule import (build_scheduler, group_schedule,  # noqa: F401
                                           lr_at)  # moved, re-exported
from loom.training.state_precision import StatePrecision


def optimizer_class(cfg: TrainingConfig, params: Sequence[torch.Tensor]) -> tuple[type, dict]:
    """``(optimizer class, keyword arguments)`` of ``--optimizer``: adam is
    ``torch.optim.AdamW`` (``--lr``, ``--adam-beta1/2``, ``--adam-eps``; Megatron's adam with
    decoupled weight decay; ``torch.optim.Adam`` with ``--no-decoupled-weight-decay``), sgd ``torch.optim.SGD`` (``--lr``, ``--sgd-momentum``; weight
    decay added to the gradient, as Megatron's), muon :class:`~loom.training.muon.Muon`
    (``settings``: the ``--muon-*`` flags; ``adam``: its AdamW's keywords), fused where
    :func:`adamw_implementation` says so (foreach for SGD on FSDP2's DTensors: torch 2.13 has
    no DTensor rule for the fused SGD kernel). Weight decay is per parameter group."""
    impl = adamw_implementation(params)
    if cfg.optimizer == "sgd":
        if any(is_sharded(p) for p in params):  # DTensor has no sharding rule for fused SGD
            impl = {"foreach": True}
        return torch.optim.SGD, dict(lr=cfg.lr, momentum=cfg.sgd_momentum, **impl)
    adam = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, **impl)
    if cfg.optimizer == "muon":
        return Muon, dict(settings=MuonSettings.of(cfg), adam=adam)
    # --no-decoupled-weight-decay: the original Adam (L2 added to the gradient), as
    # Megatron-Core's decoupled_weight_decay=False picks torch.optim.Adam
    return (torch.optim.AdamW if cfg.decoupled_weight_decay else torch.optim.Adam), adam


def build_optimizer(model: nn.Module, cfg: TrainingConfig,
                    mesh: Optional[ParallelMesh] = None, reducers=None, timers=None,
                    model_cfg: Optional[ModelConfig] = None):
    """``--optimizer`` (AdamW, SGD or Muon, :func:`optimizer_class`) over the parameter groups
    of :func:`loom.training.param_groups.group_plan` (no weight decay for biases and 1-D
    parameters, as Megatron-LM; ``--decoupled-lr``; muP's per-group learning rates and epsilon
    with ``model_cfg``'s ``--use-mup``; Muon's matrices).

    fp32 parameters without ``--use-distributed-optimizer``: the optimizer on the parameters.
    16-bit parameters (``--bf16`` / ``--fp16``) or the distributed optimizer (ZeRO
    stage 1/2 over DP x CP, Rajbhandari et al. 2020 sec. 5.1-5.2; Megatron's design: 18 -> 6 +
    12/d bytes per parameter in bf16): a
    :class:`~loom.training.distributed_optimizer.DistributedOptimizer`
    on fp32 master ranges of the ``reducers``' main gradients (``reducers`` and ``mesh``
    required; the gradient buffers must have been built in
    :func:`~loom.training.distributed_optimizer.buffer_mode`'s mode).

    With ``--overlap-param-gather`` the parameter all-gathers are waited for by forward
    pre-hooks on ``model``'s chunks. The update runs as :func:`adamw_implementation` picks
    (fused where supported). ``timers``: the run's :class:`~loom.training.timers.Timers`
    (the distributed optimizer times its phases).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    cls, kw = optimizer_class(cfg, [p for _, p in named])
    chunks = list(model.children()) if isinstance(model, nn.ModuleList) else [model]
    decoupled = decoupled_params(chunks) if cfg.decoupled_lr is not None or \
        cfg.optimizer == "muon" else set()  # Megatron's is_embedding_or_output_parameter
    plan = group_plan(cfg, model_cfg, decoupled_group(cfg))
    sixteen = any(p.dtype != torch.float32 for _, p in named)
    if cfg.use_distributed_optimizer or sixteen:
        if reducers is None or mesh is None:
            raise ValueError("16-bit parameters and --use-distributed-optimizer need the "
                             "gradient buffers (their fp32 main gradients) and the mesh")
        opt = DistributedOptimizer(list(named_parameters(chunks)), reducers, mesh,
                                   cfg.use_distributed_optimizer, cfg.overlap_param_gather,
                                   plan=plan, decoupled_params=decoupled, optim_class=cls,
                                   optim_kw=kw, timers=timers,
                                   precision=StatePrecision.of(cfg),
                                   offload_fraction=cfg.optimizer_offload_fraction
                                   if cfg.optimizer_cpu_offload else None)
        if cfg.overlap_param_gather:  # each bucket's all-gather waited for before its first use
            opt.hook_param_gather(chunks)
        return opt
    device = named[0][1].device if named else torch.device("cpu")
    groups = build_groups(plan, [(plan.index(n, p, id(p) in decoupled), p) for n, p in named],
                          device)
    if cls is Muon:
        infos = {id(p): matrix_info(n, meta, mesh) for n, p, meta in named_parameters(chunks)}
        return Muon(groups, infos=infos, **kw)
    return cls(groups, **kw)


_untimed = contextlib.nullcontext


def decoupled_params(chunks: Sequence[nn.Module]) -> set[int]:
    """``id``s of the parameters ``--decoupled-lr`` applies to: Megatron's
    ``is_embedding_or_output_parameter`` (``LanguageModule``), the input word-embedding and
    output-layer weights, here the 2-D parameters with a vocabulary dimension in the registry
    (every stage's copy of a tied embedding; not BERT's LM-head bias, not position tables)."""
    return {id(p) for _, p, meta in named_parameters(chunks) if meta.embedding_or_output}


def decoupled_group(cfg: TrainingConfig) -> Optional[dict]:
    """The schedule keys of the ``--decoupled-lr`` parameter group (Megatron's
    ``get_standard_config_overrides``): peak ``--decoupled-lr``, minimum
    ``--decoupled-min-lr`` (default ``--min-lr``), weight decay as the other weights; None
    without ``--decoupled-lr``."""
    if cfg.decoupled_lr is None:
        return None
    return {"lr": cfg.decoupled_lr, "max_lr": cfg.decoupled_lr,
            "min_lr": cfg.min_lr if cfg.decoupled_min_lr is None else cfg.decoupled_min_lr}


def adamw_implementation(params: Iterable[torch.Tensor]) -> dict:
    """``{"fused": True}`` when every parameter is a floating-point tensor on a device with fused
    AdamW kernels (CUDA, CPU, XPU, MPS, ... in torch 2.13; on this CPU the fused step of the
    reference model takes ~11 ms against ~38 ms for the per-tensor loop and ~39 ms for foreach),
    else ``{"foreach": True}`` (the multi-tensor path; CPU falls back to a C++ loop)."""
    params = list(params)
    devices = set(_get_fused_kernels_supported_devices())
    if params and all(p.device.type in devices and torch.is_floating_point(p) for p in params):
        return {"fused": True}
    return {"foreach": True}


def local_optimizer(optimizer) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer holding this rank's Adam states (the inner AdamW of a
    :class:`~loom.training.distributed_optimizer.DistributedOptimizer`, or itself)."""
    return getattr(optimizer, "optim", optimizer)


def clip_and_norm(optimizer, params, max_norm: float, mesh: ParallelMesh, norm_params,
                  expert_norm_params, inv_scale: float = 1.0, timers=None) -> float:
    """The pre-clip global gradient norm, clipping to ``max_norm``: the optimizer's own
    (sharded, master-gradient) norm for a DistributedOptimizer, else :func:`clip_grad_norm`
    (timed as ``optimizer-clip-main-grad`` by ``timers``)."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.clip_grad_norm(max_norm, inv_scale)
    with timers("optimizer-clip-main-grad") if timers is not None else _untimed():
        return clip_grad_norm(params, max_norm, mesh, norm_params, expert_norm_params)


def counts_for_norm(meta: ParamMeta, mesh: ParallelMesh) -> bool:
    """A gradient enters the global norm once: TP-sharded parameters on every TP rank,
    replicated ones on TP rank 0 only (an expert's: expert-TP shards, expert-TP rank 0),
    pipeline duplicates (tied embedding on the last stage) never (the registry's
    :meth:`~loom.parallel.registry.ParamMeta.counts_for_norm`)."""
    return mesh.counts_for_norm(meta)


def global_grad_norm(params: Iterable[torch.Tensor], mesh: ParallelMesh,
                     expert_params: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """L2 norm of the gradients of ``params`` (those that count, see :func:`counts_for_norm`:
    each element once), summed over the model-parallel (TP x PP) group; ``expert_params``
    (the experts' on their own grid, each shard held by the ranks of one expert-DP group) are
    taken from the first expert-DP replica and summed over the stage's DP x CP ranks first.
    Data-parallel replicas hold identical gradients after reduction, so DP is not summed,
    except under ZeRO-3 (DTensor gradients): each rank holds a different shard, summed over
    ``dp_cp`` too (:func:`~loom.training.distributed_optimizer.reduce_grad_sums`). One
    all-reduce (fp64 scalar) on ``mesh.groups["mp"]`` (and one on ``dp_cp``).
    Returns a 0-d fp32 tensor (unitless, the gradients' L2 norm)."""
    return global_grad_sum(params, mesh, expert_params, _sum_of_squares).sqrt().float()


def global_grad_sum(params: Iterable[torch.Tensor], mesh: ParallelMesh,
                    expert_params: Iterable[torch.Tensor], stat) -> torch.Tensor:
    """``stat(gradients, device) -> 0-d fp64`` (a sum over elements) of the gradients of
    ``params`` and ``expert_params``, reduced over the groups :func:`global_grad_norm` names
    (each element once); a 0-d fp64 tensor. A collective."""
    params, expert_params = list(params), list(expert_params)
    device = (params or expert_params)[0].device if (params or expert_params) else mesh.device
    sq = stat([local_tensor(p.grad) for p in params if p.grad is not None], device)
    esq = stat([local_tensor(p.grad) for p in expert_params if p.grad is not None], device) \
        if mesh.experts_apart else None
    return reduce_grad_sums(sq, esq, mesh, any(is_sharded(p.grad) for p in params),
                            any(is_sharded(p.grad) for p in expert_params))


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, mesh: ParallelMesh,
                   norm_params: Optional[Iterable[torch.Tensor]] = None,
                   expert_norm_params: Iterable[torch.Tensor] = ()) -> float:
    """Scale the gradients of ``params`` so their global norm (over ``norm_params``, default
    ``params``, plus ``expert_norm_params``) is at most ``max_norm`` (skip if <= 0); returns the
    norm before clipping. The scale ``max_norm / (norm + 1e-6)`` (Megatron's, and
    ``torch.nn.utils.clip_grad_norm_``'s) is applied with one ``_foreach_mul_`` only when it is
    below 1, to every gradient, counted in the norm or not."""
    params = list(params)
    norm = global_grad_norm(params if norm_params is None else norm_params, mesh,
                            expert_norm_params)
    value = float(norm)
    if max_norm > 0 and math.isfinite(value) and max_norm / (value + 1e-6) < 1.0:
        if any(is_sharded(p.grad) for p in params):  # ZeRO-3: scale the local shards
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_([local_tensor(p.grad) for p in params if p.grad is not None],
                                coef)
            return value
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm,
                                             norm, foreach=True)
    return value
