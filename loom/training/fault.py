"""Failure drills and hang detection.

``--inject-fault RANK:ITERATION:KIND`` makes global rank RANK fail when it starts iteration
ITERATION: ``kill`` (SIGKILL, as a lost node), ``hang`` (stops making progress, as a stuck
collective) or ``exception``. It fires once per job: not again in a round restarted by
``torchrun --max-restarts`` (``TORCHELASTIC_RESTART_COUNT`` > 0).

``--hang-timeout-s T``: a watchdog thread per rank; when the rank has made no progress for T
seconds it writes which rank, iteration and phase it was in, plus every thread's Python stack
(``faulthandler``), and exits with :data:`HANG_EXIT_CODE`, so torchrun restarts the job instead
of the job hanging until a human notices. (On GPUs, also set ``TORCH_NCCL_TRACE_BUFFER_SIZE`` to
get NCCL's flight recorder dump; it does not exist for gloo.)
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Optional

from loom.config.fault_spec import parse_fault

HANG_EXIT_CODE = 3


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
                self.stream.flush()
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
        if f is None or f.iteration != iteration:
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
