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
* The gradient norm sums squares of the local shards and all-reduces them over DP x CP as well
  (each element once); AdamW (fused) runs on the DTensor shards.
* Checkpoints stay layout-free: :func:`full_tensor` gathers each parameter (and Adam state) at
  save, :func:`shard_like` cuts this rank's shard at load.
* Not composed (refused by :func:`loom.config.validate`): expert parallelism (MoE layers
  without it are sharded like any layer), the distributed optimizer (ZeRO-1 on top of ZeRO-3), uniform full recomputation of groups of layers
  (the group's first layer calls the others' ``forward`` directly, bypassing their FSDP hooks).

Mixed precision (``--bf16``): ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
sharded parameters, gradients and Adam states stay fp32.

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


def fsdp_device_mesh(mesh):
    """The 1-D ``DeviceMesh`` over this rank's DP x CP group, or None when the group is this
    rank alone."""
    group = mesh.groups.get("dp_cp")
    if group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(group, mesh.device.type, mesh_dim_names=("dp_cp",))


def shard_model_chunks(chunks: Sequence[nn.Module], mesh, bf16: bool = False) -> None:
    """``fully_shard`` each transformer layer of each chunk, then the chunk (the root of its
    own FSDP tree), in place; parameter names do not change. A no-op on a one-rank DP x CP
    group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    device_mesh = fsdp_device_mesh(mesh)
    if device_mesh is None:
        return
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()
    # The last chunk returns the per-token loss as a view ([s, b] -> [b, s]); FSDP2 warns that an
    # in-place op on it would skip its pre-backward hook. lm_loss only reads it (out of place),
    # and tests/parallel/test_fsdp.py checks every gradient, so the warning is silenced (once per rank).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for chunk in chunks:
        layers = list(chunk.layers.values()) if hasattr(chunk, "layers") else []
        for layer in layers:
            fully_shard(layer, mesh=device_mesh, mp_policy=policy)
        fully_shard(chunk, mesh=device_mesh, mp_policy=policy)
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
