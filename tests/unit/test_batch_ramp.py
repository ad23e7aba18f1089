"""Megatron-LM's batch-size ramps in loom (loom/config/batch_ramp.py): ``--rampup-batch-size``
against megatron-core 0.16's own ``RampupBatchsizeNumMicroBatchesCalculator`` at every consumed
sample count of random ramps, Megatron's ``--train-samples`` iteration counts,
``--step-batch-size-schedule`` read as Megatron's training reads it (thresholds in tokens), the
learning-rate and weight-decay schedule of a ramped ``--train-samples`` run against Megatron-Core's
``OptimizerParamScheduler`` stepped by each iteration's batch, and the refusals (one line, before
anything starts). The training itself: tests/parallel/test_batch_ramp_parity.py."""

from __future__ import annotations

import random

import pytest
import torch

from loom.config.batch_ramp import BatchRamp, parse_step_schedule
from loom.errors import ConfigError
from testkit.config import tiny_config


def _megatron_rampup(start, incr, samples, final, b=1, d=1):
    from megatron.core.num_microbatches_calculator import \
        RampupBatchsizeNumMicroBatchesCalculator
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=final, micro_batch_size=b, data_parallel_size=d,
        decrease_batch_size_if_needed=False, rank=1, start_global_batch_size=start,
        batch_size_increment=incr, ramup_samples=samples)


def test_rampup_is_megatron_cores_at_every_consumed_count():
    rng = random.Random(0)
    cases = [(384, 384, 97_656_250, 1152), (16, 16, 5_859_375, 1536), (32, 32, 65_324_160, 128),
             (2, 2, 24, 8)]  # the 15B 8T release, GPT-3 175B, Megatron's gpt3 YAML, a tiny one
    cases += [(s, i, rng.randint(1, 5000), s + i * rng.randint(1, 12))
              for s, i in ((rng.randint(1, 64), rng.randint(1, 32)) for _ in range(40))]
    for start, incr, samples, final in cases:
        ours = BatchRamp(final, rampup=(start, incr, samples))
        theirs = _megatron_rampup(start, incr, samples, final)
        grid = sorted({0, samples, samples + 1, *(rng.randint(0, 2 * samples + 10)
                                                  for _ in range(300))})
        seen = set()
        for c in grid:
            theirs.update(c, consistency_check=False)
            assert ours.batch_at(c) == theirs.get_current_global_batch_size(), (start, incr,
                                                                                 samples, c)
            seen.add(ours.batch_at(c))
        assert start in seen and final in seen  # the ramp was exercised end to end


def test_train_samples_iterations_are_megatrons():
    """--train-samples: Megatron's ``update_train_iters`` (through megatron-core 0.16 with
    --rampup-batch-size: the ramp's iterations while at most SAMPLES and at most --train-samples
    samples are consumed, then whole final batches; since 532ad926 with
    --step-batch-size-schedule: iterations until --train-samples is reached)."""
    ramp = BatchRamp(8, rampup=(2, 2, 24))
    # batch 2 at 0, 2, 4, 6; 4 at 8, 12; 6 at 16, 22; 8 from 28 (> 24): 8 ramp iterations,
    # then (60 - 28) // 8 = 4
    assert [ramp.batch_at(ramp.consumed_before(i)) for i in range(10)] == \
        [2, 2, 2, 2, 4, 4, 6, 6, 8, 8]
    assert ramp.train_iters(60) == 12 and ramp.train_iters(63) == 12
    assert ramp.train_iters(20) == 7  # the ramp loop stops past --train-samples: 0..22
    for start, incr, samples, final, total in ((384, 384, 97_656_250, 1152, 19_531_250),
                                               (16, 16, 300, 64, 1000), (5, 5, 1, 20, 100)):
        # Megatron's loop, driven by megatron-core's own calculator
        calc, iters, consumed = _megatron_rampup(start, incr, samples, final), 0, 0
        while consumed <= samples and consumed <= total:
            calc.update(consumed, consistency_check=False)
            consumed += calc.get_current_global_batch_size()
            iters += 1
        iters += max(total - consumed, 0) // final
        assert BatchRamp(final, rampup=(start, incr, samples)).train_iters(total) == iters
    step = BatchRamp(4, steps=parse_step_schedule("0:2 64:4", seq_length=16))  # 4 samples
    assert [step.batch_at(c) for c in (0, 2, 3, 4, 8)] == [2, 2, 2, 4, 4]
    assert step.train_iters(11) == 4 and step.consumed_before(4) == 12  # the last passes 11


