"""Building on the meta device costs no initialization and, for the planner's exact count, no
storage (loom/parallel/parallelize.py ``SkipModuleInit``, loom/parallel/plan.py ``apply_plan``):
the module initializers a family's ``__init__`` runs are skipped (the registry draws every
value afterwards), and on a meta mesh (the planner's count) the parameters stay on meta, the
parallel layers' shards too."""

from __future__ import annotations

import torch
from torch import nn

from loom.models import get_family
from loom.parallel.mesh import ParallelMesh
from loom.parallel.parallelize import SkipModuleInit, build_model
from testkit.config import tiny_config


def test_module_initializers_are_skipped_and_other_ops_run():
    t = torch.full((4, 3), 7.0)
    with SkipModuleInit():
        for init in (nn.init.normal_, nn.init.kaiming_uniform_, nn.init.zeros_,
                     nn.init.xavier_uniform_, nn.init.ones_, torch.Tensor.uniform_):
            init(t)
        assert nn.init.constant_(tensor=t, val=0.0) is t
        lin = nn.Linear(3, 2)  # its reset_parameters runs kaiming_uniform_ and uniform_
        made = torch.ones(2) + 1  # not an initializer: computed
    assert torch.equal(t, torch.full((4, 3), 7.0)) and torch.equal(made, torch.full((2,), 2.0))
    assert lin.weight.shape == (2, 3)
    assert not torch.equal(nn.init.zeros_(torch.ones(2)), torch.ones(2))  # the mode is gone


def test_build_materializes_except_on_a_meta_mesh():
    cfg = tiny_config("llama").validate(1)
    family = get_family(cfg.model.model_type)
    seeded = build_model(family, cfg.model, ParallelMesh.single())
    again = build_model(family, cfg.model, ParallelMesh.single())
    params = dict(seeded.named_parameters())
    assert params and all(p.device.type == "cpu" for p in params.values())
    for name, p in again.named_parameters():  # the registry's values, not the modules' init
        assert torch.equal(p, params[name]), name
    counted = build_model(family, cfg.model, ParallelMesh.single("meta"), seed=None)
    shapes = {n: p.shape for n, p in counted.named_parameters()}
    assert all(p.is_meta for p in counted.parameters())
    assert shapes == {n: p.shape for n, p in params.items()}
