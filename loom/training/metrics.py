"""What a user sees every ``--log-interval``: console line, JSON lines, TensorBoard, progress bar.

Throughput: tokens/s = B s / step time; TFLOP/s per rank = model FLOPs per iteration
(:mod:`loom.planner.flops`, KOR eq. 7) / step time / ranks; MFU = that / peak FLOP/s per rank.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated accelerator memory, or this process's peak resident set on CPU (bytes).

    On Linux the CPU figure is ``VmHWM`` from ``/proc/self/status``: ``getrusage``'s
    ``ru_maxrss`` carries the parent's high-water mark across fork + exec, so spawned ranks
    would report their launcher's peak.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_flops_per_rank(device: torch.device, override_tflops: Optional[float]) -> Optional[float]:
    """Peak FLOP/s of one rank: ``--peak-tflops`` if given, else the planner's device table."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        try:
            from loom.planner.hardware import peak_flops_per_s
            return peak_flops_per_s(torch.cuda.get_device_name(device))
        except Exception:  # noqa: BLE001 - unknown device: no MFU
            return None
    return None


def average_window(window: list[dict], tokens_per_iter: int, flops_per_iter_per_rank: float,
                   peak_flops: Optional[float]) -> dict:
    """The last record of ``window`` with loss, step time (s), bubble fraction, tokens/s,
    TFLOP/s per rank and MFU averaged over the window's iterations."""
    avg = dict(window[-1])
    for key in ("loss", "step_time_s", "bubble_fraction", "mlm_loss", "sop_loss"):
        if key in avg:
            avg[key] = sum(r[key] for r in window) / len(window)
    avg["tokens_per_s"] = tokens_per_iter / avg["step_time_s"]
    avg["tflops_per_rank"] = flops_per_iter_per_rank / avg["step_time_s"] / 1e12
    avg["mfu"] = avg["tflops_per_rank"] * 1e12 / peak_flops if peak_flops else None
    return avg


