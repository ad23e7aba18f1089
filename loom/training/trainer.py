"""The training loop: data -> forward/backward schedule -> DP gradient reduction -> clipping ->
AdamW -> LR schedule -> metrics -> evaluation -> checkpoint.

:class:`Trainer` takes a validated :class:`~loom.config.LoomConfig`. Without an explicit mesh it
initializes ``torch.distributed`` from torchrun's environment and builds the
:class:`~loom.parallel.mesh.ParallelMesh`; tests inject ``ParallelMesh.single()`` to get the
single-process reference of the very same code.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from loom.checkpoint import latest_checkpoint, load_checkpoint, read_common
from loom.checkpoint.model_match import check_same_model
from loom.checkpoint.saver import Saver
from loom.config import LoomConfig
from loom.data.for_model import build_for_model
from loom.errors import NonFiniteError
from loom.data.sampler import get_batch, microbatch_indices
from loom.models import get_family
from loom.models.family import ModelFamily
from loom.parallel.context import local_positions, slice_for_cp
from loom.parallel.mesh import ParallelMesh, init_distributed
from loom.parallel.parallelize import build_model_chunks
from loom.parallel.pipeline.schedules import ScheduleResult, forward_only, get_schedule
from loom.parallel.pipeline.timeline import Timeline, merge
from loom.parallel.random import RNGTracker, seed_everything
from loom.parallel.registry import ParamRegistry, named_parameters
from loom.planner.flops import model_flops_per_iteration
from loom.training.fault import FaultTolerance
from loom.training.metrics import (MetricsLogger, average_window, peak_flops_per_rank,
                                  peak_memory_bytes)
from loom.training.optimizer import build_optimizer, build_scheduler, lr_at
from loom.training.precision import (cast_parameters, loss_scaler, param_dtype,
                                     precision_forward_step)
from loom.training.resume import reconcile_schedule
from loom.training.setup import (checkpoint_interval, chunk_reducer, held_numel, logged_metrics,
                                 owned_parameters, predict_step_time)
from loom.training.step import finish_gradients, finish_param_gather, optimizer_step


class Trainer:
    """One rank's training: model chunks of ``family`` (default GPT/LLaMA) under ``cfg``'s
    layout. ``mesh`` None initializes ``torch.distributed`` from torchrun's environment."""

    def __init__(self, cfg: LoomConfig, mesh: Optional[ParallelMesh] = None,
                 family: Optional[ModelFamily] = None):
        self.cfg = cfg
        if mesh is None:
            dev = cfg.parallel.device or ("cuda" if torch.cuda.is_available() else "cpu")
            backend = cfg.parallel.distributed_backend  # Megatron's nccl; CPU can only use gloo
            device = init_distributed(dev, "gloo" if dev == "cpu" else backend,
                                      cfg.fault_tolerance.distributed_timeout_minutes)
            p = cfg.parallel
            mesh = ParallelMesh.build(tp=p.tensor_model_parallel_size,
                                      pp=p.pipeline_model_parallel_size,
                                      cp=p.context_parallel_size, device=device,
                                      ep=p.expert_model_parallel_size,
                                      etp=p.expert_tensor_parallel_size)
        self.mesh = mesh
        self.family = family or get_family(cfg.model.model_type)
        self.world_size = math.prod(mesh.sizes.values())
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        t = cfg.training
        self.global_batch = cfg.training.global_batch_size or t.micro_batch_size * mesh.dp_size
        self.num_microbatches = self.global_batch // (t.micro_batch_size * mesh.dp_size)
        self.tracker = RNGTracker(mesh.device)
        seed_everything(t.seed, mesh.pp_rank, mesh.tp_rank, self.tracker)
        self.model_chunks = build_model_chunks(self.family, cfg, mesh, self.tracker)
        self.registry = ParamRegistry.merged(c.registry for c in self.model_chunks)
        self.scaler = loss_scaler(t)  # --fp16; 16-bit parameters: loom.training.precision
        self.forward_step = precision_forward_step(
            self.family.forward_step, cast_parameters(self.model_chunks, param_dtype(t)),
            self.scaler)
        self.reducers = [chunk_reducer(c, mesh, cfg) for c in self.model_chunks]
        named = list(named_parameters(self.model_chunks))
        self.params = [p for _, p, _ in named]
        ep = mesh.ep_size > 1
        self.norm_params = [p for _, p, m in named if m.counts_for_norm(mesh.tp_rank)
                            and not (ep and m.expert_parallel)]
        self.expert_norm_params = [p for _, p, m in named if ep and m.expert_parallel
                                   and m.counts_for_norm(mesh.tp_rank)]
        self.sp_params = [p for _, p, m in named if m.grad_summed_over_tp]
        self.optimizer = build_optimizer(nn.ModuleList(self.model_chunks), t, mesh, self.reducers)
        if t.overlap_param_gather:  # each bucket's all-gather waited for before its first use
            for c, r in zip(self.model_chunks, self.reducers):
                for g in getattr(r, "reducers", [r]):
                    g.hook_param_gather(c)
        self.scheduler = build_scheduler(self.optimizer, t)
        par = cfg.parallel  # the schedule validate() resolved (virtual stages imply interleaved)
        self.schedule = get_schedule(par.pipeline_schedule or (
            "interleaved" if par.num_layers_per_virtual_pipeline_stage else "1f1b"), mesh.pp_size)
        self.timeline = Timeline(self.global_rank, enabled=bool(cfg.logging.timeline))
        self.last_stats = None  # PipelineStats of the latest schedule run
        self.last_metrics: dict = {}
        self.iteration = 0
        self.consumed_samples = 0
        self.nonfinite: list[int] = []  # consecutive iterations skipped for a NaN/inf norm
        ft = cfg.fault_tolerance
        self.faults = FaultTolerance(self.global_rank, ft.inject_fault, ft.hang_timeout_s)
        self.save_interval = checkpoint_interval(cfg, self.world_size, self.params)
        self.saver = Saver(cfg, cfg.checkpoint.async_save)  # sync, or --async-save
        self.train_ds, self.valid_ds, self.test_ds = self._datasets()
        self.flops_per_iter = model_flops_per_iteration(cfg.model, self.global_batch,
                                                        cfg.model.seq_length)
        self.peak_flops = peak_flops_per_rank(mesh.device, cfg.logging.peak_tflops)
        self.history: list[dict] = []
        self.predicted_step_s = predict_step_time(cfg, self.world_size, mesh.device)
        self.loaded_from: Optional[str] = None  # the checkpoint this run resumed from
        if cfg.checkpoint.load:
            self.load(cfg.checkpoint.load)

    # -- data ------------------------------------------------------------------------------------
    def _datasets(self):
        return build_for_model(self.cfg)  # GPT windows or BERT samples: loom.data.for_model

    def batches(self, dataset, consumed: int) -> list[dict]:
        """This DP rank's m micro-batches of the global batch starting at sample ``consumed``:
        ``tokens``/``labels`` ``[b, s/c]`` and ``position_ids [s/c]`` (this CP rank's
        load-balanced chunks, :mod:`loom.parallel.context`)."""
        idx = microbatch_indices(consumed, self.cfg.training.micro_batch_size,
                                 self.num_microbatches, self.mesh.dp_rank, self.mesh.dp_size)
        dev, cp, cp_rank = self.mesh.device, self.mesh.sizes["cp"], self.mesh.coords["cp"]
        s = self.cfg.model.seq_length
        positions = (local_positions(s, cp_rank, cp) if cp > 1 else torch.arange(s)).to(dev)
        out = []
        for i in idx:
            batch = {k: slice_for_cp(v, cp_rank, cp).to(dev, non_blocking=True)
                     for k, v in get_batch(dataset, i).items()}
            batch["position_ids"] = positions
            batch["num_microbatches"] = self.num_microbatches
            out.append(batch)
        return out

    def p2p_shape(self, batches: list[dict]) -> tuple[int, int, int]:
        """``[s, b, h]`` exchanged between pipeline stages: this rank's ``s/c`` tokens, split by
        t under sequence parallelism."""
        b, s = batches[0]["tokens"].shape
        sp = self.cfg.parallel.sequence_parallel and self.mesh.tp_size > 1
        return (s // (self.mesh.tp_size if sp else 1), b, self.cfg.model.hidden_size)

    # -- one step ----------------------------------------------------------------------------------
    def forward_backward(self, batches: list[dict]) -> torch.Tensor:
        """Gradients of the global batch's mean loss, reduced over DP; returns this rank's loss
        (the last stage's mean over its micro-batches, 0 on other stages)."""
        result: ScheduleResult = self.schedule(
            self.model_chunks, batches, self.forward_step, self.mesh,
            p2p_shape=self.p2p_shape(batches), reducers=self.reducers, recorder=self.timeline)
        finish_gradients(self)  # DP, then SP over TP and the tied embedding over its group
        self.last_stats, self.last_metrics = result.stats, result.metrics
        return result.loss

    def optimizer_step(self) -> float:
        """Unscale, clip, AdamW, LR schedule, non-finite guard
        (:func:`loom.training.step.optimizer_step`); returns the pre-clip grad norm."""
        return optimizer_step(self)

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """Reduce a few host scalars over every rank in one collective (identity on 1 rank)."""
        if not dist.is_initialized() or self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.mesh.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _owned_loss(self, local: torch.Tensor) -> float:
        """This rank's share of the global mean loss: the last stage's TP rank 0 of each DP x CP
        replica contributes its loss / (d c) (each holds an equal share of the tokens)."""
        m = self.mesh
        owns = m.is_last_stage and m.tp_rank == 0
        return float(local) / (m.dp_size * m.sizes["cp"]) if owns else 0.0

    def global_loss(self, local: torch.Tensor) -> float:
        """Mean loss over DP and CP ranks, taken from the last pipeline stage."""
        if not dist.is_initialized() or self.world_size == 1:
            return float(local)
        return self._all_reduce([self._owned_loss(local)])[0]

    def write_timeline(self) -> None:
        """Each rank writes ``PATH.rank{N}.json``; rank 0 merges them into ``PATH``."""
        path = self.cfg.logging.timeline
        self.timeline.write_rank(path, stage=self.mesh.pp_rank)
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()
        if self.global_rank == 0:
            merge(path)

    def train_step(self) -> dict:
        lr = self.optimizer.param_groups[0]["lr"]
        start = time.perf_counter()
        loss = self.forward_backward(self.batches(self.train_ds, self.consumed_samples))
        with self.timeline.span("optimizer"):
            norm = self.optimizer_step()
        if self.mesh.device.type == "cuda":
            torch.cuda.synchronize(self.mesh.device)
        (elapsed,) = self._all_reduce([time.perf_counter() - start], dist.ReduceOp.MAX)
        # loss (and, pipelined, the bubble fraction) summed over ranks in one collective
        bubble = self.last_stats.bubble_fraction / self.world_size if self.mesh.pp_size > 1 else 0.0
        local = self._owned_loss(loss) if self.world_size > 1 else float(loss)
        moe_keys = logged_metrics(self.cfg.model)  # MoE or BERT (mlm / sop) loss_fn metrics
        m = self.mesh
        owner = m.is_last_stage and m.tp_rank == 0  # mean over DP x CP, from the last stage
        moe = [self.last_metrics.get(k, 0.0) / (m.dp_size * m.sizes["cp"]) if owner else 0.0
               for k in moe_keys]
        loss_avg, bubble_avg, *moe = self._all_reduce([local, bubble, *moe])
        self.iteration += 1
        self.consumed_samples += self.global_batch
        tokens = self.global_batch * self.cfg.model.seq_length
        tflops = self.flops_per_iter / elapsed / self.world_size / 1e12
        rec = {"iteration": self.iteration, "loss": loss_avg, "lr": lr,
               "grad_norm": norm, "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
               "tflops_per_rank": tflops,
               "mfu": tflops * 1e12 / self.peak_flops if self.peak_flops else None,
               "peak_memory_bytes": peak_memory_bytes(self.mesh.device)}
        rec.update({k.replace(" ", "_"): v for k, v in zip(moe_keys, moe)})
        if self.scaler is not None:  # --fp16: the scale after this step's update
            rec["loss_scale"] = self.scaler.scale
        if self.predicted_step_s is not None:
            rec["predicted_step_time_s"] = self.predicted_step_s
        if self.mesh.pp_size > 1:  # measured bubble: idle / flush time, mean over ranks
            rec["bubble_fraction"] = bubble_avg
        self.history.append(rec)
        return rec

    # -- evaluation --------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, iters: Optional[int] = None, dataset=None) -> Optional[dict]:
        """Mean loss and perplexity over the first ``--eval-iters`` global batches of the
        validation set, or of ``dataset`` (the same samples at every evaluation, so values are
        comparable); None without such a set or with ``--eval-iters 0``."""
        dataset = self.valid_ds if dataset is None else dataset
        iters = iters or self.cfg.logging.eval_iters
        if dataset is None or not iters:
            return None
        for c in self.model_chunks:
            c.eval()
        total = 0.0
        for i in range(iters):
            batches = self.batches(dataset, i * self.global_batch)
            result = forward_only(self.model_chunks, batches, self.forward_step, self.mesh,
                                  p2p_shape=self.p2p_shape(batches))
            total += self.global_loss(result.loss)
        for c in self.model_chunks:
            c.train()
        loss = total / iters
        return {"iteration": self.iteration, "valid_loss": loss,
                "valid_ppl": math.exp(min(loss, 50.0))}

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self, save_dir: str, tokenizer_file: Optional[str] = None) -> str:
        """Checkpoint to ``save_dir`` (:class:`~loom.checkpoint.saver.Saver`); its final path."""
        self.faults.mark(self.iteration, "checkpoint save")
        finish_param_gather(self.optimizer)
        hook = self.faults.save_hook(self.iteration)  # --inject-fault R:N:kill-in-save
        return self.saver.save(self, save_dir, tokenizer_file, hook)

    def load(self, load_dir: str) -> bool:
        """Resume from ``load_dir`` (its latest checkpoint, or ``--ckpt-step``); False when it
        holds none. ``--finetune``: weights only, from iteration 0; ``--no-load-optim``: no Adam
        states and no LR-schedule state; ``--no-load-rng``: fresh generators. Raises ConfigError
        when the checkpoint is of another architecture."""
        ck = self.cfg.checkpoint
        weights_only = ck.finetune or ck.no_load_optim  # Megatron: no optimizer, no scheduler
        ckpt = latest_checkpoint(load_dir, ck.ckpt_step)
        if ckpt is not None:
            saved = read_common(ckpt)["config"]
            check_same_model(saved, self.cfg.model, ckpt)
            reconcile_schedule(saved, self.cfg, self.world_size, ckpt)
        common = load_checkpoint(load_dir, self.model_chunks,
                                 None if weights_only else self.optimizer,
                                 None if weights_only else self.scheduler, self.mesh,
                                 None if ck.finetune or ck.no_load_rng else self.tracker,
                                 step=ck.ckpt_step)
        if common is None:
            return False
        self.loaded_from = ckpt
        if weights_only and hasattr(self.optimizer, "copy_params_to_masters"):
            self.optimizer.copy_params_to_masters()  # fp32 masters from the loaded weights
        if not ck.finetune:  # --finetune: the weights only, from iteration 0
            self.iteration = common["iteration"]
            self.consumed_samples = common["consumed_samples"]
        t = self.cfg.training  # the schedule continues from the restored step, with this run's lr
        self.scheduler.base_lrs = [t.lr] * len(self.scheduler.base_lrs)
        lrs = [lr_at(self.scheduler.last_epoch, t)] * len(self.optimizer.param_groups)
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.scheduler._last_lr = lrs
        return True

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
        """Log an evaluation of the validation set (and, with ``test``, of the test set)."""
        for kind, ds in (("valid", self.valid_ds), ("test", self.test_ds if test else None)):
            rec = self.evaluate(dataset=ds) if ds is not None else None
            if rec is not None:
                log.log(rec, kind=kind)
                self.evaluations.append({"kind": kind, **rec})

    def train(self) -> list[dict]:
        """Train to ``--train-iters``; log, evaluate (every ``--eval-interval`` and once at the
        end) and save on their intervals. ``--skip-train`` only evaluates the validation and
        test sets. Returns the training records; the evaluations are in ``self.evaluations``."""
        lg, ck, iters = self.cfg.logging, self.cfg.checkpoint, self.cfg.training.train_iters
        skip = self.cfg.training.skip_train
        self.evaluations: list[dict] = []  # {"kind": "valid" | "test", "valid_loss", ...}
        log = MetricsLogger(self.global_rank == 0, lg.log_json, lg.tensorboard_dir,
                            0 if skip else iters - self.iteration, not lg.no_progress_bar,
                            config=self.cfg.to_flat(), start_iteration=self.iteration)
        total, local = self.count_parameters()
        log.print(f"loom: {self.mesh.sizes} on {self.mesh.device}, {total:,} parameters "
                  f"({local:,} on rank 0), "
                  f"global batch {self.global_batch} = {self.cfg.training.micro_batch_size} x "
                  f"{self.num_microbatches} micro-batches x {self.mesh.dp_size} DP, "
                  f"starting at iteration {self.iteration}")
        for name, ds in (("train", self.train_ds), ("valid", self.valid_ds), ("test", self.test_ds)):
            if hasattr(ds, "describe"):  # a blend: each dataset's share
                log.print(f" {name} data blend: {ds.describe()}")
        window: list[dict] = []
        try:
            if skip:
                self._evaluate_sets(log, test=True)
                return self.history
            self.faults.start()
            while self.iteration < iters:
                self.faults.before_iteration(self.iteration + 1)
                rec = self.train_step()
                self.saver.poll(log.print)  # finalizes a completed --async-save
                if not math.isfinite(rec["grad_norm"]):
                    scale = f", loss scale {rec['loss_scale']:g}" if "loss_scale" in rec else ""
                    log.print(f" iteration {self.iteration}: non-finite gradient norm "
                              f"{rec['grad_norm']} (loss {rec['loss']}{scale}): step skipped"
                              + (f"; {self._diverged(self.iteration)}"
                                 if len(self.nonfinite) == 1 else ""))
                window.append(rec)
                log.advance()
                if self.iteration % lg.log_interval == 0 or self.iteration == iters:
                    log.log(average_window(window, self.global_batch * self.cfg.model.seq_length,
                                           self.flops_per_iter / self.world_size,
                                           self.peak_flops))
                    window = []
                periodic = bool(lg.eval_interval) and self.iteration % lg.eval_interval == 0
                if periodic or self.iteration == iters:
                    self.faults.mark(self.iteration, "evaluation")
                    self._evaluate_sets(log, test=self.iteration == iters)
                exiting = bool(ck.exit_interval) and self.iteration % ck.exit_interval == 0
                due = self.save_interval.due(self.iteration, rec["step_time_s"])
                if self.save_interval.message:
                    log.print(f" {self.save_interval.take_message()}")
                if ck.save and (due or exiting):
                    t0 = time.perf_counter()
                    log.print(f" {self.saver.verb} checkpoint {self.save(ck.save)}")
                    (save_s,) = self._all_reduce([time.perf_counter() - t0], dist.ReduceOp.MAX)
                    plan = self.save_interval.saved(self.iteration, save_s, rec["step_time_s"])
                    if plan:
                        log.print(f" {plan}")
                if exiting:
                    log.print(f" --exit-interval {ck.exit_interval}: exiting after iteration "
                              f"{self.iteration}")
                    break
            if ck.save and self.iteration == iters and self.save_interval.last_save != iters:
                if not self.history and self.saver.holds(self.loaded_from, ck.save, iters):
                    log.print(f" checkpoint {self.loaded_from} already holds iteration {iters}: "
                              f"not saved again")
                else:
                    log.print(f" {self.saver.verb} checkpoint {self.save(ck.save)}")
            self.saver.finish(log.print)  # exit waits for a save in flight
            if self.predicted_step_s is not None and len(self.history) > 1:
                measured = sorted(r["step_time_s"] for r in self.history[1:])[len(self.history[1:]) // 2]
                log.print(f" step time: planner predicted {self.predicted_step_s:.4g} s, measured "
                          f"median {measured:.4g} s ({100 * (self.predicted_step_s / measured - 1):+.0f}%)")
            if lg.timeline:
                self.write_timeline()
                log.print(f" wrote timeline {lg.timeline}")
        except NonFiniteError as e:  # --exit-on-nonfinite: name the checkpoint to go back to
            raise NonFiniteError(f"{e}; {self._diverged(self.nonfinite[0])}") from None
        finally:
            self.faults.stop()
            self.saver.close(log.print)
            log.close()
        return self.history
