"""Resume means resume: the learning-rate schedule of a resumed run is the checkpoint's.

If the schedule these flags define (``--lr``, ``--min-lr``, the warm-up length: ``--lr-warmup-iters``
or ``--lr-warmup-fraction`` of the decay, ``--lr-decay-style``, where the decay ends:
``--lr-decay-iters``, default ``--train-iters``, WSD's ``--lr-wsd-decay-style`` and
``--lr-wsd-decay-iters``, and the weight decay: ``--weight-decay``, or with
``--weight-decay-incr-style`` linear / cosine ``--start-weight-decay``, ``--end-weight-decay``
and ``--train-iters``, where the increase ends: Megatron's ``OptimizerParamScheduler`` state
``max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style, start_wd, end_wd,
wd_incr_steps, wd_incr_style``) or the global batch (or its ramp: ``--rampup-batch-size``,
``--step-batch-size-schedule``) differs from the checkpoint's stored
config, the run is refused naming each difference (a longer ``--train-iters`` with the same
decay end, or a constant schedule, resumes while the weight decay is constant), unless
``--override-opt-param-scheduler`` (these flags win) or ``--use-checkpoint-opt-param-scheduler``
(the checkpoint's schedule wins; both also spelled ``--..-opt_param-scheduler``, Megatron's
names) is given, as in Megatron-LM
(``_check_and_set``). The checkpoint's schedule is merged into the flags before validation, by
the same path as the checkpoint's model fields (:func:`loom.training.cli.prepare`). A
checkpoint of another ``--optimizer`` is refused unless its states are not loaded
(``--no-load-optim``, ``--finetune``), and so is a checkpoint saved without optimizer or
generator states (``--no-save-optim``, ``--no-save-rng``: :func:`check_saved_states`) unless
they are not loaded. Torch-free.
"""

from __future__ import annotations

from typing import Any

from loom.errors import ConfigError

LR_KEYS = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_style")
WD_KEYS = ("weight_decay_incr_style", "start_weight_decay", "end_weight_decay")
FROM_CHECKPOINT = LR_KEYS + ("weight_decay",) + WD_KEYS + ("lr_wsd_decay_style",
                                                           "lr_wsd_decay_iters")
"""The flat fields of the schedule that ``--use-checkpoint-opt-param-scheduler`` takes from the
checkpoint (with the decay end, ``--lr-decay-iters``)."""
RESOLVED = ("lr_decay_iters", "weight_decay_incr_style")
"""Schedule keys compared even when a checkpoint's stored config lacks them (the decay end
defaults to ``--train-iters``; a checkpoint from before the weight-decay schedule had the
constant style)."""


def _schedule(values: dict) -> dict:
    """The parameters that define the learning rate and weight decay at every step: peak and
    minimum lr, warm-up iterations (``--lr-warmup-fraction`` x the decay iterations when given,
    as :func:`loom.training.param_schedule.warmup_iters` takes it), decay style and, unless the
    style is constant, where the decay ends (``--lr-decay-iters``, default ``--train-iters``);
    WSD's annealing style and length; the weight-decay increment style and either
    ``--weight-decay`` (constant) or the start and end weight decay and where the increase ends
    (``--train-iters``): Megatron's ``OptimizerParamScheduler`` state ``max_lr, min_lr,
    lr_warmup_steps, lr_decay_steps, lr_decay_style, start_wd, end_wd, wd_incr_steps,
    wd_incr_style`` and its WSD settings."""
    out = {k: values.get(k) for k in LR_KEYS}
    decay_end = values.get("lr_decay_iters") or values.get("train_iters")
    if values.get("lr_warmup_fraction") is not None and decay_end:
        out["lr_warmup_iters"] = int(values["lr_warmup_fraction"] * decay_end)
    if values.get("lr_decay_style") != "constant":
        out["lr_decay_iters"] = decay_end
    if values.get("lr_decay_style") == "WSD":
        out.update(lr_wsd_decay_style=values.get("lr_wsd_decay_style"),
                   lr_wsd_decay_iters=values.get("lr_wsd_decay_iters"))
    incr = values.get("weight_decay_incr_style") or "constant"
    out["weight_decay_incr_style"] = incr
    if incr == "constant":
        out["weight_decay"] = values.get("weight_decay")
    else:
        out.update(start_weight_decay=values.get("start_weight_decay"),
                   end_weight_decay=values.get("end_weight_decay"),
                   train_iters=values.get("train_iters"))
    return out


