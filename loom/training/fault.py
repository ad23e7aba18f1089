"""Failure drills and hang detection.

``--inject-fault RANK:ITERATION:KIND`` makes global rank RANK fail when it starts iteration
ITERATION: ``kill`` (SIGKILL, as a lost node), ``hang`` (stops making progress, as a stuck
collective) or ``exception``; ``kill-in-save`` SIGKILLs it in the middle of the checkpoint of
iteration ITERATION (its own files written, the checkpoint not yet renamed: the previous one
must stay the latest). It fires once per job: not again in a round restarted by
``torchrun --max-restarts`` (``TORCHELASTIC_RESTART_COUNT`` > 0).

``--hang-timeout-s T``: a watchdog thread per rank; when the rank has made no progress for T
seconds it writes which rank, iteration and phase it was in, plus every thread's Python stack
(``faulthandler``), and exits with :data:`HANG_EXIT_CODE`, so torchrun restarts the job instead
of the job hanging until a human notices. On NCCL, PyTorch's flight recorder is switched on
before the process group starts (``loom.parallel.mesh.flight_recorder_env``, unless the user set
its variables)
and the watchdog writes its dump (the last collectives of every process group, with their
state) next to the report, :func:`dump_flight_recorder`; gloo has no flight recorder.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

from loom.config.fault_spec import parse_fault

HANG_EXIT_CODE = 3
HANG_GRACE_S = 3.0  # seconds a rank that detected a hang waits before exiting


def restart_count() -> int:
    """How many times torchrun restarted this job (0 in the first round)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class Progress:
    """What this rank is doing: iteration and phase, and when it last moved."""

    def __init__(self):
        self.iteration, self.phase = 0, "start-up"
        self.stamp = time.monotonic()

    def mark(self, iteration: int, phase: str) -> None:
        self.iteration, self.phase, self.stamp = iteration, phase, time.monotonic()


def dump_flight_recorder(rank: int, directory: str = ".") -> Optional[str]:
    """Write this rank's NCCL flight-recorder trace to ``DIR/loom_nccl_trace_rank{rank}.pkl``
    (pickle, readable with ``python -m torch.distributed.flight_recorder.fr_trace``); returns
    the path, or None without CUDA / NCCL / a recorder (gloo, CPU)."""
    import torch
    if not torch.cuda.is_available():
        return None
    try:
        from torch._C._distributed_c10d import _dump_nccl_trace
        data = _dump_nccl_trace()
    except (ImportError, RuntimeError, AttributeError):
        return None
    path = os.path.join(directory, f"loom_nccl_trace_rank{rank}.pkl")
    with open(path, "wb") as fh:
        fh.write(data)
    return path


class HangWatchdog(threading.Thread):
    """Exits the process (code :data:`HANG_EXIT_CODE`) after ``timeout_s`` seconds without
    progress, reporting rank, iteration, phase and every thread's stack on ``stream``."""

    def __init__(self, progress: Progress, timeout_s: float, rank: int, stream=None):
        super().__init__(name="loom-hang-watchdog", daemon=True)
        self.progress, self.timeout_s, self.rank = progress, timeout_s, rank
        self.stream = stream or sys.stderr
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self.progress.stamp
            if idle > self.timeout_s:
                p = self.progress
                self.stream.write(
                    f"loom: hang detected: rank {self.rank} made no progress for {idle:.0f} s "
                    f"(--hang-timeout-s {self.timeout_s:g}) in iteration {p.iteration}, phase "
                    f"{p.phase}; exiting with status {HANG_EXIT_CODE} so the launcher can "
                    f"restart the job. Python stacks of rank {self.rank}:\n")
                self.stream.flush()
                faulthandler.dump_traceback(file=self.stream, all_threads=True)
                trace = dump_flight_recorder(self.rank)
                if trace:
                    self.stream.write(f"loom: NCCL flight recorder of rank {self.rank}: {trace}\n")
                self.stream.flush()
                # the other ranks' watchdogs fire within a poll of this one (they stopped at the
                # same iteration): give them time to report before the launcher kills them
                time.sleep(HANG_GRACE_S)
                os._exit(HANG_EXIT_CODE)

    def stop(self) -> None:
        self.stopped.set()


