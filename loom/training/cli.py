"""``loom train``: Megatron-style flags (or ``--config FILE.yaml``), one rank or many via torchrun.

Every check runs in every rank before any process group starts (:func:`prepare`): the values
and the layout (``LoomConfig.validate``), the data source and its files (``meta.json`` against
``.bin``/``.idx`` and ``--vocab-size``), the checkpoint directories (a broken ``latest`` pointer,
checkpoints a fresh run would overwrite, an unwritable or full ``--save``). A refusal costs
nothing and is printed once, by rank 0. Then rank 0 locks ``--save`` for the whole run (one job
per directory: :mod:`loom.checkpoint.lock`). ``--dry-run`` prints the planner's memory and time
prediction for exactly these flags and exits.

Only the modules that import torch (the model families, the checkpoint reader, the planner,
the trainer) are imported inside the functions that need them: ``--help`` and a refusal stay
fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Optional

from loom.checkpoint.data_match import check_same_data
from loom.checkpoint.holds import take_hold
from loom.checkpoint.lock import lock_for_job
from loom.checkpoint.model_match import check_same_model
from loom.checkpoint.safety import (check_checkpoint_files, remove_partial_checkpoints,
                                    resolve_checkpoint)
from loom.config import LoomConfig, ModelConfig, add_config_arguments, config_from_args
from loom.config.args import read_yaml_config
from loom.config.fields import flag as flag_of
from loom.config.script_flags import read_data_args
from loom.training import non_persistent
from loom.config.validate import check_sft
from loom.data.blended import blend_vocab_size, build_datasets, data_prefixes
from loom.data.checks import check_dataset, check_model_family
from loom.data.preprocess import load_tokenizer_for, read_meta
from loom.data.tokenizer import build_tokenizer
from loom.errors import ConfigError
from loom.training.checkpoint_checks import check_checkpoints, megatron_at
from loom.training.distill import check_distillation, read_kd_cfg, teacher_checkpoint
from loom.training.resume import (check_saved_states, checkpoint_model_args, pretrained_source,
                                  reconcile_schedule)
from loom.training.script_checks import refuse_unimplemented, start_notes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every config flag and every other flag of Megatron-LM's command line (the flag table:
    :func:`loom.config.add_config_arguments`), plus ``--dry-run``."""
    add_config_arguments(parser)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the planner's memory and time prediction for these flags "
                             "and exit without training (no torchrun needed)")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="--dry-run: the number of GPUs to predict for (default: WORLD_SIZE "
                             "under torchrun, else t x p x c of the layout flags)")
    parser.add_argument("--gpu", default=None, metavar="NAME",
                        help="--dry-run: the GPU to predict for, e.g. H100-80GB (default: this "
                             "machine's CUDA device, else A100-80GB, and the output says so)")


def check_launcher_env() -> None:
    """Refuse ``WORLD_SIZE`` > 1 without the rest of a launcher's environment (``RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``): torch's rendezvous would fail with a traceback."""
    world = world_size_from_env()
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if world > 1 and missing:
        raise ConfigError(f"WORLD_SIZE={world} is set but {', '.join(missing)} not: start the "
                          f"ranks with torchrun --nproc-per-node {world} -m loom train ..., or "
                          f"unset WORLD_SIZE for one process")


