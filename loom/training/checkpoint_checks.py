"""``loom train``'s checkpoint directories, checked before any process group starts
(:func:`check_checkpoints`): ``--load`` resolved (a fresh start said in one line, a likely
typo refused), its files checked, ``--save`` probed; nothing the run loaded is rewritten
unless the run continues it."""

from __future__ import annotations

import os
from typing import Optional

from loom.errors import ConfigError


def megatron_at(load: str, step: Optional[int]):
    """The Megatron-LM checkpoint ``--load`` names (:func:`loom.checkpoint.megatron.locate.
    locate`), or None for loom's own (or none)."""
    from loom.checkpoint.megatron.locate import locate
    return locate(load, step)


def megatron_start(found, ck) -> int:
    """The iteration a Megatron checkpoint resumes at; refuses (one line) a checkpoint whose
    optimizer state loom cannot take unless ``--no-load-optim`` (see
    :func:`loom.checkpoint.megatron.common.optimizer_refusal`)."""
    from loom.checkpoint.megatron.common import optimizer_refusal, read_common
    if not ck.no_load_optim:
        why = optimizer_refusal(found)
        if why:
            raise ConfigError(why)
    return int(read_common(found)["iteration"])


def missing_checkpoint(load: str) -> str:
    """The one-line refusal of ``--exit-on-missing-checkpoint`` when ``--load`` holds no
    checkpoint (Megatron-LM's ``load_checkpoint`` exits there instead of starting from random
    weights)."""
    return (f"--load {load} holds no checkpoint and --exit-on-missing-checkpoint is given: "
            f"exiting instead of starting from iteration 0 (check the path, or drop "
            f"--exit-on-missing-checkpoint to start fresh)")


def check_upcycling_dirs(ck, ckpt: Optional[str]) -> int:
    """``--moe-use-upcycling``'s directories: ``--load`` holds the dense checkpoint, ``--save``
    none yet (Megatron-LM's assertion: upcycling is the first run, its later runs resume without
    the flag); returns the start iteration, 1 (Megatron's)."""
    from loom.checkpoint.safety import saved_iterations
    if ckpt is None:
        raise ConfigError(f"--moe-use-upcycling: --load {ck.load} holds no checkpoint: nothing to "
                          f"upcycle (give the dense model's checkpoint directory)")
    held = saved_iterations(ck.save)
    if held:
        raise ConfigError(f"--moe-use-upcycling: --save {ck.save} already holds checkpoints "
                          f"(iterations {', '.join(map(str, held))}): upcycling is for the first "
                          f"run only; drop --moe-use-upcycling (and give --load {ck.save}) to "
                          f"resume the upcycled run, or give a fresh --save")
    return 1


def check_checkpoints(cfg, dry_run: bool = False) -> int:
    """Resolve ``--load`` and check ``--save`` of ``cfg`` (a resolved LoomConfig); returns the
    start iteration. ``dry_run``: the
    ``--save`` of the predicted cluster is not this machine's disk, so it is not probed (no
    write test, no free-space check, nothing created). ``--exit-on-missing-checkpoint``: a
    ``--load`` holding no checkpoint is refused (:func:`missing_checkpoint`).

    A run never writes into the checkpoints it loaded unless it continues them: ``--finetune``
    starts at iteration 0, so a ``--save`` that holds checkpoints (its own ``--load``'s, or
    another run's) is refused unless ``--overwrite-checkpoints``. A ``--train-iters`` below the
    loaded iteration (nothing to train) is refused."""
    from loom.checkpoint.safety import (check_checkpoint_files, check_fresh_load, check_save_dir,
                                        integrity_note, resolve_checkpoint, saved_iterations)
    from loom.planner.memory import total_params
    ck, rank0 = cfg.checkpoint, os.environ.get("RANK", "0") == "0"
    start, ckpt = 0, None
    if ck.load:
        found = megatron_at(ck.load, ck.ckpt_step)  # a Megatron-LM checkpoint: its own reader
        ckpt = found.path if found else resolve_checkpoint(ck.load, ck.ckpt_step)
        if ck.moe_use_upcycling:
            if found is None and ckpt is not None:
                check_checkpoint_files(ckpt)
            start = check_upcycling_dirs(ck, ckpt)
        elif found is not None:
            start = 0 if ck.finetune else megatron_start(found, ck)
        elif ckpt is not None:
            check_checkpoint_files(ckpt)
            note = integrity_note(ckpt)
            if note and rank0:
                print(f"loom train: {note}", flush=True)
            start = 0 if ck.finetune else int(os.path.basename(ckpt).split("_")[1])
        else:  # a wrong path is refused; a fresh start is said, never silent
            check_fresh_load(ck.load, ck.save)
            if ck.exit_on_missing_checkpoint:
                raise ConfigError(missing_checkpoint(ck.load))
        if ckpt is None and rank0:
            print(f"loom train: --load {ck.load} holds no checkpoint yet: starting from "
                  f"iteration 0", flush=True)
    iters = cfg.training.train_iters
    if ckpt is not None and not cfg.training.skip_train and iters is not None and start > iters:
        raise ConfigError(f"--train-iters {iters} is below iteration {start} of the checkpoint "
                          f"{ckpt} that --load {ck.load} resumes: nothing would be trained; "
                          f"give --train-iters above {start}, --ckpt-step N to resume an "
                          f"earlier checkpoint, or --finetune to start a new run from its "
                          f"weights")
    held = saved_iterations(ck.save) if ck.save else []
    if ck.finetune and ckpt is not None and held and not ck.overwrite_checkpoints:
        raise ConfigError(f"--save {ck.save} already holds checkpoints (iterations "
                          f"{', '.join(map(str, held))}) and --finetune starts at iteration 0 "
                          f"from the weights of {ckpt}: its saves would replace them and move "
                          f"the pointer back. Give a fresh --save directory (to restart a "
                          f"fine-tune with one command line: --pretrained-checkpoint "
                          f"{ck.load} --load DIR --save DIR), or --overwrite-checkpoints to "
                          f"replace them")
    if ck.save and not dry_run:
        weights_and_adam = 12  # bytes per parameter: fp32 weight + two fp32 Adam moments
        same = bool(ck.load) and os.path.realpath(ck.load) == os.path.realpath(ck.save)
        check_save_dir(ck.save, start, ck.overwrite_checkpoints,
                       int(weights_and_adam * total_params(cfg.model)),
                       resumed_from_pointer=same and ckpt is not None and ck.ckpt_step is None
                       and not ck.finetune)
    return start
