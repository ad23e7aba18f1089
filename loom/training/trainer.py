"""The training loop: data -> forward/backward schedule -> DP gradient reduction -> clipping ->
AdamW -> LR schedule -> metrics -> evaluation -> checkpoint.

:class:`Trainer` takes a validated :class:`~loom.config.LoomConfig`. Without an explicit mesh it
initializes ``torch.distributed`` from torchrun's environment and builds the
:class:`~loom.parallel.mesh.ParallelMesh`; tests inject ``ParallelMesh.single()`` to get the
single-process reference of the very same code.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from loom.checkpoint import load_checkpoint, save_checkpoint
from loom.config import ConfigError, LoomConfig
from loom.data.gpt_dataset import MockGPTDataset, build_gpt_datasets
from loom.data.sampler import get_batch, microbatch_indices
from loom.models.gpt import GPTModel
from loom.parallel.context import slice_for_cp
from loom.parallel.data import GradientReducer
from loom.parallel.mesh import ParallelMesh, init_distributed
from loom.parallel.pipeline import timeline
from loom.parallel.random import RNGTracker, seed_everything
from loom.parallel.sequence import allreduce_sequence_parallel_grads
from loom.planner.flops import model_flops_per_iteration
from loom.training.metrics import MetricsLogger, peak_flops_per_rank, peak_memory_bytes
from loom.training.optimizer import build_optimizer, build_scheduler, clip_grad_norm
from loom.training.step import get_forward_backward_func


def build_model_chunks(cfg: LoomConfig, mesh: ParallelMesh, tracker: RNGTracker) -> list[nn.Module]:
    """This rank's model: one chunk without pipelining, else its stage's chunk(s)."""
    if mesh.pp_size > 1:
        from loom.parallel.pipeline import build_pipeline_chunks
        chunks = build_pipeline_chunks(cfg, mesh, tracker)
    else:
        chunks = [GPTModel(cfg.model, mesh, tracker,
                           recompute_granularity=cfg.training.recompute_granularity,
                           sequence_parallel=cfg.parallel.sequence_parallel)]
    for chunk in chunks:
        chunk.init_weights(cfg.training.seed)
    return chunks


class Trainer:
    def __init__(self, cfg: LoomConfig, mesh: Optional[ParallelMesh] = None):
        self.cfg = cfg
        if mesh is None:
            device = init_distributed(cfg.parallel.device, cfg.parallel.distributed_backend)
            p = cfg.parallel
            mesh = ParallelMesh.build(tp=p.tensor_model_parallel_size,
                                      pp=p.pipeline_model_parallel_size,
                                      cp=p.context_parallel_size, device=device)
        self.mesh = mesh
        self.world_size = math.prod(mesh.sizes.values())
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        t = cfg.training
        self.global_batch = cfg.training.global_batch_size or t.micro_batch_size * mesh.dp_size
        self.num_microbatches = self.global_batch // (t.micro_batch_size * mesh.dp_size)
        self.tracker = RNGTracker(mesh.device)
        seed_everything(t.seed, mesh.pp_rank, mesh.tp_rank, self.tracker)
        self.model_chunks = build_model_chunks(cfg, mesh, self.tracker)
        if t.bf16:
            for chunk in self.model_chunks:
                chunk.autocast_dtype = torch.bfloat16
        self.reducers = [GradientReducer(c.parameters(), mesh.groups["dp_cp"],
                                         cfg.parallel.ddp_bucket_size) for c in self.model_chunks]
        self.params = [p for c in self.model_chunks for p in c.parameters()]
        self.optimizer = build_optimizer(nn.ModuleList(self.model_chunks), t, mesh.groups["dp_cp"])
        self.scheduler = build_scheduler(self.optimizer, t)
        self.schedule = get_forward_backward_func(mesh.pp_size, cfg.parallel.pipeline_schedule)
        self.iteration = 0
        self.consumed_samples = 0
        self.train_ds, self.valid_ds, self.test_ds = self._datasets()
        self.flops_per_iter = model_flops_per_iteration(cfg.model, self.global_batch,
                                                        cfg.model.seq_length)
        self.peak_flops = peak_flops_per_rank(mesh.device, cfg.logging.peak_tflops)
        self.history: list[dict] = []
        self.predicted_step_s = self._predict_step_time()
        if cfg.logging.timeline:  # --timeline: per-rank Chrome trace, merged by rank 0
            timeline.enable(self.global_rank)
        if cfg.checkpoint.load:
            self.load(cfg.checkpoint.load)

    def _predict_step_time(self) -> Optional[float]:
        """The planner's iteration time for this exact layout (seconds), when it knows the
        hardware: a ``--planner-cluster`` file (``loom plan --calibrate``) or a known GPU."""
        cluster = self.cfg.logging.planner_cluster
        if cluster is None and self.mesh.device.type != "cuda":
            return None
        try:
            from loom.planner.predict import predict_layout
            return predict_layout(self.cfg, self.world_size, cluster=cluster)["time_s"]["iteration"]
        except Exception:  # noqa: BLE001 - a prediction must never stop training
            return None

    # -- data ------------------------------------------------------------------------------------
    def _datasets(self):
        d, m = self.cfg.data, self.cfg.model
        if d.mock_data or not d.data_path:
            ds = MockGPTDataset(m.vocab_size, m.seq_length, self.cfg.training.seed)
            return ds, MockGPTDataset(m.vocab_size, m.seq_length, self.cfg.training.seed + 1), None
        return build_gpt_datasets(d.data_path, d.split, m.seq_length, self.cfg.training.seed,
                                  valid_data_path=d.valid_data_path)

    def batches(self, dataset, consumed: int) -> list[dict]:
        """This DP rank's m micro-batches of the global batch starting at sample ``consumed``."""
        idx = microbatch_indices(consumed, self.cfg.training.micro_batch_size,
                                 self.num_microbatches, self.mesh.dp_rank, self.mesh.dp_size)
        dev, cp, cp_rank = self.mesh.device, self.mesh.sizes["cp"], self.mesh.coords["cp"]
        return [{k: slice_for_cp(v, cp_rank, cp).to(dev, non_blocking=True)
                 for k, v in get_batch(dataset, i).items()} for i in idx]

    # -- one step ----------------------------------------------------------------------------------
    def forward_backward(self, batches: list[dict]) -> torch.Tensor:
        """Gradients of the global batch's mean loss, reduced over DP; returns this rank's loss."""
        loss = self.schedule(model_chunks=self.model_chunks, batches=batches,
                             reducers=self.reducers, mesh=self.mesh, cfg=self.cfg)
        for r in self.reducers:
            r.finish_grad_sync()
        if self.cfg.parallel.sequence_parallel:
            allreduce_sequence_parallel_grads(self.params, self.mesh.groups["tp"])
        if self.mesh.pp_size > 1:
            from loom.parallel.pipeline import allreduce_embedding_grads
            allreduce_embedding_grads(self.model_chunks, self.mesh)
        return loss

    def optimizer_step(self) -> float:
        """Clip by the global norm, AdamW step, LR schedule; returns the pre-clip grad norm."""
        norm = clip_grad_norm(self.params, self.cfg.training.clip_grad, self.mesh)
        self.optimizer.step()
        self.scheduler.step()
        for r in self.reducers:
            r.zero_grad()
        return norm

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
        timeline.write_rank(path, stage=self.mesh.pp_rank)
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()
        if self.global_rank == 0:
            timeline.merge(path)

    def train_step(self) -> dict:
        lr = self.optimizer.param_groups[0]["lr"]
        start = time.perf_counter()
        loss = self.forward_backward(self.batches(self.train_ds, self.consumed_samples))
        with timeline.span("optimizer"):
            norm = self.optimizer_step()
        if self.mesh.device.type == "cuda":
            torch.cuda.synchronize(self.mesh.device)
        (elapsed,) = self._all_reduce([time.perf_counter() - start], dist.ReduceOp.MAX)
        # loss (and, pipelined, the bubble fraction) summed over ranks in one collective
        bubble = 0.0
        if self.mesh.pp_size > 1:
            from loom.parallel.pipeline import last_stats
            bubble = last_stats().bubble_fraction / self.world_size
        local = self._owned_loss(loss) if self.world_size > 1 else float(loss)
        loss_avg, bubble_avg = self._all_reduce([local, bubble])
        self.iteration += 1
        self.consumed_samples += self.global_batch
        tokens = self.global_batch * self.cfg.model.seq_length
        tflops = self.flops_per_iter / elapsed / self.world_size / 1e12
        rec = {"iteration": self.iteration, "loss": loss_avg, "lr": lr,
               "grad_norm": norm, "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
               "tflops_per_rank": tflops,
               "mfu": tflops * 1e12 / self.peak_flops if self.peak_flops else None,
               "peak_memory_bytes": peak_memory_bytes(self.mesh.device)}
        if self.predicted_step_s is not None:
            rec["predicted_step_time_s"] = self.predicted_step_s
        if self.mesh.pp_size > 1:  # measured bubble: idle / flush time, mean over ranks
            rec["bubble_fraction"] = bubble_avg
        self.history.append(rec)
        return rec

    # -- evaluation --------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, iters: Optional[int] = None) -> Optional[dict]:
        """Mean loss and perplexity over the first ``--eval-iters`` global batches of the
        validation set (the same samples at every evaluation, so values are comparable)."""
        if self.valid_ds is None:
            return None
        iters = iters or self.cfg.logging.eval_iters
        for c in self.model_chunks:
            c.eval()
        total = 0.0
        for i in range(iters):
            batches = self.batches(self.valid_ds, i * self.global_batch)
            if self.mesh.pp_size > 1:
                from loom.parallel.pipeline import forward_only
                local = forward_only(self.model_chunks, batches, self.mesh, self.cfg)
            else:
                local = torch.stack([self.model_chunks[0](b["tokens"], b["labels"]).mean()
                                     for b in batches]).mean()
            total += self.global_loss(local)
        for c in self.model_chunks:
            c.train()
        loss = total / iters
        return {"iteration": self.iteration, "valid_loss": loss,
                "valid_ppl": math.exp(min(loss, 50.0))}

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self, save_dir: str, tokenizer_file: Optional[str] = None) -> str:
        if tokenizer_file is None and self.cfg.data.data_path:
            tokenizer_file = self.cfg.data.data_path + ".tokenizer.json"
        return save_checkpoint(save_dir, self.iteration, self.model_chunks, self.optimizer,
                               self.scheduler, self.mesh, self.tracker,
                               consumed_samples=self.consumed_samples,
                               config=self.cfg.to_flat(), tokenizer_file=tokenizer_file)

    def load(self, load_dir: str) -> bool:
        common = load_checkpoint(load_dir, self.model_chunks, self.optimizer, self.scheduler,
                                 self.mesh, self.tracker, step=self.cfg.checkpoint.ckpt_step)
        if common is None:
            return False
        self.iteration = common["iteration"]
        self.consumed_samples = common["consumed_samples"]
        return True

    # -- the loop ----------------------------------------------------------------------------------
    def train(self) -> list[dict]:
        """Train to ``--train-iters``; log, evaluate and save on their intervals."""
        lg = self.cfg.logging
        log = MetricsLogger(self.global_rank == 0, lg.log_json, lg.tensorboard_dir,
                            self.cfg.training.train_iters - self.iteration, not lg.no_progress_bar)
        from loom.planner.memory import total_params
        log.print(f"loom: {self.mesh.sizes} on {self.mesh.device}, "
                  f"{total_params(self.cfg.model):,.0f} parameters "
                  f"({sum(p.numel() for p in self.params):,} on rank 0), "
                  f"global batch {self.global_batch} = {self.cfg.training.micro_batch_size} x "
                  f"{self.num_microbatches} micro-batches x {self.mesh.dp_size} DP, "
                  f"starting at iteration {self.iteration}")
        window: list[dict] = []
        try:
            while self.iteration < self.cfg.training.train_iters:
                rec = self.train_step()
                window.append(rec)
                log.advance()
                if self.iteration % lg.log_interval == 0 or \
                        self.iteration == self.cfg.training.train_iters:
                    avg = dict(rec)
                    avg["loss"] = sum(r["loss"] for r in window) / len(window)
                    avg["step_time_s"] = sum(r["step_time_s"] for r in window) / len(window)
                    if "bubble_fraction" in rec:
                        avg["bubble_fraction"] = (sum(r["bubble_fraction"] for r in window)
                                                  / len(window))
                    avg["tokens_per_s"] = (self.global_batch * self.cfg.model.seq_length
                                           / avg["step_time_s"])
                    avg["tflops_per_rank"] = (self.flops_per_iter / avg["step_time_s"]
                                              / self.world_size / 1e12)
                    avg["mfu"] = (avg["tflops_per_rank"] * 1e12 / self.peak_flops
                                  if self.peak_flops else None)
                    log.log(avg)
                    window = []
                if lg.eval_interval and self.iteration % lg.eval_interval == 0:
                    log.log(self.evaluate(), kind="valid")
                if self.cfg.checkpoint.save and self.cfg.checkpoint.save_interval and self.iteration % self.cfg.checkpoint.save_interval == 0:
                    path = self.save(self.cfg.checkpoint.save)
                    log.print(f" saved checkpoint {path}")
            if self.cfg.checkpoint.save and (not self.cfg.checkpoint.save_interval or self.iteration % self.cfg.checkpoint.save_interval):
                path = self.save(self.cfg.checkpoint.save)
                log.print(f" saved checkpoint {path}")
            if self.predicted_step_s is not None and len(self.history) > 1:
                measured = sorted(r["step_time_s"] for r in self.history[1:])[len(self.history[1:]) // 2]
                log.print(f" step time: planner predicted {self.predicted_step_s:.4g} s, measured "
                          f"median {measured:.4g} s ({100 * (self.predicted_step_s / measured - 1):+.0f}%)")
            if lg.timeline:
                self.write_timeline()
                log.print(f" wrote timeline {lg.timeline}")
        finally:
            log.close()
        return self.history


def resolve_vocab(cfg: LoomConfig) -> LoomConfig:
    """Take V from the dataset's stored tokenizer (or the checkpoint) when not given."""
    if cfg.model.vocab_size is None and cfg.data.data_path and not cfg.data.mock_data:
        from loom.data.preprocess import read_meta
        cfg.model.vocab_size = int(read_meta(cfg.data.data_path)["vocab_size"])
    if cfg.model.vocab_size is None and cfg.checkpoint.load:
        from loom.checkpoint import latest_checkpoint, read_common
        ckpt = latest_checkpoint(cfg.checkpoint.load)
        if ckpt:
            cfg.model.vocab_size = read_common(ckpt)["config"]["vocab_size"]
    if cfg.model.vocab_size is None:
        raise ConfigError("vocabulary size unknown: give --data-path PREFIX (preprocessed with "
                          "`loom preprocess`) or --mock-data --vocab-size V")
    return cfg
