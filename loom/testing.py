"""Spawn N gloo ranks on CPU for tests and benchmarks: :func:`run_distributed`.

Each rank runs ``fn(*args)`` after ``init_process_group("gloo")`` (file rendezvous, no ports to
pick); the return values come back to the caller, by rank. A failure on any rank raises in the
caller with that rank's traceback; a hang is killed after ``timeout`` seconds.
"""

from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def _worker(rank: int, world: int, init_file: str, fn: Callable, args: tuple, q) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        result = fn(*args)
        q.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = 300,
                    start_method: str = "spawn") -> list:
    """Run ``fn(*args)`` on ``world_size`` spawned gloo ranks; return results ordered by rank.

    ``start_method="fork"`` skips each rank's imports (seconds per rank on a busy CPU; only
    from a parent that has started no process group or threads of its own).
    Raises RuntimeError with the failing rank's traceback, or on timeout.
    """
    ctx = mp.get_context(start_method)
    q = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="loom-pg-")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, q), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, ok, value = q.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in results]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} died (exit codes "
                                       f"{[procs[r].exitcode for r in dead]})") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"distributed run timed out after {timeout}s; "
                                       f"ranks done: {sorted(results)}") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
    return [results[r] for r in range(world_size)]
