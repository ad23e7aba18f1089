"""The checkpoint part of training: saves (:class:`~loom.checkpoint.saver.Saver`, synchronous
or ``--async-save``) and the resume from ``--load`` of one rank's model chunks, optimizer, LR
scheduler and RNG tracker (Megatron's ``save_checkpoint`` / ``load_checkpoint``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from loom.checkpoint import latest_checkpoint, load_checkpoint, read_common
from loom.checkpoint.model_match import check_same_model
from loom.checkpoint.saver import Saver
from loom.errors import ConfigError
from loom.parallel.mesh import ParallelMesh
from loom.training.optimizer import group_schedule, lr_at
from loom.training.resume import reconcile_schedule


@dataclass
class Resumed:
    """What a load restored: the checkpoint's directory, and the iteration and consumed samples
    the run continues from (None with ``--finetune``: the run keeps its own)."""
    path: str
    iteration: Optional[int]
    consumed_samples: Optional[int]


class Checkpointer:
    """Saves and loads of ``model_chunks``, ``optimizer``, ``scheduler`` and ``tracker`` on
    ``mesh`` under ``cfg`` (a LoomConfig: its ``checkpoint`` section, its ``training`` section
    for the LR schedule; ``world_size`` ranks) of a model of ``family`` (the ModelFamily whose
    shape facts a loaded checkpoint must share). ``saver`` is the :class:`Saver`."""

    def __init__(self, cfg, mesh: ParallelMesh, world_size: int, model_chunks: Sequence,
                 optimizer, scheduler, tracker, family):
        self.cfg, self.mesh, self.world_size, self.family = cfg, mesh, world_size, family
        self.model_chunks, self.optimizer, self.scheduler = model_chunks, optimizer, scheduler
        self.tracker = tracker
        self.saver = Saver(cfg, cfg.checkpoint.async_save)  # sync, or --async-save

    def save(self, save_dir: str, iteration: int, consumed_samples: int,
             tokenizer_file: Optional[str] = None,
             after_write: Optional[Callable[[], None]] = None) -> str:
        """Checkpoint the state at ``iteration`` (``consumed_samples`` samples trained on) to
        ``save_dir``; its final path. Collective over all ranks."""
        return self.saver.save(save_dir, iteration=iteration, consumed_samples=consumed_samples,
                               model_chunks=self.model_chunks, optimizer=self.optimizer,
                               scheduler=self.scheduler, mesh=self.mesh, tracker=self.tracker,
                               tokenizer_file=tokenizer_file, after_write=after_write)

    def load(self, load_dir: str) -> Optional[Resumed]:
        """Resume from ``load_dir`` (its latest checkpoint, or ``--ckpt-step``); None when it
        holds none. ``--finetune``: weights only, from iteration 0; ``--no-load-optim``: no Adam
        states and no LR-schedule state; ``--no-load-rng``: fresh generators. The LR schedule
        continues from the restored step with this run's ``--lr``. Raises ConfigError when the
        checkpoint is of another architecture."""
        ck, cfg = self.cfg.checkpoint, self.cfg
        weights_only = ck.finetune or ck.no_load_optim  # Megatron: no optimizer, no scheduler
        ckpt = latest_checkpoint(load_dir, ck.ckpt_step)
        if ckpt is not None:
            saved = read_common(ckpt)["config"]
            if saved:  # (a bare Megatron-Core checkpoint stores none: its shapes are checked)
                check_same_model(saved, cfg.model, ckpt, self.family)
            unmerged = {k: v for k, v in reconcile_schedule(saved, cfg, ckpt).items()
                        if getattr(cfg.training, k) != v}
            if unmerged:  # loom.training.cli.prepare merges them before validation
                raise ConfigError(f"--use-checkpoint-opt-param-scheduler: the checkpoint's "
                                  f"schedule {unmerged} was not merged into the config: build "
                                  f"it with loom.training.cli.prepare")
        common = load_checkpoint(load_dir, self.model_chunks,
                                 None if weights_only else self.optimizer,
                                 None if weights_only else self.scheduler, self.mesh,
                                 None if ck.finetune or ck.no_load_rng else self.tracker,
                                 step=ck.ckpt_step, model_cfg=cfg.model)
        if common is None:
            return None
        if weights_only and hasattr(self.optimizer, "copy_params_to_masters"):
            self.optimizer.copy_params_to_masters()  # fp32 masters from the loaded weights
        t, opt, sched = cfg.training, self.optimizer, self.scheduler
        peaks = [group_schedule(g, t) for g in opt.param_groups]  # --decoupled-lr: its own
        sched.base_lrs = [peak for peak, _ in peaks]
        lrs = [lr_at(sched.last_epoch, t, peak, low) for peak, low in peaks]
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = lrs
        if ck.finetune:  # the weights only, from iteration 0
            return Resumed(ckpt, None, None)
        return Resumed(ckpt, common["iteration"], common["consumed_samples"])
