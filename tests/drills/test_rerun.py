"""Megatron's rerun state machine (--rerun-mode, --error-injection-rate / -type,
--check-for-spiky-loss, --no-check-for-nan-in-loss-and-grad, --result-rejected-tracker-filename;
loom/training/rerun.py): a rejected micro-batch loss reruns the iteration in place; a transient
fault under the non-fatal spike check is rerun and training goes on with the very losses and
weights of a run without the fault; under the fatal NaN / inf check it exits 17; a reproduced
one is checkpointed and exits 16, each in one line; disabled never reruns. Single process,
tiny model, 3 iterations each."""

from __future__ import annotations

import math

import pytest
import torch

from loom.config import LoomConfig
from loom.errors import NonFiniteError, RerunExit
from loom.training.rerun import (EXIT_FAILED_ON_RESULT_VALIDATION, EXIT_RESUME_TO_DISAMBIGUATE,
                                 ErrorInjector, relative_difference)
from testkit.config import MEGATRON_DROPOUT, tiny_config

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "8", "--max-position-embeddings", "8", "--vocab-size", "64",
        "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--train-iters", "3", "--eval-iters", "0"]


def make_cfg(pp: int = 1, **ft) -> LoomConfig:
    return tiny_config("gpt", MEGATRON_DROPOUT, dict(
        num_layers=pp, seq_length=8, vocab_size=64, pipeline_model_parallel_size=pp,
        global_batch_size=4, train_iters=3, eval_iters=0), ft, world=pp)


def train(**ft):
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    tr = Trainer(make_cfg(**ft), mesh=ParallelMesh.single())
    return tr, tr.train()


def weights(tr) -> dict:
    return {n: p.detach().clone() for c in tr.model_chunks for n, p in c.named_parameters()}


def test_transient_fault_is_rerun_and_training_continues_unchanged(tmp_path):
    """A transient error injected into the spike check (non-fatal) at every validated
    iteration: each is rerun (not the first iteration, never validated) and the run ends with
    the losses and weights of the run without injection, bit for bit (dropout replayed)."""
    plain, h0 = train()
    track = tmp_path / "rejected.txt"
    tr, h1 = train(no_check_for_nan_in_loss_and_grad=True, check_for_spiky_loss=True,
                   error_injection_rate=1, result_rejected_tracker_filename=str(track))
    assert tr.rerun.reruns == 2 and len(h1) == 3
    assert [r["loss"] for r in h1] == [r["loss"] for r in h0]
    w0, w1 = weights(plain), weights(tr)
    assert all(torch.equal(w0[n], w1[n]) for n in w0)
    lines = track.read_text().splitlines()
    assert [ln.split(" status=")[1].split(" ")[0] for ln in lines] == \
        ["initial_run", "first_rerun_not_reproducible"] * 2
    assert all("rank=0" in ln and "message='Spiky loss'" in ln for ln in lines)
    assert "iteration=2" in lines[0] and "iteration=3" in lines[2]


def test_validate_results_off_never_reruns():
    plain, h0 = train()
    tr, h1 = train(rerun_mode="disabled", error_injection_rate=1, check_for_spiky_loss=True)
    assert tr.rerun.reruns == 0 and [r["loss"] for r in h1] == [r["loss"] for r in h0]


def test_transient_fault_under_the_nan_check_exits_17_without_a_checkpoint(tmp_path):
    with pytest.raises(RerunExit) as e:
        train(error_injection_rate=1, error_injection_type="transient_error")
    assert e.value.code == EXIT_FAILED_ON_RESULT_VALIDATION == 17 and not e.value.checkpoint
    assert "iteration 2" in str(e.value) and "transient" in str(e.value)


