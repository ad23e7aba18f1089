"""The checkpoint part of training: saves (:class:`~loom.checkpoint.saver.Saver`, synchronous
or ``--async-save``) and the resume from ``--load`` of one rank's model chunks, optimizer, LR
scheduler and RNG tracker (Megatron's ``save_checkpoint`` / ``load_checkpoint``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from loom.checkpoint import latest_checkpoint, load_checkpoint, read_common
from loom.checkpoint.model_match import check_same_model
from loom.checkpoint.saver import Saver
from loom.errors import ConfigError
from loom.parallel.mesh import ParallelMesh
from loom.training import non_persistent
from loom.training.checkpoint_checks import missing_checkpoint
from loom.training.resume import check_saved_states, reconcile_schedule


@dataclass
class Resumed:
    """What a load restored: the checkpoint's directory, and the iteration and consumed samples
    the run continues from (None with ``--finetune``: the run keeps its own); the layout it
    was saved at (``{tp, pp, dp, ...}``, None if unknown) and whether the optimizer (Adam
    states and LR schedule) and the generators came back."""
    path: str
    iteration: Optional[int]
    consumed_samples: Optional[int]
    saved_layout: Optional[dict] = None
    optimizer: bool = False
    rng: bool = False


class Checkpointer:
    """Saves and loads of ``model_chunks``, ``optimizer``, ``scheduler`` and ``tracker`` on
    ``mesh`` under ``cfg`` (a LoomConfig: its ``checkpoint`` section, its ``training`` section
    for the LR schedule; ``world_size`` ranks) of a model of ``family`` (the ModelFamily whose
    shape facts a loaded checkpoint must share). ``saver`` is the :class:`Saver`; ``progress``
    the ``--log-progress`` :class:`~loom.training.progress_log.ProgressLog` (None without),
    which each save appends a line to."""

    def __init__(self, cfg, mesh: ParallelMesh, world_size: int, model_chunks: Sequence,
                 optimizer, scheduler, tracker, family):
        self.cfg, self.mesh, self.world_size, self.family = cfg, mesh, world_size, family
        self.model_chunks, self.optimizer, self.scheduler = model_chunks, optimizer, scheduler
        self.tracker = tracker
        self.saver = Saver(cfg, cfg.checkpoint.async_save)  # sync, or --async-save
        self.progress = None  # --log-progress: set by loom.training.builder
        self.non_persistent_dir = non_persistent.non_persistent_dir(cfg.checkpoint,
                                                                    cfg.checkpoint.save)

    def non_persistent_due(self, iteration: int) -> bool:
        """Whether ``iteration`` saves a non-persistent checkpoint into
        :attr:`non_persistent_dir` when no regular one is due
        (:mod:`loom.training.non_persistent`)."""
        return non_persistent.due(self.cfg.checkpoint, iteration)

    def save(self, save_dir: str, iteration: int, consumed_samples: int,
             tokenizer_file: Optional[str] = None,
             after_write: Optional[Callable[[], None]] = None) -> str:
        """Checkpoint the state at ``iteration`` (``consumed_samples`` samples trained on) to
        ``save_dir``; its final path (and, with ``--log-progress``, a line in
        ``progress.txt``). Collective over all ranks."""
        final = self.saver.save(save_dir, iteration=iteration, consumed_samples=consumed_samples,
                                model_chunks=self.model_chunks, optimizer=self.optimizer,
                                scheduler=self.scheduler, mesh=self.mesh, tracker=self.tracker,
                                tokenizer_file=tokenizer_file, after_write=after_write)
        if self.progress is not None:  # Megatron's save_checkpoint_and_time
            self.progress.saved(iteration, consumed_samples, self.saver.pending is not None)
        return final

    def _refuse_nonfinite(self, ckpt: str, load_dir: str) -> None:
        """Refuse loaded weights holding a NaN or inf on any rank (a checkpoint saved after the
        weights diverged, or damaged before its manifest was written): training on it would
        only skip steps, and the log would name it the last good checkpoint. Collective."""
        import torch
        import torch.distributed as dist

        from loom.checkpoint.safety import last_checkpoint_before
        from loom.parallel.registry import named_parameters
        def local(p):  # ZeRO-3: this rank's rows of a DTensor
            t = p.detach()
            return t.to_local() if hasattr(t, "to_local") else t
        bad = next((n for n, p, _ in named_parameters(self.model_chunks)
                    if not bool(torch.isfinite(local(p)).all())), None)
        flag = torch.tensor([0.0 if bad is None else 1.0], device=self.mesh.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        it = int(os.path.basename(os.path.normpath(ckpt)).split("_")[1])
        before = last_checkpoint_before(load_dir, it)
        fix = f"give --ckpt-step {before} to resume the one before it" if before is not None \
            else "no earlier checkpoint is there to resume instead"
        where = f"parameter {bad}" if bad is not None else "on another rank"
        raise ConfigError(f"checkpoint {ckpt} holds non-finite weights (NaN or inf; {where}): "
                          f"training on it would skip every step; {fix}")

    def load(self, load_dir: str) -> Optional[Resumed]:
        """Resume from ``load_dir`` (its latest checkpoint, or ``--ckpt-step``); None when it
        holds none. ``--finetune``: weights only, from iteration 0; ``--no-load-optim``: no Adam
        states and no LR-schedule state; ``--no-load-rng``: fresh generators. The LR schedule
        continues from the restored step with this run's ``--lr``. Raises ConfigError when the
        checkpoint is of another architecture, lacks the states this run loads
        (``--no-save-optim``, ``--no-save-rng``), or is missing under
        ``--exit-on-missing-checkpoint``."""
        ck, cfg = self.cfg.checkpoint, self.cfg
        if ck.moe_use_upcycling:
            return self._upcycle(load_dir)
        weights_only = ck.finetune or ck.no_load_optim  # Megatron: no optimizer, no scheduler
        ckpt = latest_checkpoint(load_dir, ck.ckpt_step)
        if ckpt is not None:
            saved = read_common(ckpt)["config"]
            if saved:  # (a bare Megatron-Core checkpoint stores none: its shapes are checked)
                check_same_model(saved, cfg.model, ckpt, self.family)
                check_saved_states(saved, cfg, ckpt)
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
            if ck.exit_on_missing_checkpoint:  # (loom train refused it before starting)
                raise ConfigError(missing_checkpoint(load_dir))
            return None
        self._refuse_nonfinite(common["checkpoint_dir"], load_dir)
        if weights_only and hasattr(self.optimizer, "copy_params_to_masters"):
            self.optimizer.copy_params_to_masters()  # fp32 masters from the loaded weights
        if not ck.finetune:  # a schedule counting samples goes on from the checkpoint's
            self.scheduler.anchor(common["iteration"], common["consumed_samples"])
        self.scheduler.resync()  # this run's peaks; lr and weight decay at the iteration
        states = dict(saved_layout=common.get("saved_layout"),
                      optimizer=common.get("optimizer_restored", False),
                      rng=common.get("rng_restored", False))
        if ck.finetune:  # the weights only, from iteration 0
            return Resumed(ckpt, None, None, **states)
        return Resumed(ckpt, common["iteration"], common["consumed_samples"], **states)

    def _upcycle(self, load_dir: str) -> Resumed:
        """``--moe-use-upcycling``: this MoE model's weights from the dense checkpoint of
        ``load_dir`` (:mod:`loom.checkpoint.upcycling`), saved to ``--save`` at iteration 1 with
        no sample consumed, as Megatron-LM's ``setup_model_and_optimizer`` does; the run goes
        on from there. The dense checkpoint must be this model with every MoE layer's MLP
        ``G x --ffn-hidden-size`` wide (checked as a resume checks its model). Collective."""
        import torch

        from loom.checkpoint.reader import _named_params, open_checkpoint
        from loom.checkpoint.upcycling import dense_counterpart, upcycle
        from loom.parallel.fsdp import shard_like
        from loom.parallel.registry import local_shard
        cfg, ck = self.cfg, self.cfg.checkpoint
        m = cfg.model
        dense_cfg = dense_counterpart(m, ck.moe_upcycling_granularity)
        ckpt = latest_checkpoint(load_dir, ck.ckpt_step)
        saved = read_common(ckpt)["config"]
        if saved:
            check_same_model(saved, dense_cfg, ckpt, self.family)
        params = _named_params(self.model_chunks)
        index = open_checkpoint(ckpt, dense_cfg)
        dense, _, _ = index.load(index.names)
        granularity = dense_cfg.ffn_size // m.moe_ffn_size

        def whole(p):  # a router is replicated; under ZeRO-3 its DTensor's full value
            t = p.detach()
            return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
        with torch.no_grad():
            routers = {n: whole(p) for n, (p, _) in params.items() if n.endswith("router.weight")}
            full = upcycle(dense, list(params), routers, m, granularity)
            for name, (p, meta) in params.items():
                if name in full:
                    p.copy_(shard_like(p, local_shard(full[name], meta,
                                                      *self.mesh.shard_of(meta), name)))
        if hasattr(self.optimizer, "copy_params_to_masters"):
            self.optimizer.copy_params_to_masters()  # fp32 masters from the upcycled weights
        self.scheduler.anchor(1, 0)
        self.scheduler.resync()
        self.save(ck.save, iteration=1, consumed_samples=0)
        return Resumed(ckpt, 1, 0)