def test_step_schedule_reads_tokens_as_megatrons_training_does():
    # the Megatron-LM 15B 8T release's schedule, --seq-length 4096
    assert parse_step_schedule("0:384 200B:768 400B:1152", 4096) == \
        [(0, 384), (200 * 10 ** 9 // 4096, 768), (400 * 10 ** 9 // 4096, 1152)]
    assert parse_step_schedule("2.4B:320, 0:16 1e3:32") == [(0, 16), (1000, 32),
                                                            (2_400_000_000, 320)]  # sorted
    for text, match in (("10:4", "start at 0"), ("0:4 5:8 5:16", "differ"),
                        ("0:4 x", "THRESHOLD:BATCH"), ("0:4 1Q:8", "not a number"),
                        ("0:0", "at least 1")):
        with pytest.raises(ConfigError, match=match):
            parse_step_schedule(text)


def _resolved(world=1, **flat):
    base = dict(lr=1e-3, min_lr=1e-4, train_iters=None, micro_batch_size=1)
    return tiny_config("gpt", base, world=world, **flat)


def test_validation_counts_the_ramped_run_and_refuses_what_cannot_run():
    cfg = _resolved(global_batch_size=8, rampup_batch_size="2 2 24", train_samples=60)
    assert cfg.training.train_iters == 12 and cfg.derived.global_batch_size == 8
    # with --train-iters (Megatron's GPT-3 175B example: refused by Megatron-LM until
    # 532ad926, the ramp ignored since): the ramp runs, the schedule counts iterations
    iters = _resolved(global_batch_size=8, rampup_batch_size="2 2 24", train_iters=5)
    assert iters.training.train_iters == 5 and iters.training.train_samples is None
    step = _resolved(step_batch_size_schedule="0:384 200B:768 400B:1152", seq_length=4096,
                     train_samples=19_531_250)  # every threshold beyond the run: B 384
    assert step.training.train_iters == -(-19_531_250 // 384)
    refused = [
        (dict(global_batch_size=9, rampup_batch_size="2 2 24", train_samples=60),
         "--global-batch-size 9 must be START 2 plus a whole number of INCREMENT 2"),
        (dict(rampup_batch_size="2 2 24", train_samples=60), "ramps up to --global-batch-size"),
        (dict(global_batch_size=8, rampup_batch_size="2 4 24", train_samples=60),
         "--global-batch-size 8 must be START 2"),
        (dict(global_batch_size=8, rampup_batch_size="2 2 0", train_samples=60),
         "SAMPLES must be at least 1"),
        (dict(global_batch_size=8, rampup_batch_size="2 2 24", train_samples=60,
              lr_warmup_iters=3), "--lr-warmup-iters with --rampup-batch-size and "
                                  "--train-samples: .* give --lr-warmup-samples"),
    ]
    for flat, match in refused:
        with pytest.raises(ConfigError, match=match):
            _resolved(**flat)
    with pytest.raises(ConfigError, match=r"--rampup-batch-size: the global batch size 6 it "
                                          r"reaches is not divisible by --micro-batch-size 1 x "
                                          r"data-parallel size 4 = 4"):
        _resolved(world=4, global_batch_size=8, rampup_batch_size="4 2 24", train_samples=60)
    with pytest.raises(ConfigError, match=r"--step-batch-size-schedule, at global batch size 1 "
                                          r"\(1 micro-batches\): the interleaved schedule"):
        _resolved(world=2, num_layers=4, pipeline_model_parallel_size=2,
                  num_layers_per_virtual_pipeline_stage=1, step_batch_size_schedule="0:1 64:4",
                  train_iters=6)


def test_resume_refuses_another_ramp():
    from loom.training.resume import schedule_differences
    cfg = _resolved(global_batch_size=8, rampup_batch_size="2 2 24", train_samples=60)
    saved = {**vars(cfg.training), "global_batch_size": 8}
    assert schedule_differences(saved, cfg) == []
    saved["rampup_batch_size"] = "2 2 40"
    assert schedule_differences(saved, cfg) == [
        "--rampup-batch-size 2 2 40 in the checkpoint, 2 2 24 here"]


@pytest.mark.parametrize("style", ["linear", "cosine", "WSD", "inverse-square-root"])
def test_ramped_schedule_is_megatrons_in_samples(style):
    """A ramped --train-samples run's lr and weight decay at every iteration equal Megatron-Core
    0.16's ``OptimizerParamScheduler`` stepped by each iteration's batch (its lengths in
    samples); loom takes the warm-up one step ahead (as without a ramp): an iteration whose end
    is still in the warm-up has Megatron's next value, the one that crosses its end the peak."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from loom.training.param_schedule import ParamScheduler
    flat = dict(global_batch_size=64, rampup_batch_size="8 8 3000", train_samples=9000,
                lr_warmup_samples=700, lr_decay_samples=8000, lr_decay_style=style,
                weight_decay_incr_style="linear", start_weight_decay=0.01, end_weight_decay=0.1)
    if style == "WSD":
        flat.update(lr_wsd_decay_samples=2000, lr_wsd_decay_style="cosine")
    t = _resolved(**flat).training
    ramp = BatchRamp.from_training(t, 16)
    p = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([{"params": [p], "wd_mult": 1.0}], lr=t.lr)
    ours = ParamScheduler(opt, t, batch=64, ramp=ramp)
    q = torch.zeros(2, requires_grad=True)
    mopt = torch.optim.SGD([{"params": [q], "wd_mult": 1.0}], lr=t.lr)
    theirs = OptimizerParamScheduler(
        mopt, init_lr=t.lr_warmup_init, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=700,
        lr_decay_steps=8000, lr_decay_style=style, start_wd=0.01, end_wd=0.1,
        wd_incr_steps=9000, wd_incr_style="linear",
        wsd_decay_steps=2000 if style == "WSD" else None, lr_wsd_decay_style="cosine")
    meg_lr, meg_wd = [], []
    for i in range(t.train_iters + 2):
        meg_lr.append(mopt.param_groups[0]["lr"])
        meg_wd.append(mopt.param_groups[0]["weight_decay"])
        theirs.step(increment=ramp.batch_at(ramp.consumed_before(i)))
    sizes = set()
    for i in range(t.train_iters + 1):
        lr, wd = opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]
        before, after = ramp.consumed_before(i), ramp.consumed_before(i + 1)
        sizes.add(after - before)
        want = meg_lr[i + 1] if after <= 700 else t.lr if before <= 700 else meg_lr[i]
        assert lr == pytest.approx(want, rel=1e-12, abs=1e-15), i
        assert wd == pytest.approx(meg_wd[i], rel=1e-12, abs=1e-15), i
        ours.step()
    assert {8, 64} <= sizes and len(sizes) == 8  # the ramp ran: 8, 16, ..., 64


def test_an_iteration_based_ramp_counts_iterations():
    """--train-iters with a ramp: the schedule's lengths are iterations (--lr-warmup-iters,
    --lr-decay-iters), whatever each iteration's B."""
    from loom.training.param_schedule import ParamScheduler, lr_at
    t = _resolved(global_batch_size=64, rampup_batch_size="8 8 3000", train_iters=100,
                  lr_warmup_iters=10, lr_decay_style="cosine").training
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=t.lr)
    sched = ParamScheduler(opt, t, batch=64, ramp=BatchRamp.from_training(t, 16))
    lrs = []
    for _ in range(101):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    assert lrs == pytest.approx([lr_at(i, t, batch=64) for i in range(101)], rel=1e-12)
    assert lrs[9] == pytest.approx(t.lr) and lrs[100] == pytest.approx(t.min_lr)


def test_a_ramped_run_logs_each_iterations_global_batch(capsys):
    """Under a ramp each iteration line says its global batch (Megatron's log line has it);
    without one it is left out."""
    from loom.training.metrics import MetricsLogger
    rec = dict(iteration=3, loss=1.0, lr=1e-3, grad_norm=1.0, tokens_per_s=1.0,
               tflops_per_rank=0.0, mfu=None, step_time_s=0.01, peak_memory_bytes=0,
               batch_size=4)
    MetricsLogger(True, progress_bar=False, timestamps=False, batch_ramp=True).log(rec)
    assert "| global batch 4" in capsys.readouterr().out
    MetricsLogger(True, progress_bar=False, timestamps=False).log(rec)
    assert "global batch" not in capsys.readouterr().out


def test_a_decreased_batch_is_megatron_cores():
    """--decrease-batch-size-if-needed: the running batch and micro-batch count are those of
    megatron-core 0.16's ConstantNumMicroBatchesCalculator for every B, b, d tried; the
    evaluation batch defaults to the decreased one; a ramp or B < b d is refused."""
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
    rng = random.Random(0)
    cases = [(5, 1, 2), (7, 2, 3), (8, 1, 4), (1024, 4, 6), (9, 3, 1)]
    cases += [(rng.randint(8, 200), rng.randint(1, 4), rng.choice((1, 2, 3, 4, 6, 8)))
              for _ in range(20)]
    shrunk = 0
    for gbs, b, d in cases:
        if gbs < b * d:
            continue
        cfg = _resolved(world=d, global_batch_size=gbs, micro_batch_size=b, train_iters=3,
                        decrease_batch_size_if_needed=True)
        calc = ConstantNumMicroBatchesCalculator(gbs, b, d, True, rank=1)
        got = cfg.derived
        assert (got.global_batch_size, got.running_global_batch_size, got.num_microbatches) == (
            calc.get_current_global_batch_size(), calc.get_current_running_global_batch_size(),
            calc.get()), (gbs, b, d)
        assert got.eval_global_batch_size == got.running_global_batch_size
        shrunk += got.running_global_batch_size < gbs
    assert shrunk >= 10  # most draws do not divide
    plain = _resolved(world=2, global_batch_size=6, train_iters=3)
    assert plain.derived.running_global_batch_size == 6  # without the flag: B itself
    with pytest.raises(ConfigError, match="--global-batch-size 5 is not divisible"):
        _resolved(world=2, global_batch_size=5, train_iters=3)
    for flat, match in ((dict(global_batch_size=3), "less than one micro-batch per data-"
                                                    "parallel rank .* = 4"),
                        (dict(step_batch_size_schedule="0:4 64:8"), "drop it or "
                                                                    "--step-batch-size-schedule"),
                        (dict(global_batch_size=8, rampup_batch_size="4 4 24", train_samples=60,
                              train_iters=None), "drop it or --rampup-batch-size"),
                        (dict(global_batch_size=8, train_samples=80, train_iters=None,
                              lr_warmup_iters=2), "--lr-warmup-iters with "
                                                  "--decrease-batch-size-if-needed and "
                                                  "--train-samples: .* give "
                                                  "--lr-warmup-samples")):
        with pytest.raises(ConfigError, match=match):
            _resolved(world=4, train_iters=flat.pop("train_iters", 3),
                      decrease_batch_size_if_needed=True, **flat)


@pytest.mark.parametrize("by", ["samples", "iterations"])
def test_a_decreased_schedule_counts_samples_as_megatrons(by):
    """Under --decrease-batch-size-if-needed the schedule is Megatron-Core's
    OptimizerParamScheduler stepped by the running batch (``num_steps`` in samples; lengths
    ``--*-samples``, or ``--*-iters`` x B), also across a restart on another DP size: 7
    iterations at 48 of B 50, then 50 (the checkpoint's consumed samples anchor the count)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from loom.training.param_schedule import ParamScheduler
    B, W, D, T = 50, 400, 2400, 3000  # samples
    common = dict(global_batch_size=B, lr_decay_style="cosine", decrease_batch_size_if_needed=True,
                  weight_decay_incr_style="linear", start_weight_decay=0.01, end_weight_decay=0.1)
    flat = dict(train_samples=T, lr_warmup_samples=W, lr_decay_samples=D) if by == "samples" \
        else dict(train_iters=T // B, lr_warmup_iters=W // B, lr_decay_iters=D // B)
    t = _resolved(world=1, **common, **flat).training
    theirs_opt = torch.optim.SGD([{"params": [torch.zeros(2, requires_grad=True)]}], lr=t.lr)
    theirs = OptimizerParamScheduler(
        theirs_opt, init_lr=t.lr_warmup_init, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=W,
        lr_decay_steps=D, lr_decay_style="cosine", start_wd=0.01, end_wd=0.1,
        wd_incr_steps=T, wd_incr_style="linear")
    sizes = [48] * 7 + [50] * 60
    consumed = [0]
    meg_lr, meg_wd = [], []
    for size in sizes:
        meg_lr.append(theirs_opt.param_groups[0]["lr"])
        meg_wd.append(theirs_opt.param_groups[0]["weight_decay"])
        theirs.step(increment=size)
        consumed.append(consumed[-1] + size)

    def run(running, start, stop, state=None):
        opt = torch.optim.SGD([{"params": [torch.zeros(2, requires_grad=True)],
                                "wd_mult": 1.0}], lr=t.lr)
        ours = ParamScheduler(opt, t, batch=B, running=running)
        if state is not None:  # what Checkpointer.load does
            ours.load_state_dict(state)
            ours.anchor(start, consumed[start])
            ours.resync()
        out = []
        for _ in range(start, stop):
            out.append((opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]))
            ours.step()
        return out, ours.state_dict()
    first, state = run(48, 0, 7)
    second, _ = run(50, 7, len(sizes) - 1, state)
    for i, (lr, wd) in enumerate(first + second):
        before, after = consumed[i], consumed[i + 1]
        want = meg_lr[i + 1] if after <= W else t.lr if before <= W else meg_lr[i]
        assert lr == pytest.approx(want, rel=1e-12, abs=1e-15), i
        assert wd == pytest.approx(meg_wd[i], rel=1e-12, abs=1e-15), i
    assert meg_lr[-1] == pytest.approx(t.min_lr)  # the decay ran to its end


def test_a_decreased_runs_megatron_checkpoint_says_its_skipped_samples():
    """``--ckpt-format torch_dist``'s args carry Megatron-LM's ``skipped_train_samples``
    (iterations x B - consumed), which Megatron's load_checkpoint restores and logs."""
    from loom.checkpoint.megatron.writer import megatron_args
    for decrease, want in ((True, 3), (False, 0)):
        cfg = _resolved(world=2, global_batch_size=6 if not decrease else 5, train_iters=5,
                        decrease_batch_size_if_needed=decrease)
        args = megatron_args(cfg.model, cfg.to_flat(), 3, 12 if decrease else 18, 1, False)
        assert (args.skipped_train_samples, args.consumed_train_samples) == (
            want, 12 if decrease else 18)