_HINTS = {"lr_decay_iters": " (--lr-decay-iters defaults to --train-iters)",
          "train_iters": " (the weight decay increases until --train-iters)"}


def schedule_differences(saved: dict, cfg: Any) -> list[str]:
    """``--flag saved vs requested`` for each schedule parameter (and the global batch) of the
    resolved ``cfg`` that differs from the checkpoint; the decay end is named
    ``--lr-decay-iters`` (which defaults to ``--train-iters``). A parameter only one side's
    style has (WSD's, the weight-decay range) is left to the style's own line."""
    t = cfg.training
    want = _schedule(dict(vars(t)))
    have = _schedule(saved)
    out = [f"--{k.replace('_', '-')} {have[k]} in the checkpoint, {want[k]} here"
           + _HINTS.get(k, "") for k in {**have, **want}
           if (k in saved or k in RESOLVED) and have.get(k) is not None
           and want.get(k) is not None and have[k] != want[k]]
    batch, here = saved.get("global_batch_size"), cfg.require_derived().global_batch_size
    if batch is not None and batch != here:
        out.append(f"--global-batch-size {batch} in the checkpoint, {here} here")
    for key in ("rampup_batch_size", "step_batch_size_schedule"):  # B by consumed samples
        if key in saved and saved[key] != getattr(t, key):
            out.append(f"--{key.replace('_', '-')} {saved[key]} in the checkpoint, "
                       f"{getattr(t, key)} here")
    return out


def check_saved_states(saved: dict, cfg: Any, ckpt_dir: str) -> None:
    """Refuse to resume from a checkpoint saved without the states this run would load: its
    stored config ``saved`` says ``--no-save-optim`` (no optimizer and no LR-schedule state)
    or ``--no-save-rng`` (no generators), and this run (``cfg``) neither gives
    ``--no-load-optim`` / ``--no-load-rng`` nor ``--finetune``. Megatron-LM exits in
    ``load_checkpoint`` naming the same flags; loom refuses before any process group starts,
    and never starts the optimizer fresh without being told. An evaluation-only run
    (``--skip-train``) loads neither. Raises ConfigError (one line)."""
    ck = cfg.checkpoint
    if cfg.training.skip_train or ck.finetune:
        return
    missing = [(what, flag) for what, flag, saved_without, told in (
        ("optimizer and LR-schedule state", "--no-load-optim", "no_save_optim",
         ck.no_load_optim),
        ("random-generator state", "--no-load-rng", "no_save_rng", ck.no_load_rng))
        if saved.get(saved_without) and not told]
    if missing:
        saved_with = " ".join(f.replace("load", "save") for _, f in missing)
        raise ConfigError(f"--load: the checkpoint {ckpt_dir} was saved with {saved_with} and "
                          f"holds no {' and no '.join(w for w, _ in missing)}: give "
                          f"{' '.join(f for _, f in missing)} to resume its weights and "
                          f"iteration without them, or --finetune (its weights only, from "
                          f"iteration 0)")


def _checkpoint_schedule(saved: dict, cfg: Any) -> dict:
    """The flat schedule values ``--use-checkpoint-opt-param-scheduler`` takes from the
    checkpoint's stored config ``saved`` (the warm-up and decay as iterations; the weight decay
    constant where the checkpoint predates its schedule). Raises ConfigError where loom cannot
    follow it: a weight decay increasing until another ``--train-iters`` than this run's."""
    sched = _schedule(saved)  # the warm-up as iterations, the decay end resolved
    out = {name: sched.get(name, saved[name]) for name in FROM_CHECKPOINT if name in saved}
    out["lr_decay_iters"] = saved.get("lr_decay_iters") or saved.get("train_iters")
    for name in WD_KEYS:
        out.setdefault(name, None)
    out["weight_decay_incr_style"] = out["weight_decay_incr_style"] or "constant"
    if out["weight_decay_incr_style"] != "constant" and \
            saved.get("train_iters") != cfg.training.train_iters:
        raise ConfigError(f"--use-checkpoint-opt-param-scheduler: the checkpoint's weight decay "
                          f"increases until iteration {saved.get('train_iters')} and loom's "
                          f"until --train-iters ({cfg.training.train_iters} here): give "
                          f"--train-iters {saved.get('train_iters')}, or "
                          f"--override-opt-param-scheduler to use these flags")
    # the checkpoint's warm-up and decay are iterations: drop the flags' other spellings
    out.update(lr_warmup_fraction=None, lr_warmup_samples=0, lr_decay_samples=None,
               lr_wsd_decay_samples=None)
    return out


