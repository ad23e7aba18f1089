"""Full (unsharded) loom tensors -> a loom model at any tensor-parallel size.

A family's Hugging Face mapping (e.g. :mod:`loom.models.gpt.hf`, ``family.hf``) produces full
tensors under loom's parameter names; :func:`load_full_state_dict` then cuts each rank's shard
with the same :func:`~loom.parallel.registry.local_shard` that initialization and checkpoints
use.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from loom.parallel.registry import local_shard


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors into a (possibly TP-sharded, pipeline-partial) loom model by name.

    Raises KeyError naming any parameter of the model missing from ``full``.
    """
    mesh = model.mesh
    for name, p in model.named_parameters():
        if name not in full:
            raise KeyError(f"{name} missing from the converted state dict")
        meta = model.registry[name]
        p.copy_(local_shard(full[name].float(), meta, *mesh.shard_of(meta), name))
