"""Spawn N gloo ranks on CPU for tests and benchmarks: :func:`run_distributed`.

Each rank runs ``fn(*args)`` after ``init_process_group("gloo")`` (file rendezvous, no ports to
pick); the return values come back to the caller, by rank. A failure on any rank raises in the
caller with that rank's traceback; a hang is killed after ``timeout`` seconds.
:func:`torchrun_train` runs ``loom train`` under torchrun (the drills), :func:`logged_losses`
reads the losses back from its ``--log-json``. :func:`count_collectives` records the
``torch.distributed`` collectives a block of code calls (op, group, size, in backward or not).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import os
import queue as queue_mod
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.multiprocessing as mp


PRELOAD = ("torch", "torch.distributed", "loom.models", "loom.training.trainer", "testkit")
"""Modules the fork server imports once (``start_method="forkserver"``): every rank forked from
it starts with them loaded (a spawned rank re-imports them: seconds of CPU per rank)."""


def _worker(rank: int, world: int, init_file: str, fn: Callable, args: tuple, q,
            env: dict | None = None, cwd: str | None = None) -> None:
    gc.freeze()  # what a forked rank inherits is never collected here (see run_distributed)
    if env is not None:  # the caller's environment and directory now, not the fork server's
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
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


def _all_failures(q, procs: list, failed: dict, done: dict, grace: float = 10.0) -> str:
    """Every rank's failure, not just the first to arrive: a rank that dies (a crash, a
    segfault in a compiler) shows up at the others as a broken connection, so the first
    traceback in the queue is often a symptom. Waits up to ``grace`` seconds for the rest."""
    deadline = time.monotonic() + grace
    while len(failed) + len(done) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, value = q.get(timeout=0.5)
        except queue_mod.Empty:
            if all(p.exitcode is not None for p in procs):
                break
            continue
        (done if ok else failed)[rank] = value
    silent = [r for r, p in enumerate(procs)
              if r not in failed and r not in done and p.exitcode not in (None, 0)]
    lines = [f"rank {r} failed:\n{failed[r]}" for r in sorted(failed)]
    lines += [f"rank {r} died without a report (exit code {procs[r].exitcode})" for r in silent]
    return "\n".join(lines)


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = 300,
                    start_method: str = "forkserver") -> list:
    """Run ``fn(*args)`` on ``world_size`` new gloo ranks; return results ordered by rank.

    ``start_method``: ``"forkserver"`` (default) forks each rank from one clean server process
    that imported :data:`PRELOAD` once (the ranks run as spawned ones would: fresh processes,
    this process's environment and working directory, ``fn`` and ``args`` pickled; but without
    re-importing torch and loom, seconds of CPU per rank); ``"spawn"`` starts each from
    scratch; ``"fork"`` copies this process (only from a parent that has started no process
    group or threads of its own). Raises RuntimeError with the failing rank's traceback, or on
    timeout.
    """
    ctx = mp.get_context(start_method)
    if start_method == "fork":  # finalize this process's garbage here, not in the children: a
        gc.collect()  # destroyed gloo group of an earlier in-process test, collected in a
        # forked child (which lacks its threads), hangs in ~ProcessGroupGloo
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # read when the server first starts
    q = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="loom-pg-")
    os.close(fd)
    os.unlink(init_file)
    here = (dict(os.environ), os.getcwd())
    procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, q, *here),
                         daemon=True)
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
                raise RuntimeError(_all_failures(q, procs, {rank: value}, results))
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
    return [results[r] for r in range(world_size)]


def torchrun_train(args: list[str], restarts: int = 0, timeout: float = 180,
                   nproc: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node NPROC --max-restarts RESTARTS -m loom train
    ARGS`` with this checkout on ``PYTHONPATH`` and one thread per rank; output captured."""
    repo = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    exe = Path(sys.executable).with_name("torchrun")
    return subprocess.run([str(exe), "--standalone", "--nproc-per-node", str(nproc),
                           "--max-restarts", str(restarts), "--monitor-interval", "0.5", "-m",
                           "loom", "train", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def logged_losses(log: Path) -> dict[int, float]:
    """The last logged loss of every iteration of a ``--log-json`` file (a re-run iteration
    overwrites the first)."""
    out = {}
    for line in Path(log).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[rec["iteration"]] = rec["loss"]
    return out


# torch.distributed functions counted by count_collectives, and the op each one is counted as
# (reduce_scatter_single / all_gather_single replace the *_tensor names in newer torch)
COLLECTIVES = {"all_reduce": "all_reduce", "reduce_scatter_single": "reduce_scatter",
               "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter": "reduce_scatter",
               "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
               "all_gather": "all_gather", "all_to_all_single": "all_to_all",
               "broadcast": "broadcast"}
# point-to-point calls, counted on request (count_collectives(p2p=True)): a patched dist.isend
# is not the function dist.P2POp accepts, so code using batch_isend_irecv must not run under it
P2P_CALLS = {"isend": "isend", "irecv": "irecv"}


@contextlib.contextmanager
def count_collectives(p2p: bool = False) -> Iterator[list]:
    """Record every call of a :data:`COLLECTIVES` function while the block runs; yields the
    list the records go to, each ``{"op", "group", "numel", "bytes", "backward"}``: ``group``
    the process group whether passed by keyword or position (None: the default group),
    ``numel``/``bytes`` of the largest tensor argument (the whole buffer of a reduce-scatter or
    all-gather), ``backward`` whether the call was made inside an autograd backward (a
    reduction overlapped with it). Calls that loom makes through ``dist.NAME`` looked up at
    call time are all seen (loom never binds these functions at import). ``p2p``: also
    ``dist.isend`` / ``dist.irecv`` (:data:`P2P_CALLS`; not around ``batch_isend_irecv``)."""
    import torch.distributed as dist
    records: list = []
    ops = {**COLLECTIVES, **(P2P_CALLS if p2p else {})}
    originals = {name: getattr(dist, name) for name in ops if hasattr(dist, name)}

    def counted(name, fn):
        sig = inspect.signature(fn)

        def call(*args, **kwargs):
            bound = sig.bind(*args, **kwargs).arguments
            tensors = [v for v in bound.values() if isinstance(v, torch.Tensor)]
            tensors += [t for v in bound.values() if isinstance(v, (list, tuple))
                        for t in v if isinstance(t, torch.Tensor)]
            big = max(tensors, key=lambda t: t.numel(), default=None)
            records.append({"op": ops[name], "group": bound.get("group"),
                            "numel": 0 if big is None else big.numel(),
                            "bytes": 0 if big is None else big.numel() * big.element_size(),
                            "backward": torch._C._current_graph_task_id() != -1})
            return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield records
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