def reconcile_schedule(saved: dict, cfg: Any, ckpt_dir: str) -> dict:
    """The flat values the resolved ``cfg`` must take from the checkpoint's stored config
    ``saved``: ``{}`` when the schedule is the same (or ``--override-opt-param-scheduler``, or
    it is not loaded), the checkpoint's schedule under ``--use-checkpoint-opt-param-scheduler``
    (the decay then ends where the checkpoint's did). They are merged into the flags before
    validation (:func:`loom.training.cli.prepare`), never set on a resolved config. Raises
    ConfigError naming the flags and both ways out for a changed schedule."""
    ck = cfg.checkpoint
    if cfg.training.skip_train or ck.finetune or ck.no_load_optim:
        return {}  # only evaluating, or the checkpoint's schedule is not loaded at all
    # a training checkpoint from before --optimizer: AdamW; a converted one (no training
    # section) holds no optimizer states
    have = saved.get("optimizer", "adam" if "lr" in saved else None)
    if have is not None and have != cfg.training.optimizer:
        raise ConfigError(f"--load: the checkpoint {ckpt_dir} holds --optimizer {have} states, "
                          f"this run uses --optimizer {cfg.training.optimizer}: give "
                          f"--optimizer {have}, or --no-load-optim to start the optimizer fresh")
    diff = schedule_differences(saved, cfg)
    if not diff or ck.override_opt_param_scheduler:
        return {}
    if ck.use_checkpoint_opt_param_scheduler:
        return _checkpoint_schedule(saved, cfg)
    raise ConfigError(f"--load: the learning-rate schedule differs from the checkpoint "
                      f"{ckpt_dir}: " + "; ".join(diff) + ". Give "
                      "--override-opt-param-scheduler to use these flags, or "
                      "--use-checkpoint-opt-param-scheduler to keep the checkpoint's schedule")


# -- Megatron's --pretrained-checkpoint and --use-checkpoint-args (training/checkpointing.py) --
SIZES_KEPT_WHEN_GIVEN = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length",
                         "num_attention_heads", "kv_channels", "max_position_embeddings")
"""``--use-checkpoint-args``: the sizes Megatron takes from the checkpoint only when not given
(``load_args_from_checkpoint``'s ``_set_arg`` without ``force``); every other architecture
flag is forced to the checkpoint's value."""


def pretrained_source(load: Any, pretrained: Any, holds_checkpoint) -> tuple[Any, bool]:
    """``(directory to load, finetune)`` under Megatron's rule: ``--pretrained-checkpoint`` is
    read (weights only, iteration 0: fine-tuning) when ``--load`` is absent or holds no
    checkpoint yet; otherwise ``--load`` resumes. ``holds_checkpoint(dir) -> bool``.

    Raises ConfigError when neither holds a checkpoint (Megatron's FileNotFoundError)."""
    if pretrained is None or (load and holds_checkpoint(load)):
        return load, False
    if not holds_checkpoint(pretrained):
        raise ConfigError(f"--pretrained-checkpoint {pretrained} holds no checkpoint (and "
                          f"--load {load} holds none either): give a directory written by "
                          f"`loom train --save` or `loom checkpoint convert`")
    return pretrained, True


def checkpoint_model_args(saved: dict, given: set, model_fields: list) -> dict:
    """``--use-checkpoint-args``: the flat model values to take from a checkpoint's stored
    config ``saved``: every architecture field, overriding the flags, except the sizes of
    :data:`SIZES_KEPT_WHEN_GIVEN` that were given (Megatron's ``load_args_from_checkpoint``)."""
    return {k: saved[k] for k in model_fields
            if k in saved and not (k in SIZES_KEPT_WHEN_GIVEN and k in given)}