def world_size_from_env() -> int:
    """``WORLD_SIZE`` (torchrun), 1 without it. Raises ConfigError for a malformed value."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(raw)
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={raw!r} in the environment is not an integer") from None
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={raw!r} in the environment must be >= 1")
    return world


def _check_data(cfg: LoomConfig) -> None:
    """Every dataset of every blend cross-checked; the training set non-empty."""
    from loom.models import get_family
    d, m = cfg.data, cfg.model
    wordpiece = get_family(m.model_type).wordpiece_data
    for flag, prefix in data_prefixes(d):
        check_dataset(prefix, m.vocab_size, flag=flag)
        check_model_family(prefix, m.model_type, wordpiece, flag=flag)
        if d.tokenizer_type:
            stored = read_meta(prefix).get("tokenizer_type")
            if stored and stored != d.tokenizer_type:
                raise ConfigError(f"--tokenizer-type {d.tokenizer_type}: {flag} {prefix} was "
                                  f"tokenized with {stored} ({prefix}.meta.json); the token ids "
                                  f"would mean other words. Give --tokenizer-type {stored} (or "
                                  f"drop the flag: loom reads the tokenizer stored with the data)")
    _check_tokenizer_files(cfg)
    if d.fim_data:  # the FIM tokens are ids of the data's tokenizer
        from loom.data.fim import fim_spec
        from loom.data.preprocess import load_tokenizer_for
        for flag, prefix in data_prefixes(d):
            fim_spec(d, load_tokenizer_for(prefix), f"{flag} {prefix}")
    train, _, _ = build_datasets(d, m.seq_length, cfg.training.seed)
    mbs = cfg.training.micro_batch_size
    if train is not None and len(train) < mbs:
        raise ConfigError(f"--micro-batch-size {mbs} is larger than the training data: "
                          f"{len(train)} samples of --seq-length {m.seq_length}; give at most "
                          f"--micro-batch-size {len(train)}, or more data")
    if train is None and not cfg.training.skip_train:
        raise ConfigError(f"--split {d.split} leaves no training documents of --data-path "
                          f"{d.data_path}: give the first (train) weight a positive share")


def _check_sft_data(cfg: LoomConfig) -> None:
    """``--sft``: every JSONL file read (loom.data.sft.read_conversations' refusals), the
    first training conversation tokenized, the training set non-empty."""
    from loom.data.sft import sft_datasets
    train, _, _ = sft_datasets(cfg.data, cfg.model.seq_length)
    if train is None and not cfg.training.skip_train:
        raise ConfigError(f"--split {cfg.data.split} leaves no training conversations of "
                          f"--data-path {cfg.data.data_path}: give the first (train) weight a "
                          f"positive share")
    if train is not None:
        train[0]


def _check_tokenizer_files(cfg: LoomConfig) -> None:
    """The tokenizer the flags name (``--tokenizer-model``, ``--vocab-file`` / ``--merge-file``,
    ``NullTokenizer``) against each dataset's stored one (``PREFIX.tokenizer.json``): a
    mismatch is refused (the ids would mean other words)."""
    d = cfg.data
    if not d.tokenizer_type or not (d.tokenizer_model or d.vocab_file or
                                    d.tokenizer_type == "NullTokenizer"):
        return
    vocab = cfg.model.vocab_size
    if d.tokenizer_type == "NullTokenizer" and vocab:
        vocab -= 1  # the end-of-document id V was added to the --vocab-size given
    given = build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file, d.tokenizer_model,
                            vocab if d.tokenizer_type in ("NullTokenizer", "TikTokenizer")
                            else None, tiktoken_pattern=d.tiktoken_pattern)
    for flag, prefix in data_prefixes(d):
        why = given.differs_from(load_tokenizer_for(prefix))
        if why:
            named = d.tokenizer_model or d.vocab_file or f"--vocab-size {vocab}"
            raise ConfigError(f"--tokenizer-type {d.tokenizer_type} {named}: not the tokenizer "
                              f"{flag} {prefix} was tokenized with ({prefix}.tokenizer.json: "
                              f"{why}); give that tokenizer's files, or drop the tokenizer "
                              f"flags (loom reads the one stored with the data)")


RUN_FIELDS = ("seq_length", "max_position_embeddings", "make_vocab_size_divisible_by")


def given_fields(args: argparse.Namespace) -> set[str]:
    """Config fields set on the command line or in the ``--config`` YAML."""
    given = {k for k, v in vars(args).items() if v is not None}
    if getattr(args, "config", None):
        given |= set(read_yaml_config(args.config,
                                      overrides=getattr(args, "torchtitan_set", None)))
    return given


def _stored_config(cfg: LoomConfig) -> Optional[tuple[str, dict]]:
    """(directory, stored flat config) of the ``--load`` checkpoint (``--ckpt-step``), its
    files checked; None without ``--load`` or when it holds no checkpoint yet."""
    ck = cfg.checkpoint
    if not ck.load:
        return None
    from loom.checkpoint.io import read_common
    found = megatron_at(ck.load, ck.ckpt_step)
    if found is not None:
        return found.path, read_common(found.path)["config"]
    ckpt = resolve_checkpoint(ck.load, ck.ckpt_step)
    if ckpt is None:
        return None
    check_checkpoint_files(ckpt)
    return ckpt, read_common(ckpt)["config"]


def model_from_checkpoint(cfg: LoomConfig, saved: dict, given: set[str]) -> dict:
    """``--load``: the flat values of every model field not given here (on the command line or
    in the YAML): the checkpoint's ``saved`` ones, merged into the flags before validation (an
    imported model's shape needs no flags, and its dropout, 0 for imported models, is kept).
    Given architecture flags are still checked against it (:func:`_check_same_model`); the
    sequence length and the vocabulary padding stay this run's (taken from the checkpoint only
    when not given at all). Without a vocabulary size and a dataset to read it from, V is the
    checkpoint's."""

    out = {f.name: saved[f.name] for f in dataclasses.fields(ModelConfig)
           if f.name in saved and f.name not in given and (
               f.name not in RUN_FIELDS or getattr(cfg.model, f.name) is None)}
    d = cfg.data
    if out.get("vocab_size", cfg.model.vocab_size) is None and not (d.data_path or
                                                                    d.train_data_path):
        out["vocab_size"] = int(saved["vocab_size"])
    return out


