"""Configuration sections of checkpointing and fault tolerance (flags as in
:mod:`loom.config.sections`: each field ``foo_bar`` is ``--foo-bar``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, Optional

from loom.config.fields import opt
from loom.errors import ConfigError


NonPersistentType = Literal["global", "local", "in_memory"]
"""Megatron's ``--non-persistent-ckpt-type`` choices (local and in_memory: refused rows)."""
ExitSignal = Literal[
    "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGTRAP", "SIGABRT", "SIGUSR1", "SIGUSR2",
    "SIGPIPE", "SIGALRM", "SIGSTKFLT", "SIGCHLD", "SIGCONT", "SIGTSTP", "SIGTTIN", "SIGTTOU",
    "SIGURG", "SIGXCPU", "SIGXFSZ", "SIGVTALRM", "SIGPROF", "SIGWINCH", "SIGIO", "SIGPWR",
    "SIGSYS", "SIGRTMIN", "SIGRTMAX"]
"""Megatron's ``--exit-signal`` choices (Python's ``signal.Signals`` names) that a handler can
catch; SIGKILL and SIGSTOP (never delivered to a handler) and the hardware-fault signals
SIGSEGV, SIGBUS, SIGFPE and SIGILL are refused by the flag table."""


@dataclass
class CheckpointConfig:
    """Where checkpoints are written and read, and when."""

    save: Optional[str] = opt(None, "directory to save checkpoints to (iter_NNNNNNN/ and "
                                    "latest_checkpointed_iteration.txt)")
    load: Optional[str] = opt(None, "directory to resume from (its latest checkpoint, or "
                                    "--ckpt-step)")
    save_interval: Optional[int] = opt(
        None, "iterations between checkpoints, or auto: Young/Daly's interval from the measured "
              "save time and --mtbf-hours-per-node / --mtbf-hours (default: only at the end)",
        ge=1, auto=True)
    ckpt_step: Optional[int] = opt(None, "load iteration N from --load instead of the one "
                                         "named by latest_checkpointed_iteration.txt", ge=0)
    overwrite_checkpoints: bool = opt(
        False, "allow --save to replace checkpoints newer than the start iteration")
    override_data_change: bool = opt(
        False, "on resume, accept a dataset, --split or --seed other than the checkpoint's "
               "(default: refused: the trained documents would move or the data order change)")
    mtbf_hours_per_node: Optional[float] = opt(
        None, "mean time between failures of one node, hours, for --save-interval auto (the "
              "job's MTBF is this / nodes)", gt=0)
    mtbf_hours: Optional[float] = opt(None, "mean time between failures of the whole job, hours, "
                                            "for --save-interval auto", gt=0)
    finetune: bool = opt(False, "load only the weights of --load and start at iteration 0 (no "
                                "optimizer, scheduler or RNG state; Megatron's fine-tuning)")
    no_load_optim: bool = opt(False, "do not load the optimizer (Adam) and LR-schedule states")
    moe_use_upcycling: bool = opt(
        False, "MoE upcycling: load --load's dense checkpoint into this MoE model (each expert "
               "a slice of the dense MLP, scaled; the router this model's own, its rows "
               "repeated: Megatron-Core's upcycling, arXiv 2410.07524), save it to --save at "
               "iteration 1 and train on; for the first run only (no optimizer or generator "
               "state is loaded)")
    moe_upcycling_granularity: int = opt(
        1, "with --moe-use-upcycling: G slices per dense MLP (its width is G x "
           "--ffn-hidden-size; 1: each expert a whole copy)", ge=1)
    no_load_rng: bool = opt(False, "do not load the random-generator states")
    no_save_optim: bool = opt(
        False, "save checkpoints without the optimizer (Adam) and LR-schedule states; a resume "
               "from them needs --no-load-optim or --finetune (recorded in the checkpoint's "
               "config, checked before the run starts)")
    no_save_rng: bool = opt(
        False, "save checkpoints without the random-generator states; a resume from them needs "
               "--no-load-rng or --finetune")
    exit_on_missing_checkpoint: bool = opt(
        False, "with --load: when it holds no checkpoint, exit with an error instead of "
               "starting from iteration 0")
    non_persistent_save_interval: Optional[int] = opt(
        None, "iterations between non-persistent checkpoints (with --non-persistent-ckpt-type "
              "global): only the newest is kept, in --non-persistent-global-ckpt-dir; 0: "
              "none)", ge=1, zero_is_off=True)
    non_persistent_ckpt_type: Optional[NonPersistentType] = opt(
        None, "global: non-persistent checkpoints in a directory of their own (loom.training."
              "non_persistent); a resume loads the newer of it and --load")
    non_persistent_global_ckpt_dir: Optional[str] = opt(
        None, "the directory of global non-persistent checkpoints (default: --save/"
              "non_persistent when saving, --load/non_persistent when loading)")
    keep_last: Optional[int] = opt(None, "keep only the newest N checkpoints in --save "
                                         "(default: keep all)", ge=1)
    save_retain_interval: Optional[int] = opt(
        None, "never prune the checkpoints of iterations divisible by N (a multiple of "
              "--save-interval): with --keep-last they stay beside the newest; alone, every "
              "other checkpoint but the latest is deleted as new ones are saved (Megatron's "
              "meaning)", ge=1)
    exit_interval: Optional[int] = opt(None, "save and exit cleanly after an iteration divisible "
                                             "by N (0: never, as Megatron reads it)", ge=1,
                                       zero_is_off=True)
    async_save: bool = opt(False, "write checkpoints in the background (torch.distributed."
                                  "checkpoint.async_save): training continues; the latest "
                                  "pointer moves once every rank's files are written")
    override_opt_param_scheduler: bool = opt(
        False, "on resume, take the learning-rate and weight-decay schedule from these flags "
               "even when they differ from the checkpoint's",
        aliases=("--override-opt_param-scheduler",))
    use_checkpoint_opt_param_scheduler: bool = opt(
        False, "on resume, take the learning-rate and weight-decay schedule from the "
               "checkpoint (ignoring --lr, --min-lr, --lr-warmup-iters/-fraction/-samples, "
               "--lr-decay-iters/-samples, --lr-decay-style, --lr-wsd-decay-*, --weight-decay, "
               "--start/end-weight-decay, --weight-decay-incr-style)")


