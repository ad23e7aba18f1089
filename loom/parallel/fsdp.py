"""ZeRO-3 / fully sharded data parallel with PyTorch's FSDP2 (``--zero-stage 3``,
``--use-torch-fsdp2``).

Every transformer layer of a model chunk (``chunk.layers``), then the chunk itself (embedding,
final norm, output layer), is ``fully_shard``-ed over a 1-D ``DeviceMesh`` made from the mesh's
``dp_cp`` process group: each parameter becomes a ``DTensor`` sharded on dim 0 over the d x c
ranks (Rajbhandari et al. 2020, ZeRO stage 3: 16/d bytes per parameter in fp32), is all-gathered
per layer before its forward and again before its backward (the next layer's gather is
prefetched explicitly, ``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``), and its
gradient is reduce-scattered (averaged over d x c) as backward leaves the layer. Gradient
accumulation keeps the unsharded gradients until the chunk's last micro-batch
(``set_requires_gradient_sync(False)``, driven by the schedules' ``reducer.no_sync()``): one
reduce-scatter per step instead of m, at the cost of the chunk's whole fp32 gradient held while
micro-batches accumulate (a no-op :meth:`FSDPGradients.no_sync` would reduce-scatter every
micro-batch and keep gradients sharded throughout).

Composition with loom's own parallelism:

* Tensor parallelism: loom's TP parameters are plain local tensors (the TP shard); FSDP shards
  that shard again over DP x CP. TP-replicated parameters are sliced identically on every TP
  rank, so the sequence-parallel gradient all-reduce over TP works on :func:`local_tensor`.
* Pipeline parallelism: each chunk is its own FSDP root; the tied embedding's copies on the first
  and last stage are sharded alike (same full shape, same DP group size), so their gradients are
  summed over the embedding group shard by shard.
* Expert parallelism (as torchtitan composes FSDP2 with EP): when the experts have a grid of
  their own (EP > 1 or expert TP != t, :mod:`loom.parallel.mesh`), each MoE layer's local
  experts (its ``experts`` ModuleDict, made a :class:`ShardedExperts` FSDP unit) are
  ``fully_shard``-ed first, over the expert-data-parallel group (``edp``: the t c d / (u e)
  ranks holding the same expert shards; a one-rank group gets its own process group), so the
  layer's and chunk's FSDP units leave them out. Their gradients are reduce-scattered over
  ``edp`` and divided by d c (the mean over every DP x CP rank's tokens, like the dense ones).
  MoE layers on the dense grid are sharded like any layer.
* The aux-loss-free ``router.expert_bias`` (no gradient, updated in place from the global load
  after each step) is left unsharded (``ignored_params``): whole and identical on every rank.
* The gradient norm sums squares of the local shards and all-reduces them over DP x CP as well
  (expert shards too: each element once); AdamW (fused) runs on the
  DTensor shards of both meshes.
* Checkpoints stay layout-free: :func:`full_tensor` gathers each parameter (and Adam state) at
  save, :func:`shard_like` cuts this rank's shard at load (experts over their own mesh).
* Not composed (refused by :func:`loom.config.validate`): the distributed optimizer (ZeRO-1 on
  top of ZeRO-3), uniform full recomputation of groups of layers (the group's first layer calls
  the others' ``forward`` directly, bypassing their FSDP hooks).

Mixed precision (``--bf16`` / ``--fp16``): ``MixedPrecisionPolicy(param_dtype=bf16 or fp16,
reduce_dtype=fp32)``; sharded parameters (the fp32 master weights), gradients and Adam states
stay fp32. ``--fp16``'s loss scale multiplies the loss as without ZeRO-3; the step divides it
out of the fp32 gradient shards and skips when any rank's shard holds an inf or NaN (the check
all-reduced over every rank: :func:`loom.training.step.unscale_sharded`).

A mesh whose DP x CP group is one rank shards nothing (ZeRO-3 at d = 1 is plain training).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterable, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def fsdp_enabled(training) -> bool:
    """Whether the training section asks for ZeRO-3 (``--zero-stage 3`` or
    ``--use-torch-fsdp2``)."""
    return bool(getattr(training, "use_torch_fsdp2", False)) or \
        getattr(training, "zero_stage", 0) == 3


def is_sharded(t: Optional[torch.Tensor]) -> bool:
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (same storage: in-place ops reach the DTensor), else
    ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole (TP-local) tensor of a DTensor: an all-gather over DP x CP, collective on every
    rank of the group; ``t`` itself otherwise."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (this TP rank's whole tensor, on every rank) as a DTensor sharded like
    ``param`` (each rank keeps its own slice, no communication); ``full`` when ``param`` is
    not sharded."""
    if not isinstance(param, DTensor):
        return full
    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements,
                             src_data_rank=None)


