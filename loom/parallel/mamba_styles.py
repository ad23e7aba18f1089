"""Parallel styles for state-space (Mamba) layers.

:class:`ChannelParallelParams` splits per-head / per-channel parameters of a module along dim 0
over TP without replacing the module: the Mamba-2 conv weights and bias (channels of
``(x, B, C)``, each block split t ways), ``A_log``, ``D``, ``dt_bias`` (heads) and the gated
norm's weight (channels of ``x``). The model reads its local sizes from these parameters, so no
communication is added: a Mamba layer keeps the in-projection's ``f`` and the out-projection's
``g`` as its only TP collectives (Megatron-LM's MambaMixer split).

:class:`ContextParallelMambaScan` wraps a mixer's parameterless scan core to run over the CP
group (:mod:`loom.parallel.context.mamba`: all-to-all from sequence to head sharding and back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from loom.parallel.context.mamba import wrap_context_parallel_scan
from loom.parallel.plan import ParallelStyle
from loom.parallel.registry import ShardSpec


@dataclass(frozen=True)
class ChannelParallelParams(ParallelStyle):
    """``params``: ``((parameter name, segments or None), ...)`` of the matched module, each
    split along dim 0 (every fused block of ``segments`` split t ways, as
    :class:`~loom.parallel.registry.ShardSpec`). The parameter is replaced by one of the local
    shape ``[full_0 / t, ...]`` on the module's (meta) device; the registry records the full
    shape and the shard. Raises ValueError when a block is not divisible by t."""

    params: tuple[tuple[str, Optional[tuple[int, ...]]], ...]

    def apply(self, module, ctx):
        t = ctx.mesh.tp_size
        fields = {}
        for name, segments in self.params:
            p = module.get_parameter(name)
            full = tuple(p.shape)
            for seg in segments or (full[0],):
                if seg % t:
                    raise ValueError(f"{name}: block of {seg} channels is not divisible by "
                                     f"tensor parallel size {t}")
            if segments is not None and sum(segments) != full[0]:
                raise ValueError(f"{name}: segments {segments} do not sum to {full[0]}")
            if t > 1:
                owner, _, leaf = name.rpartition(".")
                local = torch.empty((full[0] // t, *full[1:]), dtype=p.dtype, device=p.device)
                (module.get_submodule(owner) if owner else module).register_parameter(
                    leaf, nn.Parameter(local))
            fields[name] = dict(full_shape=full, shard=ShardSpec(0, segments))
        return module, fields


@dataclass(frozen=True)
class ContextParallelMambaScan(ParallelStyle):
    """Wrap a Mamba scan core (``layers.<i>.mixer.scan``) in
    :class:`~loom.parallel.context.mamba.ContextParallelScan` when the mesh has a CP group
    (unchanged otherwise); no parameters."""

    def apply(self, module, ctx):
        return wrap_context_parallel_scan(module, ctx.mesh), {}