def test_persistent_fault_checkpoints_and_exits_16(tmp_path, capsys):
    """Through `loom train`: the rerun reproduces the injected rejection, the starting state of
    iteration 2 (= the end of iteration 1) is saved and the run exits 16 in one line."""
    from loom.cli import main
    save = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as e:
        main(["train", *TINY, "--save", str(save), "--rerun-mode", "validate_results",
              "--error-injection-rate", "1", "--error-injection-type", "persistent_error"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == EXIT_RESUME_TO_DISAMBIGUATE == 16
    assert "\n" not in err and err.startswith("loom train: error: iteration 2: the rerun "
                                              "reproduced a rejected result"), err
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert "checkpoint of iteration 1" in err


def test_real_nan_loss_is_rerun_reproduced_and_stops():
    """A NaN loss (not injected) from iteration 2: reproduced by the rerun -> 16 (no --save:
    said); under --rerun-mode disabled it stops with status 1 (NonFiniteError)."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    for mode, error in (("validate_results", RerunExit), ("disabled", NonFiniteError)):
        tr = Trainer(make_cfg(rerun_mode=mode), mesh=ParallelMesh.single())
        tr.model_chunks[0].register_forward_hook(
            lambda mod, args, out, tr=tr: out * float("nan") if tr.iteration + 1 == 2 else out)
        with pytest.raises(error, match="iteration 2") as e:
            tr.train()
        if mode == "validate_results":
            assert e.value.code == 16 and "no --save" in str(e.value)
            assert tr.rerun.reruns == 1 and tr.iteration == 1
        else:
            assert "NaN" in str(e.value) and tr.rerun.reruns == 0


def test_injector_and_comparison_follow_megatron():
    import random
    inj = ErrorInjector(4, "persistent_error", random.Random(0), rank=1)
    draws = [inj.maybe_inject() for _ in range(40)]
    assert draws.count(True) == 1  # once until its rerun compares
    assert inj.compare(1.0, 2.0) == 0.0 and inj.injected is None  # forced match
    assert relative_difference(float("nan"), float("nan")) == 0.0
    assert math.isinf(relative_difference(float("nan"), 1.0))
    assert relative_difference(1.0, 3.0) == 1.0


def test_bad_values_refused_in_one_line(capsys, tmp_path):
    """report_stats (Megatron d98e8a6 itself cannot start with it) and a tracker file in a
    directory that does not exist: one line, status 2, before training."""
    from loom.cli import main
    for argv, words in ((["--dry-run", "--rerun-mode", "report_stats"], "report_stats"),
                        (["--result-rejected-tracker-filename", str(tmp_path / "no" / "t.txt")],
                         "--result-rejected-tracker-filename")):
        with pytest.raises(SystemExit) as e:
            main(["train", *TINY, *argv])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and "\n" not in err and words in err, err


def _pp2_injected() -> dict:
    """PP=2: the loss (and the injection) is on the last stage only; the first stage reruns
    with it (the ranks agree by an all-reduce)."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    out = {}
    for name, ft in (("plain", {}), ("injected", dict(no_check_for_nan_in_loss_and_grad=True,
                                                      check_for_spiky_loss=True,
                                                      error_injection_rate=1))):
        cfg = make_cfg(**ft, pp=2)
        tr = Trainer(cfg, mesh=ParallelMesh.build(pp=2))
        out[name] = ([r["loss"] for r in tr.train()], tr.rerun.reruns)
    return out


def test_every_pipeline_stage_reruns_together():
    from testkit import run_distributed
    for r in run_distributed(2, _pp2_injected):
        assert r["injected"] == (r["plain"][0], 2) and r["plain"][1] == 0, r


def _bucket_case(poison_runs: set, scale: float = float("nan"), iters: int = 3, **ft):
    """bf16 on one process (its fp32 main gradients live in a bucket, validated before the
    reduction as Megatron's check_grads does): multiply one weight's gradient by ``scale`` in
    the runs of iteration 2 (or ``iters - 1``) listed in ``poison_runs`` (0 the first, 1 the
    rerun). Returns the trainer, its history and the exception, if any."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    cfg = tiny_config("gpt", MEGATRON_DROPOUT, dict(
        num_layers=1, seq_length=8, vocab_size=64, global_batch_size=4, train_iters=iters,
        eval_iters=0, bf16=True), ft, world=1)
    from loom.training.rerun import State
    tr = Trainer(cfg, mesh=ParallelMesh.single())
    target = max(2, iters - 1)

    def hook(g):
        run = {State.INITIAL_RUN: 0, State.RERUNNING_IN_PLACE: 1}.get(tr.rerun.state)
        return g * scale if tr.iteration + 1 == target and run in poison_runs else g
    tr.params[0].register_hook(hook)
    try:
        return tr, tr.train(), None
    except (RerunExit, NonFiniteError) as e:
        return tr, tr.history, e


def test_a_nan_gradient_bucket_is_rerun_and_attributed(tmp_path):
    """Megatron's default bucket check: a NaN in a bucket's local norm before the DP reduction
    reruns the iteration; reproduced, the run checkpoints and exits 16; gone on the rerun (a
    transient fault), exit 17. The tracker names the bucket."""
    track = tmp_path / "rejected.txt"
    tr, _, e = _bucket_case({0, 1}, result_rejected_tracker_filename=str(track))
    assert isinstance(e, RerunExit) and e.code == EXIT_RESUME_TO_DISAMBIGUATE  # (no --save)
    lines = track.read_text().splitlines()
    assert [ln.split(" status=")[1].split(" ")[0] for ln in lines] == \
        ["initial_run", "first_rerun_reproducible"]
    assert all("message='found NaN in local grad norm for bucket #0 in backward pass before "
               "data-parallel communication collective'" in ln for ln in lines), lines
    tr, _, e = _bucket_case({0})
    assert isinstance(e, RerunExit) and e.code == EXIT_FAILED_ON_RESULT_VALIDATION
    assert tr.rerun.grad_checks == (True, False)


def test_bucket_checks_off_leave_the_nan_to_the_skipped_step():
    tr, h, e = _bucket_case({0, 1}, no_check_for_nan_in_loss_and_grad=True)
    assert e is None and tr.rerun.reruns == 0 and math.isnan(h[1]["grad_norm"]) and len(h) == 3
    tr, _, e = _bucket_case({0, 1}, rerun_mode="disabled")
    assert isinstance(e, NonFiniteError) and "found NaN in local grad norm for bucket #0" in \
        str(e)


def test_large_gradients_are_a_non_fatal_check():
    """``--check-for-large-grads``: after 100 bucket norms, one 1000x larger is rejected and
    rerun; not reproduced, training goes on with the rerun's gradients, the weights those of a
    run without the spike, bit for bit."""
    plain, hp, _ = _bucket_case(set(), iters=103, check_for_large_grads=True)
    tr, h, e = _bucket_case({0}, scale=1000.0, iters=103, check_for_large_grads=True)
    assert e is None and tr.rerun.reruns == 1 and len(h) == 103
    assert [r["loss"] for r in h] == [r["loss"] for r in hp]
    w0, w1 = weights(plain), weights(tr)
    assert all(torch.equal(w0[n], w1[n]) for n in w0)
    quiet, _, _ = _bucket_case({0}, scale=1000.0, iters=103)  # off by default: no rerun
    assert quiet.rerun.reruns == 0
