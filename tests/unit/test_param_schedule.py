"""Megatron-LM's optimizer-parameter schedules in loom: ``--lr-decay-style`` inverse-square-root
and WSD (``--lr-wsd-decay-style`` / ``-iters`` / ``-samples``) and the weight-decay schedule
(``--start-weight-decay``, ``--end-weight-decay``, ``--weight-decay-incr-style``), against
Megatron-Core 0.16's own ``OptimizerParamScheduler`` driven step by step on the same parameter
groups; their one-line refusals; a tiny in-process run whose optimizer groups carry the
scheduled values (weights only: biases and norms stay at 0); resume of a changed schedule."""

from __future__ import annotations

import pytest
import torch

from loom.config import LoomConfig
from loom.errors import ConfigError
from testkit.config import tiny_config

B = 8  # samples an iteration: Megatron's schedule counts samples


def _config(world: int = 1, **flat):
    base = dict(lr=1e-3, min_lr=1e-4, train_iters=300, global_batch_size=B, micro_batch_size=2)
    return tiny_config("gpt", base, world=world, **flat)


def _loom_groups(t):
    """loom's parameter groups of ``t`` (weights, biases / norms, the --decoupled-lr group),
    one tensor each."""
    from loom.training.optimizer import decoupled_group
    from loom.training.param_groups import build_groups, group_plan
    plan = group_plan(t, None, decoupled_group(t))
    return build_groups(plan, [(i, torch.zeros(2, requires_grad=True))
                               for i in range(len(plan.specs))], torch.device("cpu"))


