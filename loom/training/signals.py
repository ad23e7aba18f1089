"""How a rank ends when it is told to, or when its launcher is gone.

- SIGTERM / SIGINT (a scheduler's preemption, Ctrl-C, torchrun stopping the job): with
  ``--exit-signal-handler`` (Megatron's flag and meaning, default off) the rank finishes the
  current iteration, every rank learns of the signal in one all-reduce (a signal to one rank
  stops them all at the same iteration), a checkpoint is saved when ``--save`` is set, and the
  job exits 0 after one line. Without the flag (Megatron's default) the signal ends the rank at
  once, no save, with one line on stderr and status ``128 + signal`` (``SystemExit``: cleanup
  runs, no KeyboardInterrupt or gloo traceback). A second signal always ends at once.
- ``--exit-signal`` (Megatron's, default SIGTERM) names the signal the handler saves on. SIGTERM
  or SIGINT: both, as above. Another (SIGUSR1: a scheduler's warning some time before it ends
  the job, ``sbatch --signal=USR1@120``): that one saves and exits; SIGTERM and SIGINT keep
  ending the rank at once (as Megatron, where only the chosen signal is caught).
- The torchrun agent dies (``kill -9``): the ranks are its children, and Linux sends each a
  SIGTERM when the parent goes (``prctl(PR_SET_PDEATHSIG)`` through ctypes); a rank that
  finds its parent already gone at start-up exits too. Without the prctl (other systems) the
  hang watchdog's thread polls the parent pid (:func:`parent_gone`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable, Optional

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False where it cannot
    (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def under_launcher() -> bool:
    """Whether torchrun (torchelastic) started this process."""
    return "TORCHELASTIC_RESTART_COUNT" in os.environ


def parent_gone(original_ppid: int) -> bool:
    """Whether the process that started this one has exited (this one was re-parented)."""
    return os.getppid() != original_ppid


class SignalExit:
    """SIGTERM / SIGINT handling of one training rank (see the module docstring).

    ``graceful``: ``--exit-signal-handler``; ``say``: where the one line goes (stderr);
    ``exit_signal``: ``--exit-signal``'s name (``"SIGUSR1"``)."""

    def __init__(self, rank: int, graceful: bool, say: Optional[Callable[[str], None]] = None,
                 exit_signal: str = "SIGTERM"):
        self.rank, self.graceful = rank, graceful
        chosen = signal.Signals[exit_signal]
        self.saves_on = set(SIGNALS) if chosen in SIGNALS else {chosen}
        """The signals that save and exit under ``--exit-signal-handler``."""
        self.received: Optional[int] = None
        self.previous: dict[int, object] = {}
        self.ppid = os.getppid()
        self.say = say or (lambda m: print(m, file=sys.stderr, flush=True))

    def install(self) -> None:
        """Install the handlers (main thread only) and, under torchrun, the parent-death
        signal. Exits at once when the launcher is already gone."""
        for sig in sorted(set(SIGNALS) | (self.saves_on if self.graceful else set())):
            self.previous[sig] = signal.signal(sig, self._handle)
        if under_launcher():
            set_parent_death_signal(signal.SIGTERM)
            if self.ppid == 1 or parent_gone(self.ppid):
                self.say(f"loom: rank {self.rank}: the torchrun agent that started it is gone; "
                         f"exiting")
                raise SystemExit(128 + signal.SIGTERM)

    def restore(self) -> None:
        for sig, old in self.previous.items():
            signal.signal(sig, old)
        self.previous = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        saves = self.graceful and signum in self.saves_on
        if saves and self.received is None:
            self.received = signum
            return  # the trainer saves and exits at the end of this iteration
        chosen = " or ".join(sorted(signal.Signals(s).name for s in self.saves_on))
        why = "" if saves else f" (--exit-signal-handler saves one first on {chosen})" \
            if self.graceful else " (--exit-signal-handler saves one first)"
        self.say(f"loom: rank {self.rank} received {name}: exiting without a checkpoint{why}")
        raise SystemExit(128 + signum)

    def agreed(self, all_reduce_max: Callable[[list[float]], list[float]]) -> Optional[str]:
        """With ``--exit-signal-handler``: whether any rank received a signal (one all-reduce
        of a flag over every rank, called by every rank at the end of each iteration); the
        signal's name, or None. Always None (and no collective) without the flag."""
        if not self.graceful:
            return None
        (flag,) = all_reduce_max([float(self.received or 0)])
        return signal.Signals(int(flag)).name if flag else None
