"""A NaN is never silently trained on: a non-finite gradient norm skips that step on every rank
(weights, Adam states and the LR schedule unchanged), is reported, and training continues;
``--exit-on-nonfinite N`` stops after N in a row (NonFiniteError, exit status 1)."""

from __future__ import annotations

import math

import pytest
import torch

from loom.config import LoomConfig
from loom.errors import NonFiniteError, RerunExit
from testkit import run_distributed
from testkit.config import MEGATRON_DROPOUT, PRE_ISSUE_21, tiny_config


def make_cfg(limit=None) -> LoomConfig:
    """The skip path itself: Megatron's NaN / inf checks of the gradient buckets before the DP
    reduction are off (with them, on by default, a NaN gradient first reruns the iteration:
    tests/drills/test_rerun.py)."""
    return tiny_config("gpt", PRE_ISSUE_21, MEGATRON_DROPOUT, num_layers=1, seq_length=8,
                       vocab_size=64, log_interval=10, eval_iters=10, exit_on_nonfinite=limit,
                       no_check_for_nan_in_loss_and_grad=True)


def poison(trainer, when: set, rank_ok=True):
    """Make one gradient NaN during the iterations in ``when`` (1-based)."""
    p = trainer.params[0]
    p.register_hook(lambda g: g * float("nan") if rank_ok and trainer.iteration + 1 in when
                    else g)


def skip_case(mesh_builder) -> dict:
    import torch.distributed as dist

    from loom.training.trainer import Trainer
    world = dist.get_world_size() if dist.is_initialized() else 1
    tr = Trainer(make_cfg().validate(world), mesh=mesh_builder())
    poison(tr, {2}, rank_ok=not dist.is_initialized() or dist.get_rank() == world - 1)
    tr.train_step()
    before = {n: p.detach().clone() for n, p in tr.model_chunks[0].named_parameters()}
    epoch = tr.scheduler.last_epoch
    rec = tr.train_step()
    unchanged = all(torch.equal(p, before[n]) for n, p in tr.model_chunks[0].named_parameters())
    same_epoch = tr.scheduler.last_epoch == epoch
    after = tr.train_step()
    return {"nan": math.isnan(rec["grad_norm"]), "unchanged": unchanged, "epoch": same_epoch,
            "continues": math.isfinite(after["grad_norm"]) and math.isfinite(after["loss"]),
            "skipped": tr.nonfinite == [] and tr.iteration == 3}


def test_nonfinite_step_skipped_one_rank():
    from loom.parallel.mesh import ParallelMesh
    r = skip_case(ParallelMesh.single)
    assert all(r.values()), r


def _dp2():
    from loom.parallel.mesh import ParallelMesh
    return skip_case(lambda: ParallelMesh.build(dp=2))


def test_nonfinite_on_one_dp_rank_skips_on_every_rank():
    for r in run_distributed(2, _dp2):
        assert all(r.values()), r


def test_exit_on_nonfinite_stops_after_n_in_a_row():
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    tr = Trainer(make_cfg(limit=2).validate(1), mesh=ParallelMesh.single())
    poison(tr, {2, 3})
    tr.train_step()
    tr.train_step()  # the first NaN: skipped, no exit
    with pytest.raises(NonFiniteError, match=r"iterations \[2, 3\]"):
        tr.train_step()


def _dp2_checked() -> dict:
    """DP 2 with Megatron's bucket checks on (the default): rank 1's NaN gradient is rejected by
    its bucket validation before the reduction, every rank reruns the iteration, and (the hook
    fires again) every rank exits 16 together."""
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    cfg = make_cfg()
    cfg.fault_tolerance.no_check_for_nan_in_loss_and_grad = False
    tr = Trainer(cfg.validate(2), mesh=ParallelMesh.build(dp=2))
    poison(tr, {2}, rank_ok=dist.get_rank() == 1)
    tr.train_step()
    try:
        tr.train_step()
        return {"code": None, "reruns": tr.rerun.reruns}
    except RerunExit as e:
        return {"code": e.code, "reruns": tr.rerun.reruns}


def test_nan_gradient_on_one_dp_rank_is_rerun_by_every_rank():
    for r in run_distributed(2, _dp2_checked):
        assert r == {"code": 16, "reruns": 1}, r
