"""What a user sees every ``--log-interval``: console line, JSON lines, TensorBoard, progress bar.

Throughput: tokens/s = B s / step time; TFLOP/s per rank = model FLOPs per iteration
(:mod:`loom.planner.flops`, KOR eq. 7) / step time / ranks; MFU = that / peak FLOP/s per rank.
"""

from __future__ import annotations

import json
import os
import resource
import sys
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


class MetricsLogger:
    """Writes metrics on rank 0 only; all other ranks hold a silent logger."""

    def __init__(self, enabled: bool, log_json: Optional[str] = None,
                 tensorboard_dir: Optional[str] = None, total_iters: int = 0,
                 progress_bar: bool = True):
        self.enabled = enabled
        self.json_file = None
        self.tb = None
        self.bar = None
        if not enabled:
            return
        if log_json:
            os.makedirs(os.path.dirname(os.path.abspath(log_json)), exist_ok=True)
            self.json_file = open(log_json, "a", buffering=1)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(tensorboard_dir)
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total_iters, desc="train", dynamic_ncols=True, leave=False)

    def print(self, line: str) -> None:
        if not self.enabled:
            return
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
                f" iteration {it:>6d} | loss {record['loss']:.4f} | lr {record['lr']:.3e} | "
                f"grad norm {record['grad_norm']:.3f} | tokens/s {record['tokens_per_s']:,.0f} | "
                f"TFLOP/s/rank {record['tflops_per_rank']:.3f} | "
                f"MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | "
                f"step {1000 * record['step_time_s']:.0f} ms | "
                f"peak mem {record['peak_memory_bytes'] / 2**20:,.0f} MiB"
                + (f" | moe aux {record['moe_aux_loss']:.4f} | expert load "
                   f"{record['moe_load_min']:.0f}-{record['moe_load_max']:.0f} (max/mean "
                   f"{record['moe_load_imbalance']:.2f})" if "moe_aux_loss" in record else ""))
        else:
            self.print(f" validation at iteration {it:>6d} | loss {record['valid_loss']:.4f} | "
                       f"perplexity {record['valid_ppl']:.2f}")
        if self.json_file:
            self.json_file.write(json.dumps({"kind": kind, **record}) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "iteration" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{kind}/{k}", v, it)

    def close(self) -> None:
        for h in (self.json_file, self.tb, self.bar):
            if h is not None:
                h.close()
