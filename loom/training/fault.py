"""Failure drills and hang detection.

``--inject-fault RANK:ITERATION:KIND`` makes global rank RANK fail when it starts iteration
ITERATION: ``kill`` (SIGKILL, as a lost node), ``hang`` (stops making progress, as a stuck
collective) or ``exception``; ``kill-in-save`` SIGKILLs it in the middle of the checkpoint of
iteration ITERATION (its own files written, the checkpoint not yet renamed: the previous one
must stay the latest). It fires once per job: not again in a round restarted by
``torchrun --max-restarts`` (``TORCHELASTIC_RESTART_COUNT`` > 0).

``stop`` SIGSTOPs it (a frozen process: no heartbeat, no watchdog of its own).

``--hang-timeout-s T``: a watchdog thread per rank publishes the rank's progress (iteration,
phase, time) through the job's store every poll (:class:`Heartbeats`); when the rank has made
no progress for T seconds it names the rank that stopped (:func:`find_laggards`: the one whose
heartbeat went silent, or that is behind), where it waited itself, and exits with
:data:`HANG_EXIT_CODE`, so torchrun restarts the job instead of the job hanging until a human
notices; the laggard, when it can still run, writes every thread's Python stack
(``faulthandler``). Without a watchdog, ``--distributed-timeout-minutes`` ends a collective
that waits for a stopped rank (every process group loom makes carries it). On NCCL, PyTorch's flight recorder is switched on
before the process group starts (``loom.parallel.mesh.flight_recorder_env``, unless the user set
its variables)
and the watchdog writes its dump (the last collectives of every process group, with their
state) next to the report, :func:`dump_flight_recorder`; gloo has no flight recorder.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

from loom.config.fault_spec import parse_fault
from loom.training.signals import SignalExit, parent_gone, under_launcher

HANG_EXIT_CODE = 3
HANG_GRACE_S = 3.0  # seconds a rank that detected a hang waits before exiting
INJECTED_HANG = "injected hang"  # the phase of a rank hung by --inject-fault R:N:hang


def restart_count() -> int:
    """How many times torchrun restarted this job (0 in the first round)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class Progress:
    """What this rank is doing: iteration and phase, and when it last moved (monotonic and wall
    clock: the wall time is what other ranks compare)."""

    def __init__(self):
        self.iteration, self.phase = 0, "start-up"
        self.stamp, self.wall = time.monotonic(), time.time()

    def mark(self, iteration: int, phase: str) -> None:
        self.iteration, self.phase = iteration, phase
        self.stamp, self.wall = time.monotonic(), time.time()


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


class Heartbeats:
    """Progress heartbeats of every rank through the c10d store of the job (torchrun's
    ``MASTER_ADDR:MASTER_PORT``): each rank's watchdog thread publishes ``{iteration, phase,
    mark, sent, host, pid}`` every poll, also while the main thread waits in a collective. A
    rank that stopped (SIGSTOP, a native hang holding the GIL, a dead host) stops publishing,
    so the ranks waiting for it can name it. Its own client connection with a short timeout,
    so a store that went away never blocks the watchdog. ``store``: any ``dist.Store`` (tests)."""

    STORE_TIMEOUT_S = 5.0

    def __init__(self, rank: int, world_size: int, store=None):
        self.rank, self.world_size, self.store = rank, world_size, store
        self.host = socket.gethostname()

    @classmethod
    def from_env(cls, rank: int, world_size: int) -> Optional["Heartbeats"]:
        """A client of torchrun's store (None with one rank, outside torchrun, or when the
        store cannot be reached)."""
        if world_size < 2 or "MASTER_ADDR" not in os.environ:
            return None
        import datetime

        import torch.distributed as dist
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=cls.STORE_TIMEOUT_S))
        except (RuntimeError, ValueError, KeyError, OSError):
            return None
        prefix = f"loom/heartbeat/restart_{restart_count()}/"
        return cls(rank, world_size, dist.PrefixStore(prefix, store))

    def publish(self, progress: Progress) -> None:
        beat = {"iteration": progress.iteration, "phase": progress.phase, "mark": progress.wall,
                "sent": time.time(), "host": self.host, "pid": os.getpid()}
        try:
            self.store.set(f"rank{self.rank}", json.dumps(beat))
        except (RuntimeError, OSError):  # the store is gone: the report says less, nothing hangs
            pass

    def read(self) -> dict[int, dict]:
        """``rank -> its last heartbeat`` (ranks that never published are absent)."""
        out = {}
        for r in range(self.world_size):
            try:
                if self.store.check([f"rank{r}"]):
                    out[r] = json.loads(self.store.get(f"rank{r}"))
            except (RuntimeError, OSError, ValueError):
                pass
        return out


