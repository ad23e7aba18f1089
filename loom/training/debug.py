"""What a run produces for debugging throughput, memory and reproducibility (docs/debugging.md):
Megatron-LM's ``--profile`` (nsys capture range, or ``--use-pytorch-profiler``'s Chrome trace),
``--record-memory-history`` (CUDA allocator snapshots), ``--log-memory-to-tensorboard``, the
timers (:mod:`loom.training.timers`) and ``--deterministic-mode``. A flag that asks for an
output loom cannot give on this device says so in one line at start (:attr:`RunDebug.notes`),
never nothing.

Iteration numbers are the logged ones (the first iteration of a fresh run is 1).
``--use-pytorch-profiler`` records iterations ``--profile-step-start`` to
``--profile-step-end`` - 1 (Megatron's ``torch.profiler.schedule``: wait start - 1, warm-up 1,
active end - start; counted from the resumed iteration, not from this process's first step);
the nsys range starts before iteration start + 1 and stops after iteration end (Megatron's).
"""

from __future__ import annotations

import contextlib

import os
from typing import Callable, Optional

import torch

from loom.config.debug_flags import DETERMINISM_ENV, parse_ranks
from loom.training.timers import Timers

MEMORY_STATS = {"mem-reserved-bytes": "reserved_bytes.all.current",
                "mem-allocated-bytes": "allocated_bytes.all.current",
                "mem-max-allocated-bytes": "allocated_bytes.all.peak",
                "mem-allocated-count": "allocation.all.current"}
"""``--log-memory-to-tensorboard``: TensorBoard tag -> ``torch.cuda.memory_stats()`` key
(Megatron's ``training_log``)."""


def enable_determinism(env) -> None:
    """``--deterministic-mode``: :data:`~loom.config.debug_flags.DETERMINISM_ENV` into ``env``
    where not set (before any cuBLAS handle or NCCL communicator exists),
    ``torch.use_deterministic_algorithms(True)`` and ``cudnn.benchmark`` off. Process-wide, as
    Megatron's: a training process is one run."""
    for k, v in DETERMINISM_ENV.items():
        env.setdefault(k, v)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def profile_dir(tensorboard_dir: Optional[str]) -> str:
    """Where ``--use-pytorch-profiler`` writes ``rank-N.json.gz``: ``torch_profile`` beside
    ``--tensorboard-dir`` (Megatron's ``{tensorboard_dir}/../torch_profile``), else
    ``./torch_profile``."""
    if tensorboard_dir:
        return os.path.normpath(os.path.join(tensorboard_dir, "..", "torch_profile"))
    return "torch_profile"


def snapshot_path(path: str, rank: int, oom: bool = False) -> str:
    """``--memory-snapshot-path`` of ``rank``: ``BASE_RANK.EXT`` (``BASE_oom_rank_RANK.EXT``
    for the out-of-memory dump), Megatron's names."""
    base, ext = os.path.splitext(path)
    return f"{base}_oom_rank_{rank}{ext}" if oom else f"{base}_{rank}{ext}"


