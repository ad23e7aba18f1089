"""``--eval-global-batch-size`` / ``--eval-micro-batch-size`` (Megatron-LM d98e8a6,
megatron/training/arguments.py and ``evaluate`` in training.py): an evaluation iteration reads
B_eval samples in B_eval / (b_eval d) micro-batches of b_eval per DP rank; an evaluation reads
``--eval-iters`` x B_eval samples, the first ones of the validation set; the loss is the mean
over them, whatever the evaluation batch sizes."""

from __future__ import annotations

import pytest

from loom.config import LoomConfig
from loom.errors import ConfigError
from loom.parallel.mesh import ParallelMesh
from testkit.data import Recording
from testkit.config import tiny_config


def make_cfg(**logging) -> LoomConfig:
    return tiny_config("gpt", dict(vocab_size=96, global_batch_size=4, train_iters=2,
                                   no_progress_bar=True), logging)


def _evaluate(**logging) -> tuple[float, list[int], int]:
    from loom.training.trainer import Trainer
    tr = Trainer(make_cfg(**logging).validate(1), mesh=ParallelMesh.single())
    seen = Recording(tr.parts.data.valid_ds)
    rec = tr.evaluate(dataset=seen)
    return rec["valid_loss"], seen.read, tr.parts.data.eval_num_microbatches


def test_the_loss_is_the_mean_over_the_same_samples_whatever_the_batch_sizes():
    """16 validation samples read as 8 x 2, 4 x 4 (micro-batches of 1, 2 and 4), 2 x 8 and
    1 x 16: the same samples, the same mean loss (float rounding apart)."""
    runs = {(8, 2, 1): None, (4, 4, 1): None, (4, 4, 2): None, (4, 4, 4): None,
            (2, 8, 2): None, (1, 16, 4): None}
    for (iters, egbs, emb) in runs:
        loss, read, m = _evaluate(eval_iters=iters, eval_global_batch_size=egbs,
                                  eval_micro_batch_size=emb)
        assert sorted(read) == list(range(16)), (iters, egbs, emb, read)  # Megatron's count
        assert m == egbs // emb  # micro-batches of one evaluation iteration (d = 1)
        runs[(iters, egbs, emb)] = loss
    first = runs[(8, 2, 1)]
    for key, loss in runs.items():
        assert loss == pytest.approx(first, rel=1e-6), (key, runs)


def test_defaults_are_the_training_batch_sizes():
    cfg = make_cfg(eval_iters=3).validate(1)
    assert (cfg.logging.eval_global_batch_size, cfg.logging.eval_micro_batch_size) == (4, 2)
    assert cfg.derived.eval_num_microbatches == 2
    _, read, m = _evaluate(eval_iters=3)
    assert sorted(read) == list(range(12)) and m == 2  # --eval-iters x --global-batch-size


def test_megatron_rule_and_the_step_schedule_default():
    cfg = make_cfg(eval_global_batch_size=12, eval_micro_batch_size=3)
    cfg.training.global_batch_size = 8
    resolved = cfg.validate(4)  # d = 4: 12 = 3 x 4 x 1
    assert resolved.derived.eval_num_microbatches == 1
    with pytest.raises(ConfigError, match=r"--eval-global-batch-size 9 is not divisible by "
                                          r"--eval-micro-batch-size 3 x data-parallel size 2"):
        make_cfg(eval_global_batch_size=9, eval_micro_batch_size=3).validate(2)
    # Megatron: with --step-batch-size-schedule, --global-batch-size is b x d, and so is the
    # evaluation's default; the training batch is the schedule's (its last size, in loom)
    ramp = make_cfg()
    ramp.training.global_batch_size = None
    ramp.training.step_batch_size_schedule = "0:8 100:16"
    r = ramp.validate(2)
    assert r.logging.eval_global_batch_size == 4 and r.derived.global_batch_size == 16
    given = make_cfg(eval_global_batch_size=32)
    given.training.global_batch_size = None
    given.training.step_batch_size_schedule = "0:8 100:16"
    assert given.validate(2).derived.eval_num_microbatches == 8