@dataclass
class FaultToleranceConfig:
    """Failure drills and hang detection (loom/training/fault.py)."""

    inject_fault: Optional[str] = opt(
        None, "RANK:ITERATION:KIND: global rank RANK fails when it starts iteration ITERATION "
              "with KIND kill (SIGKILL), hang (stops making progress) or exception, or "
              "kill-in-save (SIGKILL in the middle of the checkpoint of ITERATION: its files "
              "written, before the rename), or stop (SIGSTOP: frozen, as under a debugger); once "
              "per job (not again after a torchrun restart)")
    hang_timeout_s: Optional[float] = opt(
        None, "seconds without progress after which a rank reports its iteration, phase and "
              "Python stacks and exits non-zero so torchrun can restart (default: no watchdog)",
        gt=0)
    distributed_timeout_minutes: float = opt(
        10.0, "timeout of collectives (torch.distributed's process-group timeout), minutes",
        gt=0)
    exit_signal_handler: bool = opt(
        False, "on SIGTERM or SIGINT (or --exit-signal's), finish the current iteration, save "
               "a checkpoint (with --save) and exit 0 (Megatron's meaning); without it a signal "
               "ends the rank at once with one line, status 128+signal, no save")
    exit_signal: ExitSignal = opt(
        "SIGTERM", "the signal --exit-signal-handler saves and exits on: SIGTERM (default) or "
                   "SIGINT: both of them; another (SIGUSR1, a scheduler's warning before the "
                   "end of a job): that one, and SIGTERM and SIGINT then end the rank at once")
    check_weight_hash_across_dp_replicas_interval: Optional[int] = opt(
        None, "every N iterations (and before the first) compare a SHA-1 of every weight across "
              "its data-parallel replicas and stop the run, naming the weights and ranks, if any "
              "differ (silent data corruption, a missed update); not with ZeRO-3 / FSDP, whose "
              "weights have no replicas (loom/training/weight_hash.py)", ge=1)
    # -- Megatron's rerun state machine (loom/training/rerun.py) ---------------------------------
    rerun_mode: Literal["disabled", "validate_results"] = opt(
        "validate_results", "validate_results: a rejected micro-batch loss (NaN, inf, a spike) "
        "reruns the iteration in place to tell a transient fault (not reproduced: exit 17, or "
        "continue for a non-fatal check) from a reproducible result (checkpoint with --save and "
        "exit 16); disabled: a NaN or inf loss stops the run (status 1)")
    error_injection_rate: int = opt(
        0, "inject a rejected result into about 1 in N loss validations (0: never)", ge=0)
    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = opt(
        "transient_error", "what an injected rejection behaves as: transient_error (the rerun "
        "differs), persistent_error or correct_result (the rerun reproduces it)")
    result_rejected_tracker_filename: Optional[str] = opt(
        None, "file to append a line to for every rejected result (Megatron's format)")
    check_for_spiky_loss: bool = opt(
        False, "reject a micro-batch loss >= 10x the largest of the first 100 (non-fatal: a "
               "transient spike continues)")
    check_for_large_grads: bool = opt(
        False, "reject a gradient bucket whose local norm before the data-parallel reduction is "
               ">= 10x the largest of its first 100 (non-fatal, as a spiky loss)")
    no_check_for_nan_in_loss_and_grad: bool = opt(
        False, "do not validate the micro-batch losses, nor each gradient bucket's local norm "
               "before the data-parallel reduction, for NaN and inf (a non-finite gradient norm "
               "still skips the step)")