def find_laggards(beats: dict[int, dict], world_size: int, now: float,
                  stale_s: float) -> list[int]:
    """The ranks that stopped making progress, from every rank's heartbeat ``beats`` at wall
    time ``now``: those whose heartbeat is missing or older than ``stale_s`` (the process does
    not run); else, of the live ones, those behind the others (a lower iteration), or in a
    phase that is itself the hang (``injected hang``). Empty when no rank stands out."""
    stale = [r for r in range(world_size)
             if r not in beats or now - beats[r]["sent"] > stale_s]
    if stale and len(stale) < world_size:
        return stale
    live = {r: b for r, b in beats.items() if r not in stale} or beats
    if not live:
        return []
    low = min(b["iteration"] for b in live.values())
    behind = [r for r, b in live.items() if b["iteration"] == low]
    if len(behind) < len(live):
        return sorted(behind)
    return sorted(r for r, b in live.items() if b["phase"] == INJECTED_HANG)


def _stopped(pid: int) -> bool:
    """Whether local process ``pid`` is stopped (SIGSTOP; Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class HangWatchdog(threading.Thread):
    """Exits the process (code :data:`HANG_EXIT_CODE`) after ``timeout_s`` seconds without
    progress. The report names the rank that stopped making progress (:func:`find_laggards`
    over the store's :class:`Heartbeats`), not only the ranks waiting for it: a waiting rank
    writes one line naming the laggard and where it waited; the laggard itself (when it can
    still run) writes its iteration, phase and every thread's stack. A laggard stopped on this
    host (SIGSTOP) is ended with it (:meth:`end_stopped`)."""

    def __init__(self, progress: Progress, timeout_s: float, rank: int, stream=None,
                 heartbeats: Optional[Heartbeats] = None,
                 on_parent_gone: Optional[Callable[[], bool]] = None):
        super().__init__(name="loom-hang-watchdog", daemon=True)
        self.progress, self.timeout_s, self.rank = progress, timeout_s, rank
        self.stream = stream or sys.stderr
        self.stopped = threading.Event()
        self.heartbeats = heartbeats
        self.on_parent_gone = on_parent_gone
        self.poll_s = min(1.0, timeout_s / 4)

    def run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            if self.heartbeats is not None:
                self.heartbeats.publish(self.progress)
            if self.on_parent_gone is not None and self.on_parent_gone():
                self.stream.write(f"loom: rank {self.rank}: the torchrun agent is gone; "
                                  f"exiting\n")
                self.stream.flush()
                os._exit(128 + signal.SIGTERM)
            idle = time.monotonic() - self.progress.stamp
            if idle > self.timeout_s:
                lag, beats = self.report(idle)
                # the other ranks' watchdogs fire within a poll of this one (they stopped at
                # the same iteration): give them time to report before the launcher kills them
                time.sleep(HANG_GRACE_S)
                self.end_stopped(lag, beats)
                os._exit(HANG_EXIT_CODE)
                return  # reached only where os._exit is replaced (a test): fire once

    def end_stopped(self, lag: list[int], beats: dict[int, dict]) -> None:
        """SIGKILL the laggards stopped on this host (SIGSTOP), as this rank exits: a stopped
        process cannot act on the launcher's SIGTERM, which would wait its full grace period
        (30 s) before the same SIGKILL; it cannot save anything either."""
        for r in lag:
            b = beats.get(r)
            if r != self.rank and b is not None and b["host"] == socket.gethostname() \
                    and _stopped(b["pid"]):
                self.stream.write(f"loom: rank {self.rank}: ending rank {r} (pid {b['pid']}), "
                                  f"stopped on this host\n")
                self.stream.flush()
                os.kill(b["pid"], signal.SIGKILL)

    def laggards(self) -> tuple[list[int], dict[int, dict]]:
        if self.heartbeats is None:
            return [], {}
        stale_s = max(2.5 * self.poll_s, min(self.timeout_s / 2, 5.0))
        for attempt in range(2):  # a rank stopped just now: its heartbeat turns stale soon
            beats = self.heartbeats.read()
            lag = find_laggards(beats, self.heartbeats.world_size, time.time(), stale_s)
            if lag or attempt:
                return lag, beats
            time.sleep(stale_s)
        return [], {}

    def report(self, idle: float) -> tuple[list[int], dict[int, dict]]:
        """Write the hang report; returns the laggards and the heartbeats read."""
        p, t = self.progress, self.timeout_s
        exiting = f"exiting with status {HANG_EXIT_CODE} so the launcher can restart the job"
        lag, beats = self.laggards()
        others = [r for r in lag if r != self.rank]
        if others and self.rank not in lag:
            now, parts = time.time(), []
            for r in others:
                b = beats.get(r)
                if b is None:
                    parts.append(f"rank {r} (no heartbeat at all)")
                    continue
                parts.append(f"rank {r} (last heartbeat {now - b['sent']:.0f} s ago, in "
                             f"iteration {b['iteration']}, phase {b['phase']}, pid {b['pid']} "
                             f"on {b['host']})")
            self.stream.write(
                f"loom: hang detected: {', '.join(parts)} stopped making progress; rank "
                f"{self.rank} waited {idle:.0f} s for it (--hang-timeout-s {t:g}) in iteration "
                f"{p.iteration}, phase {p.phase}; {exiting}\n")
            self.stream.flush()
            return lag, beats
        self.stream.write(
            f"loom: hang detected: rank {self.rank} made no progress for {idle:.0f} s "
            f"(--hang-timeout-s {t:g}) in iteration {p.iteration}, phase {p.phase}; {exiting}. "
            f"Python stacks of rank {self.rank}:\n")
        self.stream.flush()
        faulthandler.dump_traceback(file=self.stream, all_threads=True)
        trace = dump_flight_recorder(self.rank)
        if trace:
            self.stream.write(f"loom: NCCL flight recorder of rank {self.rank}: {trace}\n")
        self.stream.flush()
        return lag, beats

    def stop(self) -> None:
        """Stop polling and wait for the thread to finish the poll it is in, so that nothing
        it does (a report, an exit) happens after ``stop`` returns."""
        self.stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()


class FaultTolerance:
    """The trainer's hooks: progress marks, the watchdog (with the job's heartbeats), the
    injected fault, the signal handling (:mod:`loom.training.signals`), and the weight-replica
    check (``weight_check``: ``(iteration, say)`` of :func:`loom.training.weight_hash.check`
    bound to the run's model, every ``weight_check_interval`` iterations)."""

    def __init__(self, rank: int, inject: Optional[str], hang_timeout_s: Optional[float],
                 world_size: int = 1, exit_signal_handler: bool = False,
                 weight_check: Optional[Callable[[int, Callable], None]] = None,
                 weight_check_interval: Optional[int] = None, exit_signal: str = "SIGTERM"):
        self.weight_check, self.weight_check_interval = weight_check, weight_check_interval
        self.rank, self.world_size, self.hang_timeout_s = rank, world_size, hang_timeout_s
        spec = parse_fault(inject)
        self.fault = spec if spec is not None and spec.rank == rank and restart_count() == 0 \
            else None
        self.progress = Progress()
        self.watchdog: Optional[HangWatchdog] = None
        self.heartbeats: Optional[Heartbeats] = None
        self.signals = SignalExit(rank, exit_signal_handler, exit_signal=exit_signal)

    def start(self) -> None:
        """Install the signal handlers and start the watchdog (main thread, process group
        up)."""
        self.signals.install()
        if self.hang_timeout_s and self.watchdog is None:
            beats = Heartbeats.from_env(self.rank, self.world_size)
            ppid = self.signals.ppid
            gone = (lambda: parent_gone(ppid)) if under_launcher() else None
            self.watchdog = HangWatchdog(self.progress, self.hang_timeout_s, self.rank,
                                         heartbeats=beats, on_parent_gone=gone)
            self.heartbeats = beats
            if beats is not None:  # at once: a rank stopped before the first poll is named too
                beats.publish(self.progress)
            self.watchdog.start()

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.signals.restore()

    def mark(self, iteration: int, phase: str) -> None:
        self.progress.mark(iteration, phase)
        if self.heartbeats is not None:  # at once: a rank stopped between polls is exact too
            self.heartbeats.publish(self.progress)

    def stop_requested(self, all_reduce_max: Callable[[list[float]], list[float]]) \
            -> Optional[str]:
        """``--exit-signal-handler``: the name of the signal some rank received (every rank
        calls this at the end of each iteration; one all-reduce), else None."""
        return self.signals.agreed(all_reduce_max)

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
        elif f.kind == "stop":  # as a rank frozen by the OS or a debugger: no heartbeat either
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        elif f.kind == "hang":
            self.mark(iteration, INJECTED_HANG)
            while True:  # no progress from here on; the watchdog (or a human) ends it
                time.sleep(1.0)
        raise RuntimeError(f"injected fault (--inject-fault) on rank {self.rank} at iteration "
                           f"{iteration}")

    def check_weights(self, iteration: int, say: Callable[[str], None],
                      first: bool = False) -> None:
        """``--check-weight-hash-across-dp-replicas-interval``: compare the weights' replicas
        before training (``first``) and after every interval-th iteration, as Megatron; raises
        :class:`loom.training.weight_hash.WeightHashMismatch`. Collective when due."""
        n = self.weight_check_interval
        if self.weight_check is not None and n and (first or iteration % n == 0):
            self.mark(iteration, "weight-hash-check")
            self.weight_check(iteration, say)

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
        if self.fixed:  # Megatron: iterations divisible by N, also after a resume
            return iteration % self.fixed == 0
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