def _megatron_history(t, groups, iters: int, steps: int):
    """``(lrs, wds)``: per Megatron iteration n = 0..iters (its ``num_steps`` n B), each
    group's lr and weight decay as Megatron-Core's ``OptimizerParamScheduler`` sets them,
    stepped by B samples at a time; its lengths are Megatron's (``training.py``
    ``get_optimizer_param_scheduler``): iterations x B, or the samples flags."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    mgroups = [{"params": [torch.zeros(2, requires_grad=True)], "wd_mult": g["wd_mult"],
                **({"max_lr": g["max_lr"], "min_lr": g["min_lr"]} if "max_lr" in g else {})}
               for g in groups]
    opt = torch.optim.SGD(mgroups, lr=t.lr)
    start, end = (t.weight_decay, t.weight_decay) if t.weight_decay_incr_style == "constant" \
        else (t.start_weight_decay, t.end_weight_decay)
    if t.train_samples is not None:
        decay, incr = t.lr_decay_samples or t.train_samples, t.train_samples
        warm, wsd = t.lr_warmup_samples, t.lr_wsd_decay_samples
    else:
        decay, incr = (t.lr_decay_iters or t.train_iters) * B, t.train_iters * B
        warm = t.lr_warmup_iters * B
        wsd = None if t.lr_wsd_decay_iters is None else t.lr_wsd_decay_iters * B
    sched = OptimizerParamScheduler(
        opt, init_lr=t.lr_warmup_init, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=warm,
        lr_decay_steps=decay, lr_decay_style=t.lr_decay_style, start_wd=start, end_wd=end,
        wd_incr_steps=incr, wd_incr_style=t.weight_decay_incr_style, wsd_decay_steps=wsd,
        lr_wsd_decay_style=t.lr_wsd_decay_style)
    lrs, wds = [], []
    for _ in range(iters + 1):
        lrs.append([g["lr"] for g in opt.param_groups])
        wds.append([g["weight_decay"] for g in opt.param_groups])
        sched.step(steps)
    return lrs, wds


def _megatron_step(iteration: int, warmup: int) -> int:
    """Megatron's iteration count of loom's optimizer step ``iteration``: loom takes the
    warm-up one step ahead (no step at --lr-warmup-init), the rest at the same count."""
    return iteration + 1 if iteration < warmup else iteration


LR_CASES = {
    "linear": dict(lr_decay_style="linear", lr_warmup_iters=20, lr_decay_iters=250),
    "cosine": dict(lr_decay_style="cosine", lr_warmup_iters=20, lr_warmup_init=2e-4),
    "constant": dict(lr_decay_style="constant", lr_warmup_iters=10),
    "isqrt": dict(lr_decay_style="inverse-square-root", lr_warmup_iters=16,
                  lr_decay_iters=250),
    "isqrt-no-warmup": dict(lr_decay_style="inverse-square-root", min_lr=1e-5),
    **{f"wsd-{s}": dict(lr_decay_style="WSD", lr_wsd_decay_style=s, lr_wsd_decay_iters=60,
                        lr_warmup_iters=20, lr_decay_iters=260, decoupled_lr=3e-3,
                        decoupled_min_lr=2e-5)
       for s in ("exponential", "linear", "cosine", "minus_sqrt")},
}
WD_CASES = {
    "constant": dict(weight_decay=0.05),
    "linear": dict(weight_decay_incr_style="linear", start_weight_decay=0.01,
                   end_weight_decay=0.1),
    "cosine": dict(weight_decay_incr_style="cosine", start_weight_decay=0.0,
                   end_weight_decay=0.2, weight_decay=0.0),
}


def _compare(t, iters: int):
    """loom's ParamScheduler against Megatron's over ``iters`` + a few steps; returns loom's
    (lrs, wds) per step for the activity checks."""
    from loom.training.param_schedule import ParamScheduler
    groups = _loom_groups(t)
    opt = torch.optim.SGD(groups, lr=t.lr)
    sched = ParamScheduler(opt, t, batch=B)
    m_lrs, m_wds = _megatron_history(t, groups, iters + 5, B)
    warmup = t.lr_warmup_iters
    lrs, wds = [], []
    for it in range(iters + 5):
        assert sched.last_epoch == it
        lrs.append([g["lr"] for g in opt.param_groups])
        wds.append([g["weight_decay"] for g in opt.param_groups])
        want_lr, want_wd = m_lrs[_megatron_step(it, warmup)], m_wds[it]
        assert lrs[-1] == pytest.approx(want_lr, rel=1e-9, abs=1e-15), it
        assert wds[-1] == pytest.approx(want_wd, rel=1e-9, abs=1e-15), it
        sched.step()
    return lrs, wds


@pytest.mark.parametrize("wd", sorted(WD_CASES))
@pytest.mark.parametrize("lr", sorted(LR_CASES))
def test_schedule_is_megatrons_step_by_step(lr, wd):
    t = _config(**LR_CASES[lr], **WD_CASES[wd]).training
    lrs, wds = _compare(t, t.train_iters)
    decayed = [g for g, m in enumerate(_loom_groups(t)) if m["wd_mult"]]
    assert all(w[1] == 0.0 for w in wds)  # biases and norms: never any weight decay
    if wd != "constant":  # the schedule is active: the weight decay moved start -> end
        assert wds[0][0] == pytest.approx(t.start_weight_decay, abs=1e-15)
        assert wds[-1][0] == pytest.approx(t.end_weight_decay)
        assert len({w[0] for w in wds}) > 100 and all(w[decayed[-1]] == w[0] for w in wds)
    if lr.startswith("wsd"):  # stable at --lr until the annealing, then down to --min-lr
        stable = t.lr_decay_iters - t.lr_wsd_decay_iters
        assert [x[0] for x in lrs[t.lr_warmup_iters:stable + 1]] == \
            pytest.approx([t.lr] * (stable + 1 - t.lr_warmup_iters))
        assert lrs[stable + 1][0] < t.lr and lrs[t.lr_decay_iters][0] == pytest.approx(t.min_lr)
        assert lrs[t.lr_warmup_iters + 1][2] == pytest.approx(3e-3)  # the decoupled group's
    if lr.startswith("isqrt"):
        assert lrs[100][0] > t.min_lr and lrs[100][0] != pytest.approx(lrs[200][0])


def test_samples_flags_follow_megatrons_sample_counts():
    """--train-samples runs: the WSD annealing from --lr-wsd-decay-samples, and the weight
    decay increasing over --train-samples (not a whole number of iterations here)."""
    t = _config(train_iters=None, train_samples=200 * B + 5, lr_decay_samples=180 * B,
                lr_warmup_samples=10 * B, lr_decay_style="WSD", lr_wsd_decay_samples=40 * B,
                lr_wsd_decay_style="cosine", weight_decay_incr_style="linear",
                start_weight_decay=0.0, end_weight_decay=0.1).training
    assert (t.train_iters, t.lr_decay_iters, t.lr_wsd_decay_iters) == (200, 180, 40)
    _compare(t, t.train_iters)


REFUSED = [
    (dict(lr_decay_style="WSD"), "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (dict(start_weight_decay=0.1), "--start-weight-decay needs --weight-decay-incr-style"),
    (dict(weight_decay_incr_style="linear", start_weight_decay=0.1),
     "--weight-decay-incr-style linear needs both --start-weight-decay and --end-weight-decay"),
    (dict(weight_decay_incr_style="cosine", start_weight_decay=0.2, end_weight_decay=0.1),
     "--end-weight-decay 0.1 is below --start-weight-decay 0.2"),
    (dict(lr_decay_style="WSD", lr_wsd_decay_samples=80),
     "--lr-wsd-decay-samples describes a run by samples: give --train-samples"),
    (dict(train_iters=None, train_samples=800, lr_decay_style="WSD", lr_wsd_decay_iters=5,
          lr_wsd_decay_samples=80), "both set the WSD annealing"),
    (dict(lr_wsd_decay_style="sqrt"), "--lr-wsd-decay-style"),
    (dict(weight_decay_incr_style="exponential"), "--weight-decay-incr-style"),
]


@pytest.mark.parametrize("flat,words", REFUSED)
def test_bad_combinations_are_refused_in_one_line(flat, words):
    with pytest.raises(ConfigError) as e:
        _config(**flat)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_resumed_schedule_changes_are_named():
    """A changed WSD annealing or weight-decay schedule is a difference of the resumed run
    (Megatron's ``_check_and_set``); a longer --train-iters is one only while the weight decay
    increases until it."""
    from loom.training.resume import reconcile_schedule, schedule_differences
    wsd = dict(lr_decay_style="WSD", lr_wsd_decay_iters=50, lr_decay_iters=250)
    saved = _config(**wsd).to_flat()
    assert schedule_differences(saved, _config(**wsd)) == []
    diff = schedule_differences(saved, _config(**{**wsd, "lr_wsd_decay_iters": 60,
                                                  "lr_wsd_decay_style": "linear"}))
    assert diff == ["--lr-wsd-decay-style exponential in the checkpoint, linear here",
                    "--lr-wsd-decay-iters 50 in the checkpoint, 60 here"]
    assert schedule_differences(saved, _config(**wsd, train_iters=400)) == []
    ramp = dict(weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.1)
    assert schedule_differences(saved, _config(**wsd, **ramp)) == [
        "--weight-decay-incr-style constant in the checkpoint, linear here"]
    old = {k: v for k, v in saved.items() if k not in ramp}  # a checkpoint from before
    assert schedule_differences(old, _config(**wsd)) == []
    ramp["lr_decay_iters"] = 250  # the decay ends there, whatever --train-iters
    saved = _config(**ramp).to_flat()
    assert schedule_differences(saved, _config(**ramp, train_iters=400)) == [
        "--train-iters 300 in the checkpoint, 400 here (the weight decay increases until "
        "--train-iters)"]
    assert schedule_differences(saved, _config(**{**ramp, "end_weight_decay": 0.2})) == [
        "--end-weight-decay 0.1 in the checkpoint, 0.2 here"]
    took = reconcile_schedule(saved, _config(**{**ramp, "end_weight_decay": 0.2},
                                             use_checkpoint_opt_param_scheduler=True), "ck")
    assert took["end_weight_decay"] == 0.1 and took["weight_decay_incr_style"] == "linear"
    flags = tiny_config("gpt", dict(lr=1e-3, min_lr=1e-4, train_iters=300, global_batch_size=B,
                                    lr_decay_style="WSD", lr_wsd_decay_iters=9, **ramp),
                        use_checkpoint_opt_param_scheduler=True)
    took = reconcile_schedule(_config(**wsd).to_flat(), flags.validate(1), "ck")
    merged = LoomConfig.from_flat({**flags.to_flat(), **took}).validate(1).training
    assert (merged.lr_wsd_decay_iters, merged.weight_decay_incr_style,
            merged.start_weight_decay) == (50, "constant", None)  # the checkpoint's, valid
    with pytest.raises(ConfigError, match="give --train-iters 300"):
        reconcile_schedule(saved, _config(**{**ramp, "end_weight_decay": 0.2}, train_iters=400,
                                          use_checkpoint_opt_param_scheduler=True), "ck")