@dataclass
class Throughput:
    """The measures of one training run that turn a step time into a record: ``tokens_per_iter``
    (B s), ``flops_per_iter`` (model FLOPs of one iteration, all ranks), ``world_size``,
    ``peak_flops`` (FLOP/s of one rank, None when unknown), ``predicted_step_s`` (the planner's
    iteration time in seconds, None without a prediction), ``logged`` (the ``loss_fn``
    metrics each record carries) and ``batch`` (B samples of ``tokens_per_iter``; a record of
    an iteration of another B, a batch-size ramp's, scales tokens and FLOPs by its share; 0:
    never scaled)."""
    tokens_per_iter: int
    flops_per_iter: float
    world_size: int
    peak_flops: Optional[float] = None
    predicted_step_s: Optional[float] = None
    logged: tuple = ()
    batch: int = 0

    def record(self, iteration: int, loss: float, lr: float, grad_norm: float, elapsed: float,
               device: torch.device, batch: Optional[int] = None) -> dict:
        """One training record: ``tokens_per_s``, ``step_time_s`` (s), ``tflops_per_rank``,
        ``mfu`` (None without a peak) and ``peak_memory_bytes``; on CUDA also
        ``peak_memory_reserved_bytes`` (``torch.cuda.max_memory_reserved``: the caching
        allocator's peak, which ``loom plan --calibrate-from`` fits its reserve on)."""
        share = self._share([batch])
        tflops = self.flops_per_iter * share / elapsed / self.world_size / 1e12
        rec = {"iteration": iteration, "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "tokens_per_s": self.tokens_per_iter * share / elapsed, "step_time_s": elapsed,
               "tflops_per_rank": tflops,
               "mfu": tflops * 1e12 / self.peak_flops if self.peak_flops else None,
               "peak_memory_bytes": peak_memory_bytes(device)}
        if device.type == "cuda":  # what the planner's memory is compared with (the reserve)
            rec["peak_memory_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        return rec

    def average(self, window: list[dict]) -> dict:
        """:func:`average_window` of ``window`` with this run's measures."""
        share = self._share([r.get("batch_size") for r in window])
        return average_window(window, self.tokens_per_iter * share,
                              self.flops_per_iter * share / self.world_size, self.peak_flops)

    def _share(self, batches: list) -> float:
        """Mean B of ``batches`` (None: this run's B) over this run's B ``batch`` (a batch-size
        ramp's iterations hold fewer samples than ``tokens_per_iter`` counts); 1 without one."""
        if not self.batch:
            return 1.0
        return sum(b or self.batch for b in batches) / len(batches) / self.batch


def _clock(seconds: float) -> str:
    """``H:MM:SS`` of a duration in seconds."""
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class MetricsLogger:
    """Writes metrics on rank 0 only; all other ranks hold a silent logger.

    ``config`` (the flat run config) is the first record of ``--log-json`` (``kind: "run"``,
    with the UTC start time, so runs appended to one file are told apart, and ``world_size``)
    and TensorBoard text.
    When stdout is not a terminal (a file, a pipe, a batch job) every iteration line starts
    with the UTC time and ends with the elapsed time and the ETA of the remaining
    ``total_iters`` iterations (or always, with ``timestamps=True``).
    ``log_world_size`` (``--log-world-size-to-tensorboard``): every training record also
    writes Megatron's ``world-size`` scalar (and ``world-size vs samples``) to TensorBoard.
    ``batch_ramp``: the global batch trained on may change during the run or differ from
    ``--global-batch-size`` (a batch-size ramp, ``--decrease-batch-size-if-needed``): each
    iteration line says its ``global batch``, as Megatron's does (and the ``skipped samples``
    of a record that has them).
    """

    def __init__(self, enabled: bool, log_json: Optional[str] = None,
                 tensorboard_dir: Optional[str] = None, total_iters: int = 0,
                 progress_bar: bool = True, config: Optional[dict] = None,
                 start_iteration: int = 0, timestamps: Optional[bool] = None,
                 world_size: Optional[int] = None, log_world_size: bool = False,
                 batch_ramp: bool = False):
        self.enabled, self.world_size, self.batch_ramp = enabled, world_size, batch_ramp
        self.log_world_size = log_world_size and world_size is not None
        self.json_file = None
        self.tb = None
        self.wandb = None
        self.bar = None
        self.start, self.start_iteration, self.total_iters = (time.monotonic(), start_iteration,
                                                              total_iters)
        self.timestamps = (not sys.stdout.isatty()) if timestamps is None else timestamps
        if not enabled:
            return
        header = {"kind": "run", "start_utc": datetime.now(timezone.utc).isoformat(
            timespec="seconds"), "start_iteration": start_iteration, "config": config or {}}
        if world_size is not None:  # with the config: the run's layout (loom plan
            header["world_size"] = world_size  # --calibrate-from reads a --log-json file)
        if log_json:
            os.makedirs(os.path.dirname(os.path.abspath(log_json)), exist_ok=True)
            self.json_file = open(log_json, "a", buffering=1)
            self.json_file.write(json.dumps(header) + "\n")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(tensorboard_dir)
            self.tb.add_text("config", "\n".join(f"    {k}: {v}" for k, v in
                                                  sorted((config or {}).items())), 0)
            hparams = {k: v for k, v in (config or {}).items()
                       if isinstance(v, (bool, int, float, str))}  # the HPARAMS tab
            if hparams:  # into this run's own event file (add_hparams would open another run)
                from torch.utils.tensorboard.summary import hparams as hparams_summaries
                for summary in hparams_summaries(hparams, {}):
                    self.tb.file_writer.add_summary(summary)
        from loom.training.wandb_writer import open_wandb  # --wandb-project, beside TensorBoard
        self.wandb = open_wandb(config)
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total_iters, desc="train", dynamic_ncols=True, leave=False)

    def print(self, line: str) -> None:
        """Print one line on rank 0 (UTC time first when timestamps are on)."""
        if not self.enabled:
            return
        line = self._stamp() + line
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def log(self, record: dict, kind: str = "train") -> None:
        if not self.enabled:
            return
        it = record["iteration"]
        if kind == "train":
            mfu = record.get("mfu")
            self.print(
                f" iteration {it:>6d} | loss {record['loss']:.4f} | "
                f"lr {record['lr']:.3e} | grad norm {record['grad_norm']:.3f} | tokens/s {record['tokens_per_s']:,.0f} | "
                f"TFLOP/s/rank {record['tflops_per_rank']:.3f} | "
                f"MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
                f"step {1000 * record['step_time_s']:.0f} ms | "
                f"peak mem {record['peak_memory_bytes'] / 2**20:,.0f} MiB"
                + (f" | global batch {record['batch_size']}" if self.batch_ramp else "")
                + (f" | bubble {100 * record['bubble_fraction']:.1f}%"
                   if "bubble_fraction" in record else "")
                + (f" | loss scale {record['loss_scale']:g}" if "loss_scale" in record else "")
                + (f" | params norm {record['params_norm']:.3f}" if "params_norm" in record
                   else "")
                + (f" | decoupled lr {record['decoupled_lr']:.3e}" if "decoupled_lr" in record
                   else "")
                + (f" | max attention logit {record['max_attention_logit']:.3f}"
                   if "max_attention_logit" in record else "")
                + (f" | num zeros {record['num_zeros_in_grad']}" if "num_zeros_in_grad" in
                   record else "")
                + (f" | moe aux {record['moe_aux_loss']:.4f} | expert load "
                   f"{record['moe_load_min']:.0f}-{record['moe_load_max']:.0f} (max/mean "
                   f"{record['moe_load_imbalance']:.2f})" if "moe_aux_loss" in record else "")
                + (f" | mlm {record['mlm_loss']:.4f}" if "mlm_loss" in record else "")
                + (f" | sop {record['sop_loss']:.4f}" if "sop_loss" in record else "")
                + (f" | mtp {record['mtp_loss']:.4f}" if "mtp_loss" in record else "")
                + (f" | consumed samples {record['consumed_samples']:,} tokens "
                   f"{record['consumed_tokens']:,}" if "consumed_tokens" in record else "")
                + (f" | skipped samples {record['skipped_samples']:,}"
                   if record.get("skipped_samples") else "")
                + self._eta(it))
        else:
            what = ("validation" if kind == "valid" else kind) + (
                f"-{record['valid_set']}" if "valid_set" in record else "")
            self.print(f" {what} at iteration {it:>6d} | loss "
                       f"{record['valid_loss']:.4f} | perplexity {record['valid_ppl']:.2f}"
                       + (f" | {record['valid_samples']:,} samples" if "valid_samples" in
                          record else ""))
        if self.json_file:
            self.json_file.write(json.dumps({"kind": kind, **record}) + "\n")
        group = f"{kind}-{record['valid_set']}" if "valid_set" in record else kind  # one set
        if self.tb is not None:  # of --multiple-validation-sets: valid-NAME/valid_loss
            samples = record.get("consumed_samples")
            for k, v in record.items():
                if k != "iteration" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{group}/{k}", v, it)
                    if samples is not None and not k.startswith("consumed"):  # Megatron's
                        self.tb.add_scalar(f"{group}/{k} vs samples", v, samples)
            if kind == "train" and self.log_world_size:  # Megatron's training_log tags
                self.tb.add_scalar("world-size", self.world_size, it)
                if samples is not None:
                    self.tb.add_scalar("world-size vs samples", self.world_size, samples)
        if self.wandb is not None:
            self.wandb.log(record, group)

    def event(self, kind: str, record: dict, line: str) -> None:
        """A record that is not an iteration's (``resume``, ``summary``): ``line`` on the
        console, ``{"kind": kind, **record}`` in ``--log-json``, ``line`` as TensorBoard text."""
        if not self.enabled:
            return
        self.print(line)
        if self.json_file:
            self.json_file.write(json.dumps({"kind": kind, **record}) + "\n")
        if self.tb is not None:
            self.tb.add_text(kind, line.strip(), record.get("iteration") or 0)

    def extra(self, kind: Optional[str], record: dict, scalars: Optional[dict] = None) -> None:
        """A record of another ``kind`` (``timers``, ``memory``; None: none) as a line of
        ``--log-json``, and ``scalars`` (``{tag: value}``, Megatron's top-level tags such as
        ``forward-backward-time``) in TensorBoard at ``record["iteration"]``."""
        if not self.enabled:
            return
        if self.json_file and kind is not None:
            self.json_file.write(json.dumps({"kind": kind, **record}) + "\n")
        if self.tb is not None:
            for tag, value in (scalars or {}).items():
                self.tb.add_scalar(tag, value, record["iteration"])

    def _stamp(self) -> str:
        """``[2026-11-22 12:00:00]`` (UTC) when timestamps are on, else empty."""
        if not self.timestamps:
            return ""
        return datetime.now(timezone.utc).strftime("[%Y-%m-%d %H:%M:%S] ")

    def _eta(self, iteration: int) -> str:
        """`` | elapsed H:MM:SS | ETA H:MM:SS`` (mean time per iteration so far x iterations
        left) when timestamps are on, else empty."""
        if not self.timestamps:
            return ""
        elapsed = time.monotonic() - self.start
        done = iteration - self.start_iteration
        left = self.start_iteration + self.total_iters - iteration
        eta = _clock(elapsed / done * left) if done > 0 else "?"
        return f" | elapsed {_clock(elapsed)} | ETA {eta}"

    def close(self) -> None:
        for h in (self.json_file, self.tb, self.bar, self.wandb):
            if h is not None:
                h.close()
