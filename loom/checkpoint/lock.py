"""One job per ``--save`` directory: ``DIR/.loom-save.lock``, held for the whole run.

Torch-free. ``loom train`` takes the lock on rank 0 after every check passed and before any
process group starts (:func:`lock_for_job`); the other ranks wait for rank 0's word on
torchrun's agent store and exit 2 quietly when it refused (rank 0 prints the one line). The
file, created atomically (``O_CREAT | O_EXCL``), holds the host, the pid (and its start time,
so a reused pid is not taken for the holder) and the start time of the job that holds it. A
second job is refused naming the holder; a lock of a process that is gone (same host, pid not
alive) is taken over with a message. Released at exit, also on error; ``--dry-run`` never
takes it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Callable, Optional

from loom.errors import ConfigError
from loom.parallel.agent_store import agent_store

LOCK = ".loom-save.lock"
WAIT_S = 300  # how long the other ranks wait for rank 0 to take the lock


def _proc_start(pid: int) -> Optional[str]:
    """The start time of process ``pid`` in clock ticks since boot (Linux), else None."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: Optional[str]) -> bool:
    """Whether process ``pid`` (started at ``start``, when known) still runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _proc_start(pid)
    return start is None or now is None or now == start


def _read(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as fh:
            info = json.load(fh)
        return info if isinstance(info, dict) else None
    except (OSError, ValueError):
        return None


def _holder(info: Optional[dict], path: str) -> str:
    if info is None:
        return f"an unreadable lock file {path}"
    return (f"host {info.get('host')}, pid {info.get('pid')}, started {info.get('started')}; "
            f"lock file {path}")


class SaveLock:
    """The lock of one ``--save`` directory; :meth:`acquire`, then :meth:`release`."""

    def __init__(self, save_dir: str):
        self.save_dir = save_dir
        self.path = os.path.join(save_dir, LOCK)
        self.info: Optional[dict] = None  # what this process wrote, while it holds the lock
        self.created_dir = False

    def _stale(self, info: Optional[dict]) -> bool:
        """A lock of a process that is gone: same host, pid not alive; or a file left empty
        by a process killed right after creating it (older than a minute)."""
        if info is None:
            try:
                return time.time() - os.path.getmtime(self.path) > 60
            except OSError:
                return True
        if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
            return False
        return not _alive(info["pid"], info.get("pid_start"))

    def _take_over(self, seen: Optional[dict]) -> bool:
        """Move the stale lock aside; False when another job replaced it meanwhile."""
        aside = f"{self.path}.stale{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return True
        if _read(aside) != seen:  # another job took it over first: give its lock back
            try:
                os.link(aside, self.path)
            except OSError:
                pass
            os.remove(aside)
            return False
        os.remove(aside)
        return True

    def acquire(self, say: Callable[[str], None] = print) -> "SaveLock":
        """Take the lock (creating ``--save`` if needed); ``say`` reports a stale lock taken
        over. Raises ConfigError naming the holder when another job holds it."""
        if not os.path.isdir(self.save_dir):
            os.makedirs(self.save_dir, exist_ok=True)
            self.created_dir = True
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "pid_start": _proc_start(os.getpid()),
                "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                "command": " ".join(sys.argv)[:500]}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                held = _read(self.path)
                if not self._stale(held):
                    raise ConfigError(
                        f"--save {self.save_dir} is in use by another loom job ("
                        f"{_holder(held, self.path)}): one job writes a --save directory at a "
                        f"time; wait for it to end, choose another --save directory, or remove "
                        f"the lock file if that job is gone") from None
                if self._take_over(held):
                    say(f"loom train: took over the lock of --save {self.save_dir} left by a "
                        f"job that is gone ({_holder(held, self.path)})")
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(info, fh)
                fh.flush()
                os.fsync(fh.fileno())
            self.info = info
            return self
        raise ConfigError(f"--save {self.save_dir}: could not take the lock {self.path} (other "
                          f"jobs keep taking it); run one job per --save directory")

    def release(self) -> None:
        """Remove the lock if this process still holds it (and ``--save`` if the lock made it
        and it stayed empty). Never raises."""
        if self.info is None:
            return
        try:
            if _read(self.path) == self.info:
                os.remove(self.path)
            if self.created_dir and not os.listdir(self.save_dir):
                os.rmdir(self.save_dir)
        except OSError:
            pass
        self.info = None


def lock_for_job(save_dir: str, rank: int,
                 say: Callable[[str], None] = print) -> Optional[SaveLock]:
    """Rank 0 takes ``save_dir``'s lock (:meth:`SaveLock.acquire`) and tells the other ranks
    on torchrun's agent store; another rank waits for that word (up to ``WAIT_S`` s) and exits
    with status 2 when rank 0 was refused (rank 0 prints why). Returns rank 0's lock (None on
    the other ranks). Raises ConfigError on rank 0 when another job holds the lock."""
    key = f"loom/save-lock/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = agent_store() if os.environ.get("WORLD_SIZE", "1") != "1" else None
    if rank == 0:
        try:
            lock = SaveLock(save_dir).acquire(say)
        except ConfigError:
            if store is not None:
                store.set(key, "refused")
            raise
        if store is not None:
            store.set(key, "held")
        return lock
    if store is not None:
        from datetime import timedelta
        store.set_timeout(timedelta(seconds=WAIT_S))
        try:
            word = store.get(key).decode()
        except Exception:  # noqa: BLE001 - no word from rank 0: it reports whatever happened
            word = "held"
        if word == "refused":
            sys.exit(2)
    return None
