"""When a collective fails because another rank died, the survivors name it (torch-free).

A rank that is killed (SIGKILL, out of memory, a crash) closes its sockets, and every rank
waiting on it in a collective gets the backend's error ("Connection reset by peer", "Connection
closed by peer") that names an address, never a rank. :func:`gone_ranks` finds which ranks of
this node are gone: torchrun's agent is the parent of every local rank, so the ranks of this
node (``RANK - LOCAL_RANK`` .. ``+ LOCAL_WORLD_SIZE``) whose process is no longer a running
child of the agent (read from ``/proc``: each child's parent pid, state and ``RANK``) are the
dead ones. Ranks of other nodes cannot be seen from here: the message says so.
"""

from __future__ import annotations

import os
import time
from typing import Optional

# words of the collective backends' errors when a peer's connection broke
PEER_FAILURE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                "Socket closed", "remote process exited", "NCCL communicator was aborted",
                "Connection refused", "ECONNRESET", "EPIPE")


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective that failed because a peer's connection broke."""
    text = str(err)
    return isinstance(err, RuntimeError) and any(w in text for w in PEER_FAILURE)


def _children(parent: int) -> dict[int, Optional[int]]:
    """``{pid: RANK or None}`` of the running (not zombie) children of ``parent``."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != parent or fields[0] in ("Z", "X"):
                continue
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
            rank = env.get(b"RANK")
            out[int(name)] = int(rank) if rank is not None and rank.isdigit() else None
        except (OSError, ValueError, IndexError):
            continue
    return out


def gone_ranks(wait_s: float = 1.0) -> Optional[list[int]]:
    """Global ranks of this node whose process is gone (waiting up to ``wait_s`` seconds for
    one that is still exiting); None outside torchrun or where ``/proc`` cannot tell."""
    try:
        me, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        n = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if not os.path.isdir("/proc"):
        return None
    expected = set(range(me - local, me - local + n)) - {me}
    deadline = time.monotonic() + wait_s
    while True:
        alive = {r for r in _children(os.getppid()).values() if r is not None}
        gone = sorted(expected - alive)
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.1)


def peer_failure_message(err: BaseException) -> str:
    """One line naming the rank(s) that died, for this (surviving) rank to print."""
    gone = gone_ranks()
    why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    why = why.split("] ", 1)[-1].split(". This is typically")[0][:160]  # the backend's words
    if gone:
        who = ", ".join(map(str, gone))
        head = f"rank{'s' if len(gone) > 1 else ''} {who} {'are' if len(gone) > 1 else 'is'} " \
               f"gone (exited or killed; see its own message, if any)"
    elif gone is not None:
        head = "a rank on another node is gone (this node's ranks all run)"
    else:
        head = "another rank is gone"
    return (f"{head}: the collective this rank was in failed ({why}); torchrun ends the job "
            f"(with --max-restarts it restarts from the last checkpoint)")
