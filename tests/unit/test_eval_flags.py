"""Megatron's validation and loop flags (Megatron-LM d98e8a6): ``--start-eval-at-iter``,
``--full-validation``, ``--multiple-validation-sets``, ``--validation-set-names``,
``--iterations-to-skip`` and ``--no-pad-vocab-size``: their one-line refusals, the sample plan
of a full pass at any data-parallel size, and the unpadded vocabulary (end-to-end runs:
tests/integration/test_eval_options.py)."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from loom.config import ConfigError, add_config_arguments, config_from_args
from loom.config.evaluation import parse_iterations
from loom.training.validation import full_pass, pass_samples
from testkit.config import tiny_config


@pytest.mark.parametrize("n,b,m,d", [(7, 1, 2, 1), (16, 2, 2, 2), (23, 2, 3, 2), (5, 1, 1, 4),
                                     (3, 2, 2, 4), (41, 3, 1, 3)])
def test_full_pass_reads_every_sample_once_at_any_dp_size(n, b, m, d):
    """Over the d ranks: each sample of [0, n) read once with weight 1 (the fillers of ranks
    with none left weigh 0); every rank runs the same micro-batches per iteration (the
    pipeline and the MoE all-to-all need it); floor(n / B) full iterations of b-sample
    micro-batches (Megatron's sampler order), one tail iteration of single samples."""
    plans = [full_pass(n, b, m, r, d) for r in range(d)]
    real = Counter()
    for plan in plans:
        assert [len(it) for it in plan] == [len(it) for it in plans[0]]
        for it in plan:
            for idx, weight in it:
                assert weight in (0, len(idx))
                if weight:
                    real.update(idx)
    assert real == Counter(range(n))
    full = n // (b * m * d)
    assert len(plans[0]) == full + (n % (b * m * d) > 0)
    assert all(len(idx) == b for it in plans[0][:full] for idx, _ in it)


def test_pass_samples_is_one_epoch_or_none():
    class Finite:
        def __len__(self):
            return 12

    class Blend:  # a blend weighed by sizes knows its epoch; another is endless
        epoch_samples = 30

        def __len__(self):
            return 1 << 40
    assert pass_samples(Finite()) == 12 and pass_samples(Blend()) == 30
    Blend.epoch_samples = None
    assert pass_samples(Blend()) is None


def test_iterations_to_skip_parse():
    assert parse_iterations(None) == () and parse_iterations("9 3 3") == (3, 9)
    for bad in ("0", "2 x", "-1"):
        with pytest.raises(ConfigError, match="--iterations-to-skip"):
            parse_iterations(bad)


@pytest.mark.parametrize("flat,words", [
    (dict(full_validation=True), "--mock-data's is endless"),
    (dict(validation_set_names="a b"), "add --multiple-validation-sets"),
    (dict(mock_data=False, valid_data_path="/x/a /x/b", multiple_validation_sets=True,
          validation_set_names="one"), "gives 1 name(s) for 2 validation set(s)"),
    (dict(mock_data=False, valid_data_path="/x/a /x/b", multiple_validation_sets=True,
          validation_set_names="one one"), "a name is given twice"),
    (dict(mock_data=False, valid_data_path="0.5 /x/a 0.5 /x/b", multiple_validation_sets=True),
     "without weights (--valid-data-path /x/a /x/b)"),
    (dict(mock_data=False, data_path="0.3 /x/a 0.7 /x/b", full_validation=True),
     "a weighted --data-path blend"),
    (dict(iterations_to_skip="0"), "--iterations-to-skip 0"),
    (dict(phase_transition_iterations="100,x"), "--phase-transition-iterations 100,x: 'x'"),
    (dict(phase_transition_iterations="100", decrease_batch_size_if_needed=True),
     "needs a constant global batch (a phase's data position is its iterations x B): drop it "
     "or --decrease-batch-size-if-needed"),
    (dict(phase_transition_iterations="100", step_batch_size_schedule="0:2 64:4"),
     "drop it or --step-batch-size-schedule"),
    (dict(no_pad_vocab_size=True, vocab_size=101, tensor_model_parallel_size=2),
     "--no-pad-vocab-size keeps the vocabulary at 101 rows"),
])
def test_refusals_are_one_line(flat, words):
    cfg = tiny_config("gpt", **flat)
    with pytest.raises(ConfigError) as e:
        cfg.validate(2 if "tensor_model_parallel_size" in flat else 1)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_accepted_combinations():
    """Names count against --valid-data-path's datasets (one without it); a weighted
    --data-path is fine when --valid-data-path gives the validation data."""
    tiny_config("gpt", mock_data=False, valid_data_path="/x/a /x/b /x/c",
                multiple_validation_sets=True, validation_set_names="a b c").validate(1)
    tiny_config("gpt", multiple_validation_sets=True, validation_set_names="only").validate(1)
    tiny_config("gpt", mock_data=False, data_path="0.3 /x/a 0.7 /x/b", valid_data_path="/x/v",
                full_validation=True).validate(1)


def _flags(*argv: str):
    p = argparse.ArgumentParser(exit_on_error=False)
    add_config_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


def test_command_line_spellings():
    cfg = _flags("--start-eval-at-iter", "100", "--full-validation", "--multiple-validation-sets",
                 "--validation-set-names", "wiki", "code", "--iterations-to-skip", "5", "9",
                 "--disable-pad-vocab-size")
    lg = cfg.logging
    assert (lg.start_eval_at_iter, lg.full_validation, lg.multiple_validation_sets,
            lg.validation_set_names) == (100, True, True, "wiki code")
    assert cfg.training.iterations_to_skip == "5 9" and cfg.model.no_pad_vocab_size
    phases = _flags("--phase-transition-iterations", "300, 100").data.phase_transition_iterations
    assert parse_iterations(phases, "--phase-transition-iterations") == (100, 300)  # sorted
    assert _flags("--no-pad-vocab-size").model.no_pad_vocab_size


def test_unpadded_vocabulary_rows():
    """Megatron pads V to a multiple of --make-vocab-size-divisible-by x t (128 t) unless
    --no-pad-vocab-size; --padded-vocab-size still wins. The planner counts the same rows."""
    from loom.planner.memory import padded_vocab
    padded = tiny_config("gpt", world=2, tensor_model_parallel_size=2)
    assert padded.model.padded_vocab(2) == 256
    cfg = tiny_config("gpt", world=2, tensor_model_parallel_size=2, no_pad_vocab_size=True)
    assert cfg.model.padded_vocab(2) == 100 and float(padded_vocab(cfg.model, 2)) == 100
    given = tiny_config("gpt", world=1, no_pad_vocab_size=True, padded_vocab_size=104)
    assert given.model.padded_vocab(1) == 104