def resolve_vocab(cfg: LoomConfig) -> LoomConfig:
    """``cfg`` with V taken from the datasets' stored tokenizer (or the checkpoint) when not
    given: a new (unresolved) config, ``cfg`` itself when V is given.

    Raises ConfigError when it stays unknown, or when blended datasets disagree on it."""
    from loom.checkpoint.io import read_common
    vocab = cfg.model.vocab_size
    if vocab is None and not cfg.data.mock_data:
        vocab = blend_vocab_size(cfg.data)
    if vocab is None and cfg.checkpoint.load:
        found = megatron_at(cfg.checkpoint.load, None)
        ckpt = found.path if found else resolve_checkpoint(cfg.checkpoint.load, None)
        if ckpt:
            vocab = read_common(ckpt)["config"].get("vocab_size")
    if vocab is None:
        raise ConfigError("vocabulary size unknown: give --data-path PREFIX (preprocessed with "
                          "`loom preprocess`) or --mock-data --vocab-size V")
    if vocab == cfg.model.vocab_size:
        return cfg
    return LoomConfig.from_flat({**cfg.to_flat(), "vocab_size": vocab})


def prepare(args: argparse.Namespace) -> LoomConfig:
    """The resolved config of ``loom train ARGS``; every check that needs no process group.

    One path: flags or YAML -> flat values, the ``--load`` checkpoint's model fields (and, with
    ``--use-checkpoint-opt-param-scheduler``, its schedule) merged into them -> sections ->
    :meth:`LoomConfig.validate` with the family's own rules (:func:`loom.models.resolve_config`).
    Raises ConfigError naming the flag, key or file and the fix.
    """
    from loom.models import resolve_config  # torch: not at this module's import
    flags = config_from_args(args)
    no_effect = flags.megatron_no_effect  # said at start (start_notes), not an option of the run
    config_notes = flags.config_notes  # the same, of a torchtitan TOML
    world = dry_run_world(args, flags) if getattr(args, "dry_run", False) else \
        world_size_from_env()
    d = flags.data
    read_data_args(d)  # --data-args-path / --per-split-data-args-path: the paths they hold
    check_sft(d)  # before the data is read as an indexed dataset
    named = d.data_path or d.train_data_path or (flags.training.skip_train and (
        d.valid_data_path or d.test_data_path))
    if not d.mock_data and not named:
        raise ConfigError("no training data: give --data-path PREFIX (written by `loom "
                          "preprocess`) or --mock-data (random tokens, needs --vocab-size)")
    if d.mock_data and d.data_path:
        raise ConfigError("--mock-data and --data-path exclude each other: give one")
    if d.mock_data and flags.model.vocab_size is None and not flags.checkpoint.load:
        raise ConfigError("--mock-data needs --vocab-size V (random token ids 0..V-1)")
    flags = _pretrained(flags)
    newer = non_persistent.newer_source(flags.checkpoint)  # Megatron: the newer of the two
    if newer is not None:
        if os.environ.get("RANK", "0") == "0":
            print(f"loom train: --load {flags.checkpoint.load}: resuming the non-persistent "
                  f"checkpoint of iteration {newer[1]} in {newer[0]} (--load's latest: "
                  f"{newer[2]})", flush=True)
        flags = LoomConfig.from_flat({**flags.to_flat(), "load": newer[0]})
    if flags.data.tokenizer_type == "NullTokenizer" and flags.model.vocab_size:
        # Megatron's NullTokenizer: ids 0..V-1 and the end-of-document id V (V + 1 ids)
        flags = LoomConfig.from_flat({**flags.to_flat(),
                                      "vocab_size": flags.model.vocab_size + 1})
    flat, stored = flags.to_flat(), _stored_config(flags)
    rank0 = os.environ.get("RANK", "0") == "0"
    notes: list[str] = []  # said once every check has passed (a refusal stays one line)
    if stored is not None:
        taken = model_from_checkpoint(flags, stored[1], given_fields(args))
        would = dict(flat)  # what this command alone gives (V: the data's, when it names data)
        if would.get("vocab_size") is None and not flags.data.mock_data:
            would["vocab_size"] = blend_vocab_size(flags.data)
        said = _taken_flags({k: v for k, v in taken.items() if would.get(k) != v})
        if said:  # never silently: e.g. a LLaMA checkpoint under plain GPT flags
            notes.append(f"loom train: --load {flags.checkpoint.load}: the model flags not "
                         f"given here are the checkpoint's: {said}")
        flat.update(taken)
        if flags.training.use_checkpoint_args:
            if not stored[1]:
                raise ConfigError(f"--use-checkpoint-args: {stored[0]} holds no saved args (a "
                                  f"bare Megatron-Core checkpoint): give the model flags")
            flat.update(checkpoint_model_args(stored[1], given_fields(args),
                                              [f.name for f in dataclasses.fields(ModelConfig)]))
    elif flags.training.use_checkpoint_args:
        if not flags.checkpoint.load:
            raise ConfigError("--use-checkpoint-args needs --load or --pretrained-checkpoint: "
                              "the checkpoint to take the model's flags from")
        if rank0:  # Megatron's load_args_from_checkpoint: the flags as given
            print(f"loom train: --use-checkpoint-args: --load {flags.checkpoint.load} holds no "
                  f"checkpoint yet: the model's flags are this command's", flush=True)
    flags = resolve_vocab(LoomConfig.from_flat(flat))
    cfg = resolve_config(flags, world)  # with the family's own rules (its check hook)
    if named and not d.mock_data:
        _check_sft_data(cfg) if d.sft else _check_data(cfg)
    check_checkpoints(cfg, dry_run=bool(getattr(args, "dry_run", False)))
    if cfg.training.export_kd_teacher_load:  # the family's forward step: imports its model
        from loom.models import get_family
        check_distillation(cfg, get_family(cfg.model.model_type))
    else:
        check_distillation(cfg)
    if not getattr(args, "dry_run", False):
        refuse_unimplemented(cfg)
        if cfg.training.export_kd_teacher_load:  # files: a real run only
            teacher_checkpoint(cfg.training.export_kd_teacher_load)
            read_kd_cfg(cfg.training.export_kd_cfg)
        tracker = cfg.fault_tolerance.result_rejected_tracker_filename
        if tracker and not os.path.isdir(os.path.dirname(os.path.abspath(tracker))):
            raise ConfigError(f"--result-rejected-tracker-filename {tracker}: its directory "
                              f"does not exist (the file is appended to): create it or give "
                              f"another path")
    if stored is not None and stored[1] and cfg.checkpoint.moe_use_upcycling:
        from loom.checkpoint.upcycling import dense_counterpart  # a new run from dense weights
        from loom.models import get_family
        check_same_model(stored[1], dense_counterpart(
            cfg.model, cfg.checkpoint.moe_upcycling_granularity), stored[0],
            get_family(cfg.model.model_type))
    elif stored is not None and stored[1]:  # (a bare Megatron-Core checkpoint stores none)
        schedule = _check_same_model(cfg, *stored)
        if not megatron_at(stored[0], None):  # Megatron stores no loom data identities
            check_same_data(cfg, stored[0])  # the same datasets, --split and --seed
        if schedule:  # --use-checkpoint-opt-param-scheduler: merged the same way, validated
            cfg = resolve_config(LoomConfig.from_flat({**flags.to_flat(), **schedule}), world)
    cfg.megatron_no_effect = no_effect
    cfg.config_notes = config_notes
    for note in notes if rank0 else ():
        print(note, flush=True)
    return cfg