def _mesh_type(mesh) -> str:
    """The ``DeviceMesh``'s device type: the mesh's, ``cpu`` for the planner's count on the
    meta device (a ``DeviceMesh`` has no meta type; FSDP2 shards meta parameters as they are)."""
    return "cpu" if mesh.device.type == "meta" else mesh.device.type


def fsdp_device_mesh(mesh):
    """The 1-D ``DeviceMesh`` over this rank's DP x CP group, or None when the group is this
    rank alone."""
    group = mesh.groups.get("dp_cp")
    if group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(group, _mesh_type(mesh), mesh_dim_names=("dp_cp",))


def expert_device_mesh(mesh):
    """The 1-D ``DeviceMesh`` over this rank's expert-data-parallel group (the ranks holding
    the same expert shards, ``edp``), or None when the experts share the dense grid. A
    one-rank group (t c d = u e) gets a process group of its own (``new_group`` is
    collective: every rank creates every rank's), so experts are DTensors like every other
    parameter."""
    if not mesh.experts_apart:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    group = mesh.groups.get("edp")
    if group is None:
        rank = dist.get_rank()
        for r in range(dist.get_world_size()):
            g = dist.new_group([r], timeout=getattr(mesh, "timeout", None))
            group = g if r == rank else group
    return DeviceMesh.from_group(group, _mesh_type(mesh), mesh_dim_names=("edp",))


class ShardedExperts(nn.ModuleDict):
    """A MoE layer's local experts (its ``experts`` ModuleDict, class swapped in place: names
    unchanged) as one FSDP unit with a ``forward``: ``(tokens [n, h], ids [n], first) ->
    [n, h]`` through the family's ``run_experts`` (kept in ``run_experts``), so FSDP gathers
    all local experts before the call and reduce-scatters their gradients in its backward,
    whichever experts received tokens."""

    def forward(self, tokens: torch.Tensor, ids: torch.Tensor, first: int = 0) -> torch.Tensor:
        return self.run_experts(tokens, ids, self, first)


def _call_experts(tokens, ids, experts: ShardedExperts, first: int = 0) -> torch.Tensor:
    return experts(tokens, ids, first)  # the dispatcher's run_experts: through FSDP's hooks


def _shard_experts(chunk: nn.Module, device_mesh, policy, divide_by: int) -> None:
    """``fully_shard`` the local experts of each MoE module of ``chunk`` (as
    :class:`ShardedExperts`) over the expert-DP mesh; the dispatcher, which calls
    ``run_experts(tokens, ids, experts, first)`` once per forward on every rank, then calls
    them as a module. Gradients (summed over the mesh) are divided by ``divide_by`` = d c: the
    mean over all DP x CP ranks' tokens, like the dense gradients
    (:func:`loom.parallel.expert.expert_grad_scale`)."""
    from torch.distributed.fsdp import fully_shard
    for moe in list(chunk.modules()):
        experts, dispatcher = getattr(moe, "experts", None), getattr(moe, "dispatcher", None)
        if not isinstance(experts, nn.ModuleDict) or dispatcher is None:
            continue
        experts.__class__ = ShardedExperts
        experts.run_experts = dispatcher.run_experts
        dispatcher.run_experts = _call_experts
        fully_shard(experts, mesh=device_mesh, mp_policy=policy)
        experts.set_gradient_divide_factor(float(divide_by))
        # sum, then divide (gloo has no PREMUL_SUM); on a one-rank mesh torch 2.13 divides by
        # the factor in its copy and again after a forced sum, so that case keeps the default
        experts.set_force_sum_reduction_for_comms(device_mesh.size() > 1)


