"""A dropped Trainer frees its model, gradient buffers and optimizer states.

On one H200, ``make gpu-check`` built a Trainer per run in one process and each build's peak
came out ~12 GiB above the first: the gradient buffer's post-accumulate-grad hooks (kept by
autograd in C++, out of sight of Python's cycle collector) held the buffer, which held the
parameters. A user building trainers in a notebook, a sweep or a test run would leak the same.
"""

import gc
import weakref

import pytest
import torch

from loom.parallel.mesh import ParallelMesh
from loom.training.trainer import Trainer
from testkit.config import tiny_config


def _alive_after_drop(**flags) -> tuple[int, int]:
    """(tensors the trainer owned, how many of them outlive it): parameters, main gradients and
    optimizer states, watched by weak references across two steps and a ``del``."""
    tr = Trainer(tiny_config("llama", **flags).validate(1), mesh=ParallelMesh.single(torch.device("cpu")))
    tr.train_step()
    tr.train_step()
    owned = [p for g in tr.optimizer.param_groups for p in g["params"]]
    owned += [p for m in tr.parts.model.chunks for p in m.parameters()] \
        if hasattr(tr.parts.model, "chunks") else []
    owned += [t for s in tr.optimizer.state.values() for t in s.values()
              if isinstance(t, torch.Tensor) and t.dim() > 0]
    refs = [weakref.ref(t) for t in owned]
    assert refs, "nothing watched: the check could not fail"
    del tr, owned
    gc.collect()
    return len(refs), sum(r() is not None for r in refs)


@pytest.mark.parametrize("flags", [
    {},  # fp32: no gradient buffer at one rank
    {"bf16": True},  # fp32 main gradients in buckets, hooks on every parameter
    {"bf16": True, "use_distributed_optimizer": True},
], ids=["fp32", "bf16", "bf16-distopt"])
def test_a_dropped_trainer_frees_what_it_owned(flags):
    watched, alive = _alive_after_drop(**flags)
    assert alive == 0, f"{alive} of {watched} tensors outlived their Trainer"
