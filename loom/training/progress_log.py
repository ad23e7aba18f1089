"""``--log-progress``: ``progress.txt`` in the ``--save`` directory, Megatron-LM's job log
(``append_to_progress_log`` and ``compute_throughputs_and_append_to_progress_log`` in
megatron/training/training.py), one tab-separated line per event, appended by global rank 0::

    2026-01-05 10:00:00<TAB>Job ID: 123<TAB># GPUs: 8<TAB>Starting job
    2026-01-05 10:20:00<TAB>Job ID: 123<TAB># GPUs: 8<TAB>Saved checkpoint<TAB>Iteration: 100<TAB>
        Job throughput: 151.2 TFLOP/s/GPU<TAB>Cumulative throughput: 149.8 TFLOP/s/GPU<TAB>
        Floating-point operations: 1.45e+18<TAB>Tokens (in billions): 0.41

(the second line is one line; an ``--async-save`` still being written says ``Saving async
checkpoint``). The time is local, to the second; the job id is ``$SLURM_JOB_ID`` (empty
elsewhere); ``# GPUs`` is the world size.

- Floating-point operations: of all the iterations trained so far, this job's and the ones
  before it: consumed samples x model FLOPs per sample (:func:`loom.planner.flops.
  model_flops_per_iteration`, KOR eq. 7, forward and backward, no recompute; Megatron keeps
  its own count in the checkpoint, loom derives it from the consumed samples it keeps there).
- Job throughput: this job's FLOPs / (seconds since the job started x GPUs) / 1e12, the start
  being that of :func:`loom.training.builder.build_training` (set-up and the checkpoint load
  included, as Megatron's).
- Cumulative throughput: the FLOPs since the first ``Starting job`` line of the latest run of
  lines with this world size / (seconds since that line x GPUs) / 1e12; its FLOPs at start are
  those of the last ``Saved checkpoint`` line before it (0 without one), as Megatron reads the
  file.
- Tokens: consumed samples x ``--seq-length`` / 1e9.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import Optional

PROGRESS_FILE = "progress.txt"
STAMP = "%Y-%m-%d %H:%M:%S"


def progress_line(text: str, world_size: int, now: Optional[datetime] = None,
                  job_id: Optional[str] = None) -> str:
    """One line of ``progress.txt`` (with its newline): time, job id, GPUs, ``text``."""
    now = now or datetime.now()
    job = os.environ.get("SLURM_JOB_ID", "") if job_id is None else job_id
    return f"{now.strftime(STAMP)}\tJob ID: {job}\t# GPUs: {world_size}\t{text}\n"


def _value(token: str) -> str:
    return token.split(": ", 1)[1]


def cumulative_start(lines: list[str], world_size: int) -> Optional[tuple[datetime, float]]:
    """``(time, FLOPs at that time)`` of the first ``Starting job`` line of the latest run of
    consecutive lines with ``world_size`` GPUs, the FLOPs being the last ``Saved checkpoint``
    line's before it (0 without one); None when there is no such line. Lines that do not
    parse (edited by hand) are skipped."""
    start: Optional[tuple[datetime, float]] = None
    latest = 0.0
    for line in lines:
        tokens = line.rstrip("\n").split("\t")
        try:
            gpus, when = int(_value(tokens[2])), datetime.strptime(tokens[0], STAMP)
            if tokens[3] == "Saved checkpoint":
                latest = float(_value(tokens[7]))
        except (IndexError, ValueError):
            continue
        if gpus != world_size:  # another world size: the cumulative count restarts
            start = None
        elif tokens[3] == "Starting job" and start is None:
            start = (when, latest)
    return start


class ProgressLog:
    """The ``progress.txt`` of one job (see the module docstring) in ``save_dir``, written when
    ``enabled`` (global rank 0): ``world_size`` GPUs, ``flops_per_sample`` model FLOPs of one
    sample, ``seq_length`` tokens per sample; ``started``: the job's start (``time.time()``,
    default now)."""

    def __init__(self, save_dir: str, world_size: int, flops_per_sample: float,
                 seq_length: int, enabled: bool = True, started: Optional[float] = None):
        self.path = os.path.join(save_dir, PROGRESS_FILE)
        self.world_size, self.flops_per_sample = world_size, flops_per_sample
        self.seq_length, self.enabled = seq_length, enabled
        self.started = time.time() if started is None else started
        self.flops_at_start = 0.0

    def _append(self, text: str) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(progress_line(text, self.world_size))

    def start(self, consumed_samples: int) -> None:
        """``Starting job``, the run having trained ``consumed_samples`` samples before it (a
        resumed run: its checkpoint's)."""
        self.flops_at_start = consumed_samples * self.flops_per_sample
        if self.enabled:
            self._append("Starting job")

    def saved(self, iteration: int, consumed_samples: int, in_flight: bool = False) -> str:
        """The line of a checkpoint of ``iteration`` (``consumed_samples`` trained on) just
        saved (``in_flight``: an ``--async-save`` still writing); returns its text (empty, and
        nothing read or written, on the other ranks)."""
        if not self.enabled:
            return ""
        flops = consumed_samples * self.flops_per_sample
        gpus = self.world_size * 1e12
        job = (flops - self.flops_at_start) / (max(time.time() - self.started, 1e-6) * gpus)
        lines = []
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as fh:
                lines = fh.readlines()
        first = cumulative_start(lines, self.world_size)
        when, flops0 = first if first is not None else \
            (datetime.fromtimestamp(self.started), self.flops_at_start)
        elapsed = max((datetime.now() - when).total_seconds(), 1e-6)
        cumulative = (flops - flops0) / (elapsed * gpus)
        text = (f"{'Saving async checkpoint' if in_flight else 'Saved checkpoint'}\t"
                f"Iteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
                f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
                f"Floating-point operations: {flops:.2e}\t"
                f"Tokens (in billions): {consumed_samples * self.seq_length / 1e9:.2f}")
        self._append(text)
        return text
