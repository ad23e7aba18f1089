"""The training loop: data -> forward/backward schedule -> DP gradient reduction -> clipping ->
AdamW -> LR schedule -> metrics -> evaluation -> checkpoint.

:class:`Trainer` takes a validated :class:`~loom.config.LoomConfig` and runs the loop over the
parts :func:`loom.training.builder.build_training` assembles (mesh, model, gradient buffers,
optimizer, schedules, data, checkpointer, fault handling, throughput); its attributes
(``model_chunks``, ``optimizer``, ``reducers``, ``train_ds``, ...) are those parts. Without an
explicit mesh it initializes ``torch.distributed`` from torchrun's environment; tests inject
``ParallelMesh.single()`` to get the single-process reference of the very same code.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from loom.config import LoomConfig
from loom.errors import NonFiniteError, RerunExit
from loom.models.family import ModelFamily
from loom.parallel.mesh import ParallelMesh
from loom.parallel.pipeline.zero_bubble import loss_stage
from loom.training.builder import TrainingParts, build_training
from loom.training.metrics import MetricsLogger
from loom.training.setup import held_numel, owned_parameters
from loom.training.step import finish_gradients, finish_param_gather, optimizer_step
from loom.training.story import (prediction_line, resume_line, resume_record, run_summary,
                                 summary_line)
from loom.training.validation import Evaluator


def _part(path: str, doc: str) -> property:
    """A read-only attribute of the trainer that is the part at ``path`` (dotted) of
    ``self.parts``."""
    names = path.split(".")

    def get(self):
        obj = self.parts
        for n in names:
            obj = getattr(obj, n)
        return obj
    return property(get, doc=doc)


class Trainer:
    """One rank's training loop over the parts :func:`~loom.training.builder.build_training`
    assembles: model chunks of ``family`` (default ``--model-type``'s) under ``cfg``'s layout.
    ``mesh`` None initializes ``torch.distributed`` from torchrun's environment. ``parts``
    (already built) replaces the build. With ``--load`` the latest checkpoint is loaded."""

    mesh = _part("mesh", "the ParallelMesh")
    tracker = _part("model.tracker", "the RNG tracker (model-parallel streams)")
    model_chunks = _part("model.chunks", "this rank's model chunks")
    registry = _part("model.registry", "name -> ParamMeta of every chunk's parameters")
    params = _part("model.groups.params", "this rank's trainable parameters")
    sp_params = _part("model.groups.sp_params", "parameters whose gradients sum over TP")
    reducers = _part("reducers", "one gradient buffer per chunk")
    optimizer = _part("optimizer", "AdamW or the distributed optimizer")
    scheduler = _part("scheduler", "the LR schedule")
    timeline = _part("timeline", "the --timeline recorder")
    train_ds = _part("data.train_ds", "the training set")
    global_batch = _part("data.global_batch", "samples per iteration (B)")
    saver = _part("checkpointer.saver", "the checkpoint Saver (sync or --async-save)")
    debug = _part("debug", "timers, --profile, --record-memory-history (training/debug.py)")
    rerun = _part("rerun", "Megatron's rerun state machine, --rerun-mode (training/rerun.py)")

    def __init__(self, cfg: LoomConfig, mesh: Optional[ParallelMesh] = None,
                 family: Optional[ModelFamily] = None, parts: Optional[TrainingParts] = None):
        cfg.require_derived()  # only a resolved config (cfg.validate(world) returns one)
        self.cfg = cfg
        self.parts = parts if parts is not None else build_training(cfg, mesh, family)
        self.last_stats = None  # PipelineStats of the latest schedule run
        self.last_metrics: dict = {}
        self.iteration = 0
        self.consumed_samples = 0
        self.nonfinite: list[int] = []  # consecutive iterations skipped for a NaN/inf norm
        self.history: list[dict] = []
        self.evaluations: list[dict] = []  # {"kind": "valid" | "test", "valid_loss", ...}
        self.loaded_from: Optional[str] = None  # the checkpoint this run resumed from
        self.resumed: Optional[dict] = None  # what it restored (story.resume_record)
        self.last_saved: Optional[str] = None  # the latest checkpoint this run wrote
        self.max_attention_logit: Optional[float] = None  # of the latest step, all ranks
        self.evaluator = Evaluator(cfg, self.parts, self.global_loss, self._all_reduce,
                                   self.owns_loss)  # when and on what (training/validation.py)
        self.skips = self.parts.skips  # --iterations-to-skip
        if cfg.checkpoint.load:
            self.load(cfg.checkpoint.load)

    # -- data ------------------------------------------------------------------------------------
    def batches(self, dataset, consumed: int, evaluation: bool = False) -> list[dict]:
        """This DP rank's micro-batches of the global batch starting at sample ``consumed``
        (:meth:`~loom.training.batches.BatchSource.batches`; ``evaluation``: of an evaluation
        iteration, ``--eval-global-batch-size`` samples)."""
        return self.parts.data.batches(dataset, consumed, evaluation)

    def p2p_shape(self, batches: list[dict]) -> tuple[int, int, int]:
        """``[s, b, h]`` exchanged between pipeline stages."""
        return self.parts.data.p2p_shape(batches)

    # -- one step ----------------------------------------------------------------------------------
    def forward_backward(self, batches: list[dict], losses: Optional[list] = None
                         ) -> torch.Tensor:
        """Gradients of the global batch's mean loss, reduced over DP; returns this rank's loss
        (the loss stage's mean over its micro-batches, 0 on other stages). ``losses``: a list
        each micro-batch loss of this rank is appended to."""
        timers = self.debug.timers
        step = self.parts.model.forward_step
        if losses is not None:
            step = self.rerun.recording(step, losses)
        with timers("forward-backward"):
            result = self.parts.schedule(
                self.model_chunks, batches, step, self.mesh,
                p2p_shape=self.p2p_shape(batches), reducers=self.reducers,
                recorder=timers.recorder(self.timeline))
            # DP, then SP over TP and the tied embedding over its group
            finish_gradients(self.reducers, self.model_chunks, self.mesh, self.sp_params, timers)
        self.last_stats, self.last_metrics = result.stats, result.metrics
        return result.loss

    def _any(self, flags) -> list:
        """Each flag true on any rank (one all-reduce)."""
        return [v > 0 for v in self._all_reduce([float(f) for f in flags], dist.ReduceOp.MAX)]

    def validated_forward_backward(self, batches: list[dict]) -> torch.Tensor:
        """:meth:`forward_backward` under Megatron's rerun state machine (``--rerun-mode``,
        :mod:`loom.training.rerun`): each micro-batch loss and each gradient bucket's norm
        before its DP reduction validated, the iteration rerun from the same state when a rank
        rejected one. Raises RerunExit (16 / 17) when the attribution ends the run,
        NonFiniteError for a NaN / inf result under ``--rerun-mode disabled``."""
        ft, rerun, losses = self.cfg.fault_tolerance, self.rerun, []
        checks = not ft.no_check_for_nan_in_loss_and_grad, ft.check_for_spiky_loss
        loss = None
        while rerun.should_run(self.iteration + 1, self._any):
            losses.clear()
            loss = self.forward_backward(batches, losses if any(checks) else None)
            stop = rerun.validate_losses([float(v) for v in losses], *checks)
            stop = rerun.validate_grads() or stop  # the buckets' norms before the DP reduction
            if rerun.mode == "disabled" and (any(checks) or any(rerun.grad_checks)) and \
                    self._any([stop is not None])[0]:
                raise NonFiniteError(f"iteration {self.iteration + 1}: "
                                     f"{stop or 'a rejected result on another rank'} "
                                     f"(--rerun-mode disabled stops here)")
        checkpoint, stop, code = rerun.should_checkpoint_and_exit()
        if stop:
            raise RerunExit(rerun.exit_message(code), code, checkpoint)
        return loss

    def optimizer_step(self) -> float:
        """Unscale, clip, AdamW, LR schedule, non-finite guard
        (:func:`loom.training.step.optimizer_step`); returns the pre-clip grad norm."""
        t = self.cfg.training
        with self.debug.timers("optimizer"):
            norm = optimizer_step(self.optimizer, self.scheduler, self.reducers,
                                  self.parts.model.groups, self.mesh, t.clip_grad,
                                  self.parts.model.scaler,
                                  self.nonfinite, self.iteration, t.exit_on_nonfinite,
                                  self.debug.timers)
            if self.parts.qk_clip is not None:  # Megatron: in the optimizer's time too
                (self.max_attention_logit,) = self._all_reduce([self.parts.qk_clip()],
                                                               dist.ReduceOp.MAX)
        self.parts.after_step()  # MoE: the aux-loss-free expert bias from the global load
        return norm

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """Reduce a few host scalars over every rank in one collective (identity on 1 rank)."""
        if not dist.is_initialized() or self.parts.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.mesh.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _owned_loss(self, local: torch.Tensor) -> float:
        """This rank's share of the global mean loss: the loss stage's TP rank 0 of each DP x CP
        replica contributes its loss / (d c) (each holds an equal share of the tokens)."""
        m = self.mesh
        return float(local) / (m.dp_size * m.sizes["cp"]) if self.owns_loss else 0.0

    @property
    def owns_loss(self) -> bool:
        """Whether this rank reports the loss: TP rank 0 of the stage holding the last virtual
        stage (the last stage; stage 0 under ZB-V's V layout)."""
        m = self.mesh
        return m.pp_rank == loss_stage(self.cfg.parallel.pipeline_schedule, m.pp_size) \
            and m.tp_rank == 0

    def global_loss(self, local: torch.Tensor) -> float:
        """Mean loss over DP and CP ranks, taken from the last pipeline stage."""
        if not dist.is_initialized() or self.parts.world_size == 1:
            return float(local)
        return self._all_reduce([self._owned_loss(local)])[0]

    def write_timeline(self) -> None:
        """Each rank writes ``PATH.rank{N}.json``; rank 0 merges them into ``PATH``."""
        many = dist.is_initialized() and self.parts.world_size > 1
        self.timeline.write(self.cfg.logging.timeline, stage=self.mesh.pp_rank,
                            barrier=dist.barrier if many else None)

    def train_step(self) -> dict:
        """One iteration: forward/backward of the next global batch, the optimizer step; returns
        its record (loss averaged over DP x CP, lr, grad norm, throughput, memory)."""
        lr = self.optimizer.param_groups[0]["lr"]
        size = self.batch_size()
        start = time.perf_counter()
        with self.debug.batch_timer():
            batches = self.batches(self.train_ds, self.data_position())
        loss = self.validated_forward_backward(batches)
        stats = {}
        if self.cfg.training.decoupled_lr is not None:  # its own group, the last (Megatron's)
            stats["decoupled_lr"] = self.optimizer.param_groups[-1]["lr"]
        if self.cfg.training.log_num_zeros_in_grad:  # before the step zeroes them (collective)
            from loom.training.param_stats import grad_zeros
            with self.debug.timers("optimizer-count-zeros"):
                stats["num_zeros_in_grad"] = grad_zeros(self.optimizer, self.parts.model.groups,
                                                        self.mesh)
        with self.timeline.span("optimizer"):
            norm = self.optimizer_step()
        if self.mesh.device.type == "cuda":  # this step's compute stream, not the device: an
            # --overlap-param-gather all-gather still running on the communication stream
            # belongs to the next forward, which its pre-hooks make wait (a device-wide
            # synchronize would expose it here)
            torch.cuda.current_stream(self.mesh.device).synchronize()
        (elapsed,) = self._all_reduce([time.perf_counter() - start], dist.ReduceOp.MAX)
        # loss (and, pipelined, the bubble fraction) summed over ranks in one collective
        bubble = self.last_stats.bubble_fraction / self.parts.world_size \
            if self.mesh.pp_size > 1 else 0.0
        local = self._owned_loss(loss) if self.parts.world_size > 1 else float(loss)
        throughput = self.parts.throughput
        keys = throughput.logged  # MoE or the family's loss_fn metrics
        m = self.mesh
        owner = self.owns_loss  # mean over DP x CP, from the loss stage
        extra = [self.last_metrics.get(k, 0.0) / (m.dp_size * m.sizes["cp"]) if owner else 0.0
                 for k in keys]
        loss_avg, bubble_avg, *extra = self._all_reduce([local, bubble, *extra])
        self.iteration += 1
        self.consumed_samples += size
        rec = throughput.record(self.iteration, loss_avg, lr, norm, elapsed, m.device, size)
        rec.update(self.consumed(), batch_size=size)  # Megatron's batch-size
        if self.cfg.training.decrease_batch_size_if_needed:  # Megatron's skipped samples
            rec["skipped_samples"] = self.skipped_samples()
        rec.update({k.replace(" ", "_"): v for k, v in zip(keys, extra)})
        if self.parts.model.scaler is not None:  # --fp16: the scale after this step's update
            rec["loss_scale"] = self.parts.model.scaler.scale
        if self.parts.throughput.predicted_step_s is not None:
            rec["predicted_step_time_s"] = self.parts.throughput.predicted_step_s
        if self.mesh.pp_size > 1:  # measured bubble: idle / flush time, mean over ranks
            rec["bubble_fraction"] = bubble_avg
        rec.update(self.parts.layer_metrics())  # --moe-per-layer-logging (a collective)
        if self.cfg.training.log_params_norm:  # --log-params-norm (a collective)
            from loom.training.param_stats import params_norm
            rec["params_norm"] = params_norm(self.parts.model.groups, self.mesh)
        rec.update(stats)
        if self.cfg.logging.log_max_attention_logit:  # TensorBoard train/max_attention_logit
            rec["max_attention_logit"] = self.max_attention_logit
        self.history.append(rec)
        return rec

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self, iters: Optional[int] = None, dataset=None, full: bool = False
                 ) -> Optional[dict]:
        """Mean loss and perplexity over the first ``--eval-iters`` x
        ``--eval-global-batch-size`` samples of the (first) validation set, or of ``dataset``
        (the same samples at every evaluation, so values are comparable: the mean over those
        samples, whatever the evaluation batch sizes); ``full``: over each of its samples once
        (:class:`~loom.training.validation.Evaluator`). None without such a set or with
        ``--eval-iters 0``."""
        rec = self.evaluator.evaluate(self.parts.data.valid_ds if dataset is None else dataset,
                                      iters or self.cfg.logging.eval_iters, full)
        return None if rec is None else {"iteration": self.iteration, **rec, **self.consumed()}

    def batch_size(self) -> int:
        """B of the next iteration: the global batch, or a batch-size ramp's at the samples
        consumed so far (``--rampup-batch-size``, ``--step-batch-size-schedule``)."""
        return self.parts.data.batch_at(self.consumed_samples)

    def data_position(self) -> int:
        """The training sample the next iteration starts at: the samples consumed, or within
        a data phase of ``--phase-transition-iterations`` its iterations so far x B (Megatron's
        ``consumed_train_samples_in_current_phase``: each phase reads its data from the
        start)."""
        if not self.parts.phases:
            return self.consumed_samples
        start = max((t for t in self.parts.phases if t <= self.iteration), default=0)
        return (self.iteration - start) * self.cfg.require_derived().global_batch_size

    def skipped_samples(self) -> int:
        """Samples of the global batches that ``--decrease-batch-size-if-needed`` left out so
        far: iterations x B - consumed (B is constant under it: no ramp), so also over
        restarts on other data-parallel sizes. Megatron-LM's ``skipped_train_samples`` also
        counts ``--iterations-to-skip``'s batches, which loom consumes and logs one by one."""
        b = self.cfg.require_derived().global_batch_size
        return max(self.iteration * b - self.consumed_samples, 0)

    def consumed(self) -> dict:
        """``consumed_samples`` and ``consumed_tokens`` (samples x s) so far, for the logs."""
        return {"consumed_samples": self.consumed_samples,
                "consumed_tokens": self.consumed_samples * self.cfg.model.seq_length}

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self, save_dir: str, tokenizer_file: Optional[str] = None) -> str:
        """Checkpoint to ``save_dir`` (:class:`~loom.training.checkpointer.Checkpointer`); its
        final path."""
        self.parts.faults.mark(self.iteration, "checkpoint save")
        finish_param_gather(self.optimizer)
        hook = self.parts.faults.save_hook(self.iteration)  # --inject-fault R:N:kill-in-save
        self.last_saved = self.parts.checkpointer.save(save_dir, self.iteration,
                                                       self.consumed_samples, tokenizer_file, hook)
        return self.last_saved

    def load(self, load_dir: str) -> bool:
        """Resume from ``load_dir`` (:meth:`~loom.training.checkpointer.Checkpointer.load`);
        False when it holds none."""
        resumed = self.parts.checkpointer.load(load_dir)
        if resumed is None:
            return False
        self.loaded_from = resumed.path
        if resumed.iteration is not None:  # --finetune: the weights only, from iteration 0
            self.iteration, self.consumed_samples = resumed.iteration, resumed.consumed_samples
        self.resumed = resume_record(resumed.path, resumed.iteration, resumed.consumed_samples,
                                     resumed.saved_layout, self.mesh.sizes, resumed.optimizer,
                                     resumed.rng, self.cfg.model.seq_length)
        return True

    def _rerun_exit(self, e: RerunExit, log: MetricsLogger) -> RerunExit:
        """The state machine's exit, after saving the iteration's starting state when it asks
        (to ``--save``, unless its latest checkpoint is already of this iteration)."""
        if not e.checkpoint:
            return e
        ck = self.cfg.checkpoint
        if not ck.save:
            return RerunExit(f"{e}; no checkpoint saved (no --save)", e.code)
        if self.parts.save_interval.last_save == self.iteration and self.last_saved:
            path = self.last_saved
        else:
            path = self.save(ck.save)
            self.saver.finish(log.print)
        return RerunExit(f"{e}; checkpoint of iteration {self.iteration}: {path}", e.code)

    def _diverged(self, iteration: int) -> str:
        """Record the run's first non-finite ``iteration`` (``--keep-last`` keeps the last
        checkpoint before it); the words naming that checkpoint."""
        return self.saver.diverged_at(iteration, self.cfg.checkpoint.save, self.loaded_from)

    def count_parameters(self) -> tuple[int, int]:
        """(parameters of the whole model, parameters held by this rank); see
        :func:`loom.training.setup.owned_parameters`."""
        (total,) = self._all_reduce([float(owned_parameters(self.model_chunks, self.mesh))])
        return int(total), held_numel(self.params)

    # -- the loop ----------------------------------------------------------------------------------
    def _evaluate_sets(self, log: MetricsLogger, test: bool) -> None:
        """Log an evaluation of the validation set(s) (and, with ``test``, of the test set)."""
        self.evaluations += self.evaluator.run(log, test, self.iteration, self.consumed())

    def _skip(self, log: MetricsLogger) -> None:
        """``--iterations-to-skip``: the next iteration takes no step; its global batch is
        consumed (Megatron's ``dummy_train_step``), nothing logged but one line."""
        size = self.batch_size()
        self.iteration += 1
        self.consumed_samples += size
        log.advance()
        log.event("skip", {"iteration": self.iteration, **self.consumed()},
                  f" iteration {self.iteration}: skipped (--iterations-to-skip): its "
                  f"{size} samples consumed, no optimizer step")

    def train(self) -> list[dict]:
        """Train to ``--train-iters``; log, evaluate (every ``--eval-interval`` and once at the
        end) and save on their intervals. ``--skip-train`` only evaluates the validation and
        test sets. Returns the training records; the evaluations are in ``self.evaluations``."""
        lg, ck, iters = self.cfg.logging, self.cfg.checkpoint, self.cfg.training.train_iters
        skip = self.cfg.training.skip_train
        self.evaluations: list[dict] = []  # {"kind": "valid" | "test", "valid_loss", ...}
        log = MetricsLogger(self.parts.global_rank == 0, lg.log_json, lg.tensorboard_dir,
                            0 if skip else iters - self.iteration, not lg.no_progress_bar,
                            config=self.cfg.to_flat(), start_iteration=self.iteration,
                            world_size=self.parts.world_size,
                            log_world_size=lg.log_world_size_to_tensorboard,
                            batch_ramp=self.parts.data.ramp is not None
                            or self.cfg.training.decrease_batch_size_if_needed)
        total, local = self.count_parameters()
        log.print(f"loom: {self.mesh.sizes} on {self.mesh.device}, {total:,} parameters "
                  f"({local:,} on rank 0), "
                  f"global batch {self.global_batch} = {self.cfg.training.micro_batch_size} x "
                  f"{self.parts.data.num_microbatches} micro-batches x {self.mesh.dp_size} DP, "
                  f"starting at iteration {self.iteration}")
        d = self.cfg.require_derived()
        if d.running_global_batch_size != d.global_batch_size:
            log.print(f" --decrease-batch-size-if-needed: global batch {d.global_batch_size} "
                      f"decreased to {d.running_global_batch_size}, a multiple of "
                      f"--micro-batch-size x {self.mesh.dp_size} DP: "
                      f"{d.global_batch_size - d.running_global_batch_size} samples skipped an "
                      f"iteration")
        if self.parts.data.ramp is not None:
            log.print(f" {self.parts.data.ramp.describe()}: {self.batch_size()} at iteration "
                      f"{self.iteration}")
        if self.resumed is not None:
            log.event("resume", self.resumed, " " + resume_line(self.resumed))
        if self.parts.checkpointer.progress is not None:  # --log-progress: "Starting job"
            self.parts.checkpointer.progress.start(self.consumed_samples)
        for name, ds in self.parts.data.sets():
            if hasattr(ds, "describe"):  # a blend: each dataset's share
                log.print(f" {name} data blend: {ds.describe()}")
        window: list[dict] = []
        start_iteration, first = self.iteration, len(self.history)  # the summary's
        last_step = next((i for i in range(iters, self.iteration, -1) if i not in self.skips),
                         iters)  # the last iteration that trains: its window is logged
        self.debug.start(log.print, self.iteration, iters)
        started = time.monotonic()  # --exit-duration-in-mins counts from here
        try:
            if skip:
                self._evaluate_sets(log, test=True)
                return self.history
            self.parts.faults.start()
            self.parts.faults.check_weights(self.iteration, log.print, first=True)
            while self.iteration < iters:
                if self.iteration + 1 in self.skips:
                    self._skip(log)
                    if self.iteration == iters:  # Megatron evaluates after its loop
                        self._evaluate_sets(log, test=True)
                    continue
                self.parts.faults.before_iteration(self.iteration + 1)
                self.debug.before_iteration(self.iteration)
                try:
                    rec = self.train_step()
                except RerunExit as e:  # 16: the iteration's starting state saved first
                    raise self._rerun_exit(e, log) from None
                self.debug.after_iteration(self.iteration, first=len(self.history) == 1)
                self.saver.poll(log.print)  # finalizes a completed --async-save
                self.parts.faults.check_weights(self.iteration, log.print)
                if not math.isfinite(rec["grad_norm"]):
                    scale = f", loss scale {rec['loss_scale']:g}" if "loss_scale" in rec else ""
                    log.print(f" iteration {self.iteration}: non-finite gradient norm "
                              f"{rec['grad_norm']} (loss {rec['loss']}{scale}): step skipped"
                              + (f"; {self._diverged(self.iteration)}"
                                 if len(self.nonfinite) == 1 else ""))
                window.append(rec)
                log.advance()
                if self.iteration % lg.log_interval == 0 or self.iteration == last_step:
                    log.log(avg := self.parts.throughput.average(window))
                    self.debug.logged(self.iteration, len(window), avg["step_time_s"], log.extra)
                    window = []
                if self.evaluator.due(self.iteration, iters):
                    self.parts.faults.mark(self.iteration, "evaluation")
                    self._evaluate_sets(log, test=self.iteration == iters)
                signalled = self.parts.faults.stop_requested(  # --exit-signal-handler: all agree
                    lambda v: self._all_reduce(v, dist.ReduceOp.MAX))
                limit = self.cfg.training.exit_duration_in_mins  # Megatron's: all ranks agree
                timed_out = bool(limit) and self._all_reduce(
                    [float(time.monotonic() - started > 60 * limit)], dist.ReduceOp.MAX)[0] > 0
                phase_end = self.iteration in self.parts.phases
                exiting = signalled is not None or timed_out or phase_end or (
                    bool(ck.exit_interval) and self.iteration % ck.exit_interval == 0)
                due = self.parts.save_interval.due(self.iteration, rec["step_time_s"])
                if self.parts.save_interval.message:
                    log.print(f" {self.parts.save_interval.take_message()}")
                if ck.save and (due or exiting):
                    with self.debug.timers("save-checkpoint"):
                        log.print(f" {self.saver.verb} checkpoint {self.save(ck.save)}")
                    save_s = self.debug.timed_report("save-checkpoint")  # max over ranks
                    plan = self.parts.save_interval.saved(self.iteration, save_s,
                                                          rec["step_time_s"])
                    if plan:
                        log.print(f" {plan}")
                elif self.parts.checkpointer.non_persistent_due(self.iteration):
                    path = self.save(self.parts.checkpointer.non_persistent_dir)  # newest kept
                    log.print(f" {self.saver.verb} non-persistent checkpoint {path}")
                if exiting:
                    why = f"{signalled} received (--exit-signal-handler)" if signalled else \
                        f"--exit-duration-in-mins {limit}" if timed_out else \
                        "the data phase ends (--phase-transition-iterations)" if phase_end else \
                        f"--exit-interval {ck.exit_interval}"
                    log.print(f" {why}: exiting after iteration {self.iteration}")
                    break
            if ck.save and self.iteration == iters and self.parts.save_interval.last_save != iters:
                if not self.history and self.saver.holds(self.loaded_from, ck.save, iters):
                    log.print(f" checkpoint {self.loaded_from} already holds iteration {iters}: "
                              f"not saved again")
                    self.last_saved = self.loaded_from
                else:
                    log.print(f" {self.saver.verb} checkpoint {self.save(ck.save)}")
            self.saver.finish(log.print)  # exit waits for a save in flight
            throughput = self.parts.throughput
            if throughput.predicted_step_s is not None and len(self.history) > 1:
                log.print(" " + prediction_line(throughput.predicted_step_s, self.history[1:]))
            if lg.timeline:
                self.write_timeline()
                log.print(f" wrote timeline {lg.timeline}")
            summary = run_summary(
                self.history[first:], self.evaluations, start_iteration, self.iteration,
                self.consumed_samples, self.cfg.model.seq_length, time.monotonic() - started,
                throughput.tokens_per_iter, throughput.flops_per_iter, self.parts.world_size,
                throughput.peak_flops, self.last_saved)
            log.event("summary", summary, " " + summary_line(summary))
        except NonFiniteError as e:  # --exit-on-nonfinite, or a NaN loss under --rerun-mode
            first = self.nonfinite[0] if self.nonfinite else self.iteration + 1  # disabled
            raise NonFiniteError(f"{e}; {self._diverged(first)}") from None
        finally:
            self.debug.stop()
            self.parts.faults.stop()
            self.saver.close(log.print)
            log.close()
        return self.history