class FaultTolerance:
    """The trainer's hooks: progress marks, the watchdog, the injected fault."""

    def __init__(self, rank: int, inject: Optional[str], hang_timeout_s: Optional[float]):
        self.rank = rank
        spec = parse_fault(inject)
        self.fault = spec if spec is not None and spec.rank == rank and restart_count() == 0 \
            else None
        self.progress = Progress()
        self.watchdog = HangWatchdog(self.progress, hang_timeout_s, rank) if hang_timeout_s \
            else None

    def start(self) -> None:
        if self.watchdog is not None and not self.watchdog.is_alive():
            self.watchdog.start()

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def mark(self, iteration: int, phase: str) -> None:
        self.progress.mark(iteration, phase)

    def before_iteration(self, iteration: int) -> None:
        """Mark progress, and fire the injected fault when this is its rank and iteration."""
        self.mark(iteration, "forward-backward")
        f = self.fault
        if f is None or f.iteration != iteration or f.kind == "kill-in-save":
            return
        self.fault = None
        print(f"loom: --inject-fault {f.rank}:{f.iteration}:{f.kind} fires on rank {self.rank}",
              file=sys.stderr, flush=True)
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "hang":
            while True:  # no progress from here on; the watchdog (or a human) ends it
                time.sleep(1.0)
        raise RuntimeError(f"injected fault (--inject-fault) on rank {self.rank} at iteration "
                           f"{iteration}")


    def save_hook(self, iteration: int) -> Optional[Callable[[], None]]:
        """What the checkpoint writer calls once this rank's files of ``iteration`` are written:
        the ``kill-in-save`` drill's SIGKILL, or None."""
        f = self.fault
        if f is None or f.kind != "kill-in-save" or f.iteration != iteration:
            return None
        self.fault = None

        def kill() -> None:
            print(f"loom: --inject-fault {f.rank}:{f.iteration}:{f.kind} fires on rank "
                  f"{self.rank} (its checkpoint files written, before the rename)",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return kill


class CheckpointInterval:
    """When to save: every ``--save-interval N`` iterations, or ``auto``: Daly's optimal
    interval (Daly 2006 eq. 37; Young's ``sqrt(2 delta M)`` to first order) from the blocking
    save time delta and the job's MTBF M, converted to iterations with the measured step time.
    Before the first save, delta is estimated from this rank's checkpoint bytes at
    ``EST_WRITE_BYTES_PER_S``; after each save it is the measured (slowest rank's) time."""

    EST_WRITE_BYTES_PER_S = 1e9  # the planner's default checkpoint write bandwidth per GPU

    def __init__(self, setting, mtbf_s: Optional[float], state_bytes: int):
        self.fixed = setting if isinstance(setting, int) else None
        self.auto = setting == "auto"
        self.mtbf_s, self.state_bytes = mtbf_s, state_bytes
        self.every: Optional[int] = self.fixed
        self.save_s: Optional[float] = None
        self.last_save = 0
        self.message: Optional[str] = None

    def due(self, iteration: int, step_s: float) -> bool:
        """Whether to save after ``iteration`` (``step_s``: its slowest-rank step time)."""
        if self.auto and self.every is None:
            self.message = self.plan(step_s)
        return bool(self.every) and iteration - self.last_save >= self.every

    def take_message(self) -> Optional[str]:
        """The line stating a newly planned interval and its inputs, once."""
        msg, self.message = self.message, None
        return msg

    def plan(self, step_s: float) -> str:
        """(Re)compute the auto interval; returns the line that states it and its inputs."""
        from loom.planner.reliability import daly_interval, young_interval
        measured = self.save_s is not None
        save_s = self.save_s if measured else self.state_bytes / self.EST_WRITE_BYTES_PER_S
        interval_s = daly_interval(save_s, self.mtbf_s)
        self.every = max(1, round(interval_s / max(step_s, 1e-9)))
        return (f"--save-interval auto: every {self.every} iterations = Daly's {interval_s:.3g} s "
                f"(Young {young_interval(save_s, self.mtbf_s):.3g} s) from job MTBF "
                f"{self.mtbf_s / 3600:.3g} h, save time {save_s:.3g} s "
                f"({'measured' if measured else 'estimated'}), step {step_s:.3g} s")

    def saved(self, iteration: int, save_s: float, step_s: float) -> Optional[str]:
        """Record a save (its slowest-rank blocking time); re-plans when auto."""
        self.last_save, self.save_s = iteration, save_s
        if self.auto:
            self.message = self.plan(step_s)
        return self.take_message()
