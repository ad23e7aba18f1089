"""Readers hold what they read: a checkpoint being read is never pruned.

``loom evaluate``, ``loom generate``, ``loom checkpoint convert`` / ``inspect`` (and ``loom
train --load`` of another run's directory, until its load finished) resolve the checkpoint
and put a hold on it, the file ``ROOT/.loom-read.iter_NNNNNNN.HOST.PID``;
``--keep-last`` pruning (:func:`loom.checkpoint.safety.prune_checkpoints`) skips held
checkpoints. Resolving the pointer and taking the hold happen under an exclusive ``flock`` of
the root directory (:func:`root_guard`), and so does pruning, so a checkpoint is never deleted
between a reader's choice and its hold. Torch-free.

A hold is live while its process runs (same host, pid alive: the liveness test of
:mod:`loom.checkpoint.lock`) or, for another host's, while it is refreshed: a daemon thread
touches it every :data:`REFRESH_S` seconds and one untouched for :data:`STALE_S` is stale
(removed by the next prune). Where the root cannot be written (a read-only copy) or locked,
no hold is taken; a reader whose files then vanish is refused in one line (every file is
verified as it is read, :func:`loom.checkpoint.integrity.verify_read`).

Under torchrun only rank 0 resolves and holds; it tells the other ranks which checkpoint on
torchrun's agent store (:func:`agreed_checkpoint`), so every rank reads the same one even if a
save lands meanwhile.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from typing import Iterator, Optional

from loom.checkpoint.lock import _alive, _proc_start
from loom.paths import resolve_checkpoint

PREFIX = ".loom-read."
REFRESH_S = 60.0  # how often a holder touches its hold
STALE_S = 600.0  # a hold of another host untouched this long is stale
AGREE_WAIT_S = 120.0  # how long the other ranks wait for rank 0's choice


@contextlib.contextmanager
def root_guard(root: str) -> Iterator[None]:
    """An exclusive ``flock`` of the directory ``root`` while the block runs (resolving and
    holding, or pruning); best effort: without it where the directory cannot be opened or the
    filesystem cannot lock."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # releases the flock


class Hold:
    """This process's hold on one checkpoint; :meth:`release` (idempotent) removes it."""

    def __init__(self, path: str):
        self.path = path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, daemon=True,
                                        name="loom-reader-hold")
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        try:
            os.remove(self.path)
        except OSError:
            pass


def _hold_name(ckpt: str) -> str:
    return f"{PREFIX}{os.path.basename(os.path.normpath(ckpt))}.{socket.gethostname()}." \
           f"{os.getpid()}"


def take_hold(root: str, step: Optional[int] = None) -> tuple[Optional[str], Optional[Hold]]:
    """``(checkpoint, hold)``: the checkpoint ``root`` (``--load``) names (``step``:
    ``--ckpt-step``), resolved and held in one step under :func:`root_guard`; hold None when
    the root is not writable. ``(None, None)`` when the root holds no checkpoint. Raises
    ConfigError as :func:`loom.paths.resolve_checkpoint`."""
    from loom.checkpoint.megatron.locate import locate  # torch-free
    with root_guard(root):
        found = locate(root, step)  # a Megatron-LM checkpoint: its own iteration layout
        ckpt = found.path if found is not None else resolve_checkpoint(root, step)
        if ckpt is None:
            return None, None
        path = os.path.join(root, _hold_name(ckpt))
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "pid_start": _proc_start(os.getpid()), "checkpoint": ckpt}
        try:
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(info, fh)
        except OSError:
            return ckpt, None
    return ckpt, Hold(path)


def _live(path: str) -> bool:
    """Whether the hold file ``path`` belongs to a reader that still runs."""
    try:
        with open(path, encoding="utf-8") as fh:
            info = json.load(fh)
        age = time.time() - os.path.getmtime(path)
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict):
        return False
    if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int):
        return _alive(info["pid"], info.get("pid_start"))
    return age < STALE_S


def held_checkpoints(root: str) -> set[str]:
    """Names (``iter_NNNNNNN``) of the checkpoints of ``root`` that live readers hold; stale
    holds are removed. Call under :func:`root_guard`."""
    held = set()
    try:
        names = os.listdir(root)
    except OSError:
        return held
    for name in names:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(root, name)
        if _live(path):
            held.add(name[len(PREFIX):].split(".", 1)[0])
        else:
            try:
                os.remove(path)
            except OSError:
                pass
    return held


def agreed_checkpoint(root: str, step: Optional[int] = None
                      ) -> tuple[Optional[str], Optional[Hold]]:
    """:func:`take_hold` on rank 0; under torchrun the other ranks take rank 0's choice from
    the agent store (they hold nothing: rank 0's hold covers the job), waiting up to
    :data:`AGREE_WAIT_S` seconds; without a store every rank resolves for itself."""
    from loom.parallel.agent_store import agent_store
    rank = int(os.environ.get("RANK", "0") or 0)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    store = agent_store() if world > 1 else None
    key = f"loom/reading/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0 or store is None:
        ckpt, hold = take_hold(root, step)
        if store is not None:
            store.set(key, json.dumps(ckpt))
        return ckpt, hold
    refused = f"loom/refused/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    deadline = time.monotonic() + AGREE_WAIT_S
    while time.monotonic() < deadline:
        if store.check([key]):
            return json.loads(store.get(key)), None
        if store.check([refused]):  # rank 0 refused before choosing: it says why
            raise SystemExit(2)
        time.sleep(0.05)
    return take_hold(root, step)[0], None