def _taken_flags(values: dict, shown: int = 8) -> str:
    """``--normalization RMSNorm, --swiglu, ...`` of flat model ``values`` (at most ``shown``,
    then a count of the rest); empty for none."""
    words = [flag_of(k) if v is True else f"{flag_of(k)} {v}" for k, v in sorted(values.items())]
    more = f" and {len(words) - shown} more" if len(words) > shown else ""
    return ", ".join(words[:shown]) + more


def _pretrained(cfg: LoomConfig) -> LoomConfig:
    """``--pretrained-checkpoint``: read it (fine-tuning, iteration 0) when ``--load`` holds no
    checkpoint (:func:`loom.training.resume.pretrained_source`); ``cfg`` itself otherwise."""
    ck = cfg.checkpoint
    if cfg.training.pretrained_checkpoint is None:
        return cfg
    load, finetune = pretrained_source(ck.load, cfg.training.pretrained_checkpoint,
                                       lambda d: megatron_at(d, None) is not None or
                                       resolve_checkpoint(d, None) is not None)
    if not finetune:
        return cfg
    if os.environ.get("RANK", "0") == "0":
        print(f"loom train: --load {ck.load} holds no checkpoint: fine-tuning from "
              f"--pretrained-checkpoint {load} (weights only, iteration 0)", flush=True)
    return LoomConfig.from_flat({**cfg.to_flat(), "load": load, "finetune": True,
                                 "ckpt_step": None})


