"""Resume means resume: the learning-rate schedule of a resumed run is the checkpoint's.

If ``--train-iters``, ``--lr``, ``--min-lr``, ``--lr-warmup-iters``, ``--lr-decay-iters``,
``--lr-decay-style`` or the global batch differ from the checkpoint's stored config, the run is
refused naming each difference, unless ``--override-opt-param-scheduler`` (these flags win) or
``--use-checkpoint-opt-param-scheduler`` (the checkpoint's schedule wins) is given, as in
Megatron-LM. Torch-free.
"""

from __future__ import annotations

from typing import Any

from loom.errors import ConfigError

SCHEDULE_FIELDS = ("train_iters", "lr", "min_lr", "lr_warmup_iters", "lr_decay_iters",
                   "lr_decay_style", "global_batch_size")
FROM_CHECKPOINT = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_style")


def schedule_differences(saved: dict, cfg: Any, world_size: int) -> list[str]:
    """``--flag saved vs requested`` for each schedule flag that differs from the checkpoint."""
    t = cfg.training
    out = []
    for name in SCHEDULE_FIELDS:
        if name not in saved:
            continue
        want = cfg.global_batch_size(world_size) if name == "global_batch_size" \
            else getattr(t, name)
        have = saved[name]
        if name == "global_batch_size" and have is None:
            continue  # older checkpoints stored None (= b x d of that run)
        if have != want:
            out.append(f"--{name.replace('_', '-')} {have} in the checkpoint, {want} here")
    return out


def reconcile_schedule(saved: dict, cfg: Any, world_size: int, ckpt_dir: str) -> None:
    """Refuse a changed schedule (ConfigError naming the flags and both ways out), or apply
    ``--use-checkpoint-opt-param-scheduler`` by copying the checkpoint's schedule into ``cfg``
    (the decay then ends where the checkpoint's did)."""
    ck = cfg.checkpoint
    diff = schedule_differences(saved, cfg, world_size)
    if not diff or ck.override_opt_param_scheduler:
        return
    if ck.use_checkpoint_opt_param_scheduler:
        for name in FROM_CHECKPOINT:
            if name in saved:
                setattr(cfg.training, name, saved[name])
        cfg.training.lr_decay_iters = saved.get("lr_decay_iters") or saved.get("train_iters")
        return
    raise ConfigError(f"--load: the learning-rate schedule differs from the checkpoint "
                      f"{ckpt_dir}: " + "; ".join(diff) + ". Give "
                      "--override-opt-param-scheduler to use these flags, or "
                      "--use-checkpoint-opt-param-scheduler to keep the checkpoint's schedule")