def check_pruning(ck: CheckpointConfig) -> None:
    """``--keep-last`` / ``--save-retain-interval`` prune the checkpoints of ``--save``: refused
    without it (they would silently do nothing), and a retain interval that is not a multiple
    of ``--save-interval`` (Megatron asserts the same: no save would fall on it)."""
    for name, value in (("--keep-last", ck.keep_last),
                        ("--save-retain-interval", ck.save_retain_interval)):
        if value and not ck.save:
            raise ConfigError(f"{name} {value} prunes the checkpoints of --save, but no --save "
                              f"is given: add --save DIR or drop {name}")
    if ck.save_retain_interval and isinstance(ck.save_interval, int) and \
            ck.save_retain_interval % ck.save_interval:
        raise ConfigError(f"--save-retain-interval {ck.save_retain_interval} is not a multiple "
                          f"of --save-interval {ck.save_interval}: no checkpoint would be saved "
                          f"at its multiples; give a multiple of {ck.save_interval}")


def check_non_persistent(ck: CheckpointConfig) -> None:
    """``--non-persistent-save-interval`` needs ``--non-persistent-ckpt-type global`` (Megatron
    fails at the first such save without a type) and ``--save`` (Megatron saves nothing
    without it: refused here rather than silently); the directory must not be ``--save``
    itself, whose checkpoints its pruning would delete."""
    if ck.non_persistent_save_interval and ck.non_persistent_ckpt_type is None:
        raise ConfigError("--non-persistent-save-interval needs --non-persistent-ckpt-type "
                          "global (the kind of checkpoint to write): add it")
    if ck.non_persistent_save_interval and not ck.save:
        raise ConfigError("--non-persistent-save-interval saves beside --save "
                          "(--save/non_persistent), but no --save is given: add --save DIR")
    root = ck.non_persistent_global_ckpt_dir
    if root and ck.save and os.path.realpath(root) == os.path.realpath(ck.save):
        raise ConfigError(f"--non-persistent-global-ckpt-dir {root} is --save itself, whose "
                          f"checkpoints its pruning would delete: give a directory of its own")


def check_progress_log(cfg) -> None:
    """``--log-progress`` appends to ``progress.txt`` in ``--save`` (Megatron's
    ``append_to_progress_log``): refused without ``--save``, where it would write nothing."""
    if cfg.logging.log_progress and not cfg.checkpoint.save:
        raise ConfigError("--log-progress writes progress.txt into the --save directory, but no "
                          "--save is given: add --save DIR or drop --log-progress")


def check_upcycling(cfg: Any) -> None:
    """``--moe-use-upcycling``'s rules (Megatron-LM's, and what the dense model must be):
    an MoE model, ``--load`` (the dense checkpoint) and ``--save`` (the upcycled one), no
    ``--finetune``; the dense MLP ``G x --ffn-hidden-size`` wide splits into ``G`` expert
    widths, ``G`` divides the expert count, and with ``G > 1`` every layer is MoE (a dense
    layer of the MoE model would be narrower than the checkpoint's). Sets ``--no-load-optim``
    and ``--no-load-rng`` (Megatron's rule: the dense run's optimizer does not fit). Raises
    ConfigError naming the flag and the fix."""
    ck, m = cfg.checkpoint, cfg.model
    if not ck.moe_use_upcycling:
        return
    if not m.num_experts:
        raise ConfigError("--moe-use-upcycling needs --num-experts E: the MoE model the dense "
                          "checkpoint becomes")
    if not (ck.load and ck.save):
        raise ConfigError("--moe-use-upcycling needs --load DIR (the dense checkpoint) and "
                          "--save DIR (where the upcycled one is written; Megatron's rule)")
    if ck.finetune:
        raise ConfigError("--moe-use-upcycling with --finetune: upcycling starts at iteration 1 "
                          "from the dense weights already; drop --finetune")
    G, f, ffn = ck.moe_upcycling_granularity, m.moe_ffn_size, m.ffn_size
    dense = ffn * G
    if dense % f or m.num_experts % (dense // f):
        raise ConfigError(f"--moe-use-upcycling: the dense MLP (--ffn-hidden-size {ffn} x "
                          f"--moe-upcycling-granularity {G} = {dense}) must split into experts "
                          f"of --moe-ffn-hidden-size {f}, their number dividing --num-experts "
                          f"{m.num_experts}")
    if dense // f > 1 and not all(m.is_moe_layer(i) for i in range(m.num_layers)):
        raise ConfigError("--moe-use-upcycling with --moe-upcycling-granularity > 1 and dense "
                          "layers (--moe-layer-freq): those layers would be narrower than the "
                          "checkpoint's MLP; make every layer MoE or use granularity 1")
    ck.no_load_optim = ck.no_load_rng = True