def _check_same_model(cfg: LoomConfig, ckpt: str, saved: dict) -> dict:
    """Refuse a --load checkpoint ``ckpt`` (stored config ``saved``) of another architecture
    or learning-rate schedule (names each differing flag); returns the flat schedule values to
    take from it (:func:`loom.training.resume.reconcile_schedule`)."""
    from loom.models import get_family
    check_same_model(saved, cfg.model, ckpt, get_family(cfg.model.model_type))
    check_saved_states(saved, cfg, ckpt)  # --no-save-optim / --no-save-rng checkpoints
    return reconcile_schedule(saved, cfg, ckpt)


def dry_run_world(args: argparse.Namespace, cfg: LoomConfig) -> int:
    """GPUs a ``--dry-run`` predicts for: ``--world-size``, else torchrun's ``WORLD_SIZE``, else
    the layout's t x p x c (one data-parallel replica). Raises ConfigError for N < 1."""
    if args.world_size is not None:
        if args.world_size < 1:
            raise ConfigError(f"--world-size {args.world_size}: give 1 or more")
        return args.world_size
    if "WORLD_SIZE" in os.environ:
        return world_size_from_env()
    p = cfg.parallel
    return (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
            * p.context_parallel_size * (p.data_parallel_size or 1))


def padded_model(cfg: LoomConfig):
    """``cfg.model`` with the vocabulary the model is built with (``--padded-vocab-size``, else
    V padded to ``--make-vocab-size-divisible-by`` x t): what the headline parameter count of a
    dry run counts, as Megatron does (the embedding and output layer hold the padded rows)."""
    m = cfg.model
    if m.vocab_size is None and m.padded_vocab_size is None:
        return m
    tp = cfg.parallel.tensor_model_parallel_size
    return dataclasses.replace(m, vocab_size=m.padded_vocab(tp))