def unsharded_parameters(chunk: nn.Module) -> set:
    """Parameters FSDP leaves alone: the no-gradient ``router.expert_bias`` (updated in place
    from the global load after each step, identical on every rank: kept whole)."""
    return {m.expert_bias for m in chunk.modules()
            if isinstance(getattr(m, "expert_bias", None), nn.Parameter)}


def shard_model_chunks(chunks: Sequence[nn.Module], mesh, bf16: bool = False,
                       fp16: bool = False) -> None:
    """``fully_shard`` each transformer layer of each chunk, then the chunk (the root of its
    own FSDP tree), in place; parameter names do not change. With the experts on a grid of their
    own the local experts of each MoE layer are sharded first, over the expert-DP group
    (:func:`expert_device_mesh`). ``bf16`` / ``fp16``: the gathered parameters are cast to
    that dtype for compute, the shards and reduced gradients stay fp32. A no-op on a one-rank
    DP x CP group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    device_mesh = fsdp_device_mesh(mesh)
    if device_mesh is None:
        return
    compute = torch.bfloat16 if bf16 else torch.float16 if fp16 else None
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) \
        if compute is not None else MixedPrecisionPolicy()
    expert_mesh = expert_device_mesh(mesh)
    # The last chunk returns the per-token loss as a view ([s, b] -> [b, s]); FSDP2 warns that an
    # in-place op on it would skip its pre-backward hook. lm_loss only reads it (out of place),
    # and tests/parallel/test_fsdp.py checks every gradient, so the warning is silenced (once per rank).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for chunk in chunks:
        layers = list(chunk.layers.values()) if hasattr(chunk, "layers") else []
        kept = unsharded_parameters(chunk)
        if expert_mesh is not None:  # every MoE module of the chunk (MTP layers too)
            _shard_experts(chunk, expert_mesh, policy, mesh.sizes["dp"] * mesh.sizes["cp"])
        for layer in layers:
            fully_shard(layer, mesh=device_mesh, mp_policy=policy, ignored_params=kept)
        fully_shard(chunk, mesh=device_mesh, mp_policy=policy, ignored_params=kept)
        for prev, nxt in zip(layers, layers[1:]):  # gather the next layer during this one
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])


def is_fully_sharded(chunk: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(chunk, FSDPModule)


class FSDPGradients:
    """The :class:`~loom.parallel.grad_buffer.GradBuffer` interface for a ``fully_shard``-ed
    chunk: FSDP2 reduce-scatters during backward, so loom's all-reduce buckets never run.
    :meth:`no_sync` defers the reduce-scatter to the last micro-batch; :meth:`finish_grad_sync`
    gives parameters without a gradient zeros (sharded like them)."""

    def __init__(self, chunk: nn.Module):
        self.chunk = chunk
        self.params = [p for p in chunk.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def no_sync(self):
        self.chunk.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.chunk.set_requires_gradient_sync(True)

    def finish_grad_sync(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def model_state_bytes(params: Iterable[torch.Tensor], optimizer=None) -> dict:
    """Bytes this rank holds of parameters, gradients and optimizer states (tensors of one
    dimension or more: Adam's moments, not its step count): local shards' numel x element
    size."""
    params = list(params)

    def nbytes(t):
        t = local_tensor(t)
        return t.numel() * t.element_size()
    out = {"params": sum(nbytes(p) for p in params),
           "grads": sum(nbytes(p.grad) for p in params if p.grad is not None), "optimizer": 0}
    if optimizer is not None:
        for p in params:
            for v in optimizer.state.get(p, {}).values():
                if torch.is_tensor(v) and v.ndim > 0:
                    out["optimizer"] += nbytes(v)
    return out
