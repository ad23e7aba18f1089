"""A tiny in-process ``loom train`` under WSD and a cosine weight-decay increase: before every
step the optimizer's groups hold the schedule's learning rate and weight decay (the weights' at
the scheduled value, the biases' and norms' at 0), with and without the distributed optimizer;
a resumed run sets both at the checkpoint's iteration before its first step. The schedule's
values themselves are checked against Megatron-Core in tests/unit/test_param_schedule.py."""

from __future__ import annotations

import pytest

from loom.parallel.mesh import ParallelMesh
from testkit.config import tiny_config

SCHEDULE = dict(train_iters=8, lr=1e-3, min_lr=1e-4, lr_warmup_iters=2, lr_decay_iters=7,
                lr_decay_style="WSD", lr_wsd_decay_iters=3, lr_wsd_decay_style="minus_sqrt",
                weight_decay_incr_style="cosine", start_weight_decay=0.02,
                end_weight_decay=0.2, weight_decay=0.0, global_batch_size=4, eval_iters=0,
                log_interval=10 ** 6, no_progress_bar=True)


def _groups(tr) -> list[tuple[float, float, set]]:
    """``(lr, weight_decay, parameter names)`` of each optimizer group of trainer ``tr``."""
    opt = tr.optimizer
    out = []
    for g in opt.param_groups:
        ids = {id(p) for p in g["params"]}
        if hasattr(opt, "ranges"):  # distributed optimizer: fp32 masters by range
            names = {r.name for r in opt.ranges if id(r.master) in ids}
        else:
            names = {n for c in tr.model_chunks for n, p in c.named_parameters() if id(p) in ids}
        out.append((g["lr"], g["weight_decay"], names))
    return out


def _check(tr, it: int) -> list[float]:
    """The groups of ``tr`` at optimizer step ``it`` hold the schedule's values; returns the
    weights' weight decay."""
    from loom.training.param_schedule import lr_at, wd_at
    t = tr.cfg.training
    assert tr.scheduler.last_epoch == it
    decays, undecayed = [], 0
    for lr, wd, names in _groups(tr):
        assert lr == pytest.approx(lr_at(it, t, batch=4), rel=1e-12), (it, names)
        if any(n.endswith(".bias") or "norm" in n for n in names):
            assert wd == 0.0 and all(n.endswith(".bias") or "norm" in n for n in names)
            undecayed += 1
        elif names:
            assert wd == pytest.approx(wd_at(it, t, batch=4), rel=1e-12), (it, names)
            decays.append(wd)
    assert undecayed == 1 and len(decays) == 1
    return decays


@pytest.mark.parametrize("extra", [{}, {"use_distributed_optimizer": True}])
def test_optimizer_groups_follow_the_schedule(extra, tmp_path):
    from loom.training.trainer import Trainer
    cfg = tiny_config("gpt", SCHEDULE, world=1, **extra)
    tr = Trainer(cfg, mesh=ParallelMesh.single())
    seen = []
    for it in range(5):
        seen.append(_check(tr, it))
        tr.train_step()
    assert seen[0] and seen[0][0] == pytest.approx(0.02)  # --start-weight-decay, not 0.0
    assert seen[4] == pytest.approx([0.11] * len(seen[4]))  # halfway: (1 + cos(pi / 2)) / 2
    tr.save(str(tmp_path))
    again = Trainer(cfg, mesh=ParallelMesh.single())
    again.load(str(tmp_path))
    _check(again, 5)  # before its first step: the schedule at the checkpoint's iteration
    lr5 = again.optimizer.param_groups[0]["lr"]
    # WSD: --lr until the annealing starts at 7 - 3, then 1 - sqrt(r) of the way down
    assert lr5 == pytest.approx(1e-4 + (1 - (1 / 3) ** 0.5) * 9e-4)
    again.train_step()
    _check(again, 6)