def run(args: argparse.Namespace) -> int:
    """Entry point of ``loom train``; returns the exit status."""
    if (args.world_size is not None or args.gpu) and not args.dry_run:
        raise ConfigError("--world-size and --gpu describe a --dry-run's cluster: add --dry-run "
                          "(a training run takes its size from torchrun)")
    cfg = prepare(args)
    if os.environ.get("RANK", "0") == "0":
        for line in start_notes(cfg, vars(args)):  # said once, never silently dropped
            print(f"loom train: {line}", flush=True)
    if args.dry_run:
        if os.environ.get("RANK", "0") != "0":
            return 0  # printed once, by rank 0
        from loom.planner.memory import total_params
        from loom.planner.predict import format_prediction, predict_layout
        pred = predict_layout(cfg, dry_run_world(args, cfg), cluster=args.gpu)
        assumed = "" if args.gpu else " (assumed: no --gpu given; pass --gpu NAME)"
        n = int(total_params(padded_model(cfg)))
        print(f"parameters: {n} ({n / 1e9:.2f} B)")
        print(format_prediction(pred) + f"\ndevice: {pred['cluster']}{assumed}")
        if cfg.model.vocab_size:  # exact per-rank counts of the real model (meta device)
            from loom.planner.meta_count import format_counts
            print(format_counts(cfg, dry_run_world(args, cfg)))
        return 0
    check_launcher_env()
    lock, rank0 = None, os.environ.get("RANK", "0") == "0"
    if cfg.checkpoint.save:  # one job per --save, held to the end (loom.checkpoint.lock)
        lock = lock_for_job(cfg.checkpoint.save, 0 if rank0 else 1,
                            lambda m: print(m, flush=True))
    try:
        if cfg.checkpoint.save and rank0:
            for path in remove_partial_checkpoints(cfg.checkpoint.save):
                print(f"loom train: removed the partial checkpoint {path} of an interrupted "
                      f"save", flush=True)
        from loom.training.trainer import Trainer
        trainer = _load_held(cfg, rank0, lambda: Trainer(cfg))
        trainer.train()
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        if lock is not None:
            lock.release()
    return 0


def _load_held(cfg: LoomConfig, rank0: bool, build):
    """``build()`` (the Trainer, which loads ``--load``) while rank 0 holds the checkpoint of
    another run's directory (``--load`` not ``--save``: that run may prune it meanwhile,
    :mod:`loom.checkpoint.holds`), until every rank has loaded."""
    ck = cfg.checkpoint
    if not ck.load or (ck.save and os.path.realpath(ck.load) == os.path.realpath(ck.save)):
        return build()  # this job's own directory: its lock keeps every other writer out
    hold = take_hold(ck.load, ck.ckpt_step)[1] if rank0 else None
    try:
        built = build()
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # every rank read its shards
        return built
    finally:
        if hold is not None:
            hold.release()