class RunDebug:
    """One rank's debugging outputs under ``cfg`` (a resolved LoomConfig): ``timers``, the
    profiler, the memory history. Built before the model (the memory history then sees every
    allocation); the trainer calls :meth:`start`, :meth:`before_iteration`,
    :meth:`after_iteration`, :meth:`logged` and :meth:`stop`."""

    def __init__(self, cfg, rank: int, world_size: int, device: torch.device):
        lg = cfg.logging
        self.cfg, self.rank, self.device = cfg, rank, device
        self.timers = Timers(lg.timing_log_level, lg.timing_log_option, device,
                             not lg.no_barrier_with_level_1_timing)
        ranks = parse_ranks(lg.profile_ranks, world_size)
        self.profiled = not ranks or rank in ranks  # Megatron: [] is every rank
        self.notes: list[str] = []
        self.prof = None
        self.nsys_on = False
        self.say: Callable[[str], None] = lambda line: None
        self.recording = False
        cuda = device.type == "cuda"
        if lg.profile and not lg.use_pytorch_profiler and not cuda:
            self.notes.append(f"--profile without --use-pytorch-profiler is Megatron's nsys "
                              f"capture range (cudaProfilerStart/Stop) and needs CUDA: nothing "
                              f"is captured on {device.type}; add --use-pytorch-profiler for a "
                              f"torch.profiler trace")
        if lg.record_memory_history and not cuda:
            self.notes.append(f"--record-memory-history needs CUDA (it records the CUDA caching "
                              f"allocator): no snapshot on {device.type}; the peak resident "
                              f"memory is logged as 'peak mem' at every --log-interval")
        if lg.log_memory_to_tensorboard and not cuda:
            self.notes.append(f"--log-memory-to-tensorboard writes CUDA allocator statistics: "
                              f"none on {device.type}; the peak resident memory is logged as "
                              f"train/peak_memory_bytes")
        for name in ("log_memory_to_tensorboard", "log_timers_to_tensorboard",
                     "log_world_size_to_tensorboard"):
            if getattr(lg, name) and not lg.tensorboard_dir:
                self.notes.append(f"--{name.replace('_', '-')} without --tensorboard-dir: "
                                  f"nothing written (give --tensorboard-dir DIR)")
        if lg.record_memory_history and cuda and self.profiled:
            self._record_memory()
        self.straggler = None
        if lg.log_straggler:  # --log-straggler (loom.training.straggler)
            from loom.training.straggler import StragglerDetector
            self.straggler = StragglerDetector(rank, world_size, device,
                                               lg.straggler_minmax_count,
                                               not lg.disable_straggler_on_startup,
                                               lg.straggler_ctrlr_port)
            self.notes += self.straggler.notes

    def batch_timer(self):
        """The context timing a batch fetch: the ``batch-generator`` timer and, with
        ``--log-straggler``, the detector's batch time."""
        if self.straggler is None:
            return self.timers("batch-generator")
        stack = contextlib.ExitStack()
        stack.enter_context(self.timers("batch-generator"))
        stack.enter_context(self.straggler.timing("batch"))
        return stack

    # -- memory history ---------------------------------------------------------------------
    def _record_memory(self) -> None:
        """Record allocator events (100,000 of them, with stacks) from now on, and dump a
        snapshot when the allocator runs out of memory (Megatron's
        ``start_memory_history_recording``)."""
        torch.cuda.memory._record_memory_history(max_entries=100_000, device=self.device)
        self.recording = True
        oom_path = snapshot_path(self.cfg.logging.memory_snapshot_path, self.rank, oom=True)

        def on_oom(device, alloc, device_alloc, device_free):
            _dump(oom_path)
            print(f"loom: rank {self.rank} out of memory: memory snapshot {oom_path}",
                  flush=True)
        torch._C._cuda_attach_out_of_memory_observer(on_oom)

    def dump_snapshot(self) -> Optional[str]:
        """Write the memory snapshot of this rank (when recording); its path."""
        if not self.recording:
            return None
        path = snapshot_path(self.cfg.logging.memory_snapshot_path, self.rank)
        _dump(path)
        return path

    # -- the loop -----------------------------------------------------------------------------
    def start(self, say: Callable[[str], None], iteration: int, last: int) -> None:
        """Print the notes (``say``: rank 0's printer), start the torch profiler for this run's
        iterations ``iteration + 1 .. last``."""
        self.say = say
        for line in self.notes:
            say(f" {line}")
        lg = self.cfg.logging
        if not (lg.profile and lg.use_pytorch_profiler and self.profiled):
            return
        lo, hi = max(lg.profile_step_start, iteration + 1), lg.profile_step_end
        if lo >= hi or lo > last:
            say(f" --profile: iterations {lg.profile_step_start}-{hi - 1} are not in this run "
                f"(iterations {iteration + 1}-{last}): nothing profiled")
            return
        out = profile_dir(lg.tensorboard_dir)
        path = os.path.join(out, f"rank-{self.rank}.json.gz")

        def ready(prof) -> None:
            os.makedirs(out, exist_ok=True)
            prof.export_chrome_trace(path)
            self.say(f" --profile: wrote torch.profiler traces of iterations {lo}-{hi - 1} to "
                     f"{out}/rank-*.json.gz")
        k = lo - iteration  # the profiler's step number of iteration lo
        self.prof = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=k - 1, warmup=1, active=hi - lo, repeat=1),
            on_trace_ready=ready, record_shapes=lg.pytorch_profiler_collect_shapes,
            with_stack=lg.pytorch_profiler_collect_callstack)
        self.prof.start()

    def before_iteration(self, iteration: int) -> None:
        """Before running iteration ``iteration + 1``: the profiler's step; the nsys range
        starts at ``iteration == --profile-step-start``."""
        lg = self.cfg.logging
        if self.prof is not None:
            self.prof.step()
        elif lg.profile and self.profiled and self.device.type == "cuda" and \
                iteration == lg.profile_step_start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self.nsys_on = True

    def after_iteration(self, iteration: int, first: bool) -> None:
        """After iteration ``iteration`` (``first``: this run's first): the profiler and the
        nsys range stop at ``--profile-step-end``; a memory snapshot after the first."""
        if iteration == self.cfg.logging.profile_step_end:
            self._stop_profiler()
        if first:
            self.dump_snapshot()

    def logged(self, iteration: int, iterations: int, step_time_s: float, record) -> None:
        """At a ``--log-interval`` (``iterations`` of them in the window, mean ``step_time_s``):
        the timers' report (a collective over all ranks at level >= 1), TensorBoard timers and
        memory, the memory snapshot. ``record(kind, values, scalars)`` writes a record of
        another kind to the JSON log and ``scalars`` to TensorBoard (rank 0's logger)."""
        lg = self.cfg.logging
        names = self.timers.interval_names()
        if names:
            lines, stats = self.timers.report(names, iterations)
            for line in lines:
                self.say(f" {line}")
            scalars = {f"{n}-time": s["max"] / 1000.0 for n, s in stats.items()} \
                if lg.log_timers_to_tensorboard else {}
            if stats:
                record("timers", {"iteration": iteration, "ms": stats}, scalars)
        if lg.log_timers_to_tensorboard:
            record(None, {"iteration": iteration}, {"iteration-time": step_time_s})
        if lg.log_memory_to_tensorboard and self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            record("memory", {"iteration": iteration},
                   {tag: stats.get(key, 0) for tag, key in MEMORY_STATS.items()})
        if self.straggler is not None:  # a collective: every rank reports
            table = self.straggler.report(iterations, lambda line: self.say(f" {line}"))
            if table is not None:
                record("straggler", {"iteration": iteration, **table}, {})
        self.dump_snapshot()

    def timed_report(self, name: str) -> float:
        """Print the level-0 timer ``name`` (min, max over ranks; a collective); its max in
        seconds."""
        lines, stats = self.timers.report([name])
        for line in lines:
            self.say(f" {line}")
        return stats[name]["max"] / 1000.0 if name in stats else 0.0

    def stop(self) -> None:
        """End of training (also on an exception): the profiler, the memory recording and the
        straggler detector's controller."""
        self._stop_profiler()
        if self.straggler is not None:
            self.straggler.close()
        if self.recording:
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
            self.recording = False

    def _stop_profiler(self) -> None:
        if self.prof is not None:
            self.prof.stop()  # exports a window cut short, too
            self.prof = None
        if self.nsys_on:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            self.nsys_on = False


def _dump(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.cuda.memory._dump_snapshot(path)
