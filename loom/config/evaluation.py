"""When and on what the training loop evaluates, and which iterations it skips: Megatron-LM's
``--start-eval-at-iter``, ``--full-validation``, ``--multiple-validation-sets``,
``--validation-set-names`` (the fields of :class:`EvaluationFields`, a mixin of LoggingConfig)
and ``--iterations-to-skip`` (a field of TrainingConfig), and the data phases of
``--phase-transition-iterations`` (a field of DataConfig), with their rules
(:func:`check_evaluation`, run inside the one validation pass). Megatron-LM d98e8a6:
``megatron/training/training.py`` (``train``, ``evaluate_and_print_results``,
``build_train_valid_test_data_iterators``) and
``megatron/core/datasets/blended_megatron_dataset_builder.py``. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from loom.config.blend import parse_blend
from loom.config.fields import opt
from loom.errors import ConfigError


@dataclass
class EvaluationFields:
    """Megatron's validation options; a mixin of LoggingConfig (off by default, as in
    Megatron)."""

    start_eval_at_iter: Optional[int] = opt(
        None, "no periodic evaluation before this iteration (the --eval-interval multiples "
              "from it on evaluate; the evaluation after the last iteration always runs)", ge=0)
    full_validation: bool = opt(
        False, "each evaluation reads the whole validation set(s), every sample once (one "
               "epoch of each dataset, as Megatron sizes it; --eval-iters then counts for the "
               "test set only); needs finite validation data: not --mock-data, not a weighted "
               "blend")
    multiple_validation_sets: bool = opt(
        False, "each dataset of --valid-data-path P1 P2 ... is a validation set of its own, "
               "evaluated and logged separately as validation-NAME (no weights in the list)")
    validation_set_names: Optional[str] = opt(
        None, "with --multiple-validation-sets: one name per validation set, in "
              "--valid-data-path's order (default: 0, 1, ...)", words=True)


def parse_iterations(text: Optional[str], flag: str = "--iterations-to-skip"
                     ) -> tuple[int, ...]:
    """``--iterations-to-skip "5 9"`` (or ``--phase-transition-iterations 5,9``: ``flag``) ->
    ``(5, 9)`` (1-based iteration numbers, sorted, each once); ``()`` when not given. Raises
    ConfigError for a word that is not an iteration number >= 1."""
    out = set()
    for word in (text or "").replace(",", " ").split():
        if not word.isdigit() or int(word) < 1:
            raise ConfigError(f"{flag} {text}: {word!r} is not an iteration number (1, 2, ...: "
                              f"the iteration a step would complete)")
        out.add(int(word))
    return tuple(sorted(out))


PHASES_FLAG = "--phase-transition-iterations"


def check_phases(t: Any, text: Optional[str]) -> None:
    """``--phase-transition-iterations`` (``text``) with TrainingConfig ``t``: well formed, and
    a constant global batch (Megatron-LM: "Requires fixed global batch size across phases.
    Does not support batch size ramp-up"; the position in a phase is its iterations x B).
    Raises ConfigError."""
    if not parse_iterations(text, PHASES_FLAG):
        return
    for flag, value in (("--rampup-batch-size", t.rampup_batch_size),
                        ("--step-batch-size-schedule", t.step_batch_size_schedule),
                        ("--decrease-batch-size-if-needed", t.decrease_batch_size_if_needed)):
        if value:
            raise ConfigError(f"{PHASES_FLAG} needs a constant global batch (a phase's data "
                              f"position is its iterations x B): drop it or {flag}")


def blend_words(text: Optional[str], flag: str) -> tuple[int, bool]:
    """``(datasets, weighted)`` of a ``--data-path``-style value of ``flag`` (``(0, False)`` for
    None): how many datasets :func:`loom.config.blend.parse_blend` reads, and whether it gives
    two or more of them weights. Raises ConfigError naming ``flag`` for a malformed blend."""
    blend = parse_blend(text, flag) if text and text.split() else None
    if not blend:
        return 0, False
    return len(blend), len(blend) > 1 and blend[0][0] is not None


def validation_set_count(cfg: Any) -> int:
    """The validation sets ``--multiple-validation-sets`` makes: one per dataset of
    ``--valid-data-path`` (Megatron's per-split blend), else one (the validation split of
    ``--data-path``, or mock data)."""
    d = cfg.data
    if not d.valid_data_path:
        return 1
    return max(blend_words(d.valid_data_path, "--valid-data-path")[0], 1)


def check_evaluation(cfg: Any) -> None:
    """Megatron's rules of the validation flags and ``--iterations-to-skip`` (one line each,
    naming the flag and the fix): names need ``--multiple-validation-sets`` and one distinct
    name per set; separate sets carry no weights; ``--full-validation`` needs validation data
    of known size (not ``--mock-data``, no weighted blend: Megatron's
    ``BlendedMegatronDatasetBuilder`` cannot size one either). Raises ConfigError."""
    lg, d = cfg.logging, cfg.data
    parse_iterations(cfg.training.iterations_to_skip)
    check_phases(cfg.training, d.phase_transition_iterations)
    names = (lg.validation_set_names or "").split()
    if lg.validation_set_names is not None and not lg.multiple_validation_sets:
        raise ConfigError("--validation-set-names names the sets of --multiple-validation-sets: "
                          "add --multiple-validation-sets (with --valid-data-path P1 P2 ...)")
    valid_weighted = blend_words(d.valid_data_path, "--valid-data-path")[1]
    if lg.multiple_validation_sets:
        if valid_weighted:
            prefixes = " ".join(d.valid_data_path.split()[1::2])
            raise ConfigError(f"--multiple-validation-sets evaluates each dataset of "
                              f"--valid-data-path on its own: give the prefixes without "
                              f"weights (--valid-data-path {prefixes})")
        count = validation_set_count(cfg)
        if lg.validation_set_names is not None and len(names) != count:
            raise ConfigError(f"--validation-set-names gives {len(names)} name(s) for "
                              f"{count} validation set(s) (--valid-data-path's datasets): "
                              f"give {count}")
        if len(set(names)) != len(names):
            raise ConfigError(f"--validation-set-names {lg.validation_set_names}: a name is "
                              f"given twice; each set's losses are logged under its name")
    if not lg.full_validation:
        return
    if d.mock_data or not (d.data_path or d.train_data_path or d.valid_data_path
                           or d.test_data_path):
        raise ConfigError("--full-validation reads the whole validation set, and --mock-data's "
                          "is endless: give --valid-data-path (or --data-path), or drop "
                          "--full-validation")
    if valid_weighted or (not d.valid_data_path and blend_words(d.data_path, "--data-path")[1]):
        flag = "--valid-data-path" if d.valid_data_path else "--data-path"
        raise ConfigError(f"--full-validation reads one epoch of each validation dataset, which "
                          f"a weighted {flag} blend does not define: give the prefixes "
                          f"without weights (weighed by their sizes)")
