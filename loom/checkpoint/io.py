"""Checkpoints on ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards in
parallel, keyed by global parameter names, so they load at any layout.

Layout of ``--save DIR`` (format ``loom-checkpoint-v3``: v2's layout with ``manifest.json``
mandatory; Megatron's names where they exist)::

    DIR/latest_checkpointed_iteration.txt      written last, atomically (os.replace)
    DIR/iter_0000100/metadata.json             format, iteration, parallel layout
    DIR/iter_0000100/common.pt                 iteration, consumed samples, LR scheduler, config,
                                               format, the data's identity
    DIR/iter_0000100/.metadata                 DCP's index: every key, its shape, dtype, file
    DIR/iter_0000100/__R_0.distcp              the entries rank R wrote (FileSystemWriter)
    DIR/iter_0000100/tokenizer.json            so `loom generate` needs no tokenizer flags
    DIR/iter_0000100/manifest.json             every file's size and blake2b (integrity.py)

DCP keys (each rank's state dict has four sections; DCP stores ``section.key``)::

    model.NAME/RofT            this TP shard R of T of parameter NAME (``0of1``: TP-replicated)
    optim.NAME/RofT/KEY        its Adam state KEY (exp_avg, exp_avg_sq, step)
    param.NAME                 JSON: the full (unsharded) shape and the TP ShardSpec
    rng.RRRRR                  global rank RRRRR's generators (torch.save bytes)

Keys name what a tensor *is*, never who holds it: DP and CP replicas (and a tied embedding's
copy on the last pipeline stage) produce identical keys, which DCP's planner writes once; TP
shards and pipeline stages differ by key. With the distributed optimizer each DP rank adds the
Adam states of the parameters it owns.

All ranks write into ``iter_0000100.tmp``; rank 0 renames it and only then moves the ``latest``
pointer, so a crash at any moment leaves the previous checkpoint intact and never a half-written
one; a checkpoint of the same iteration already there is swapped out atomically, never deleted
first (:func:`_move_into_place`). ``--async-save`` (:func:`start_save` with ``async_save``): the state is copied to CPU
memory, DCP writes it from a background thread (over its own gloo group) while training goes
on, and :func:`finalize_save` renames and moves the pointer once every rank's write finished.

Loading (:class:`~loom.checkpoint.reader.DcpIndex`): each rank reads DCP's ``.metadata``, requests the saved TP shards
of its own parameters (empty tensors of the saved shapes; DCP reads only those byte ranges),
rebuilds each full tensor (``full_from_shards``) and cuts this rank's shard for the current
layout (``local_shard``), so a checkpoint saved at one TP/PP/DP size loads at another.
``loom-checkpoint-v1`` checkpoints (one ``torch.save`` file per shard) still load, read-only
(:mod:`loom.checkpoint.legacy`).
"""

from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from loom.checkpoint.integrity import write_manifest
from loom.checkpoint.legacy import canonical_name  # noqa: F401
from loom.checkpoint.optimizer_state import optimizer_state_by_name
from loom.checkpoint.reader import (DcpIndex, latest_checkpoint, load_checkpoint,  # noqa: F401
                                   load_model_weights, open_checkpoint, read_common,
                                   single_process_quiet)
from loom.checkpoint.safety import DCP_FORMAT, LATEST
from loom.checkpoint.save_errors import save_failed
from loom.parallel.mesh import ParallelMesh
from loom.parallel.random import RNGTracker, get_rng_state
from loom.parallel.registry import named_parameters

FORMAT = DCP_FORMAT


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _agree(failure: Optional[BaseException], device) -> None:
    """A barrier that also tells every rank whether one failed (rank 0 alone writes the common
    files and renames): raises ``failure`` here, or an OSError on the ranks that did not
    fail, instead of leaving them in a barrier for the process-group timeout."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0.0 if failure is None else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and failure is None:
            failure = OSError("another rank failed to write the checkpoint (its message names "
                              "the error)")
    if failure is not None:
        raise failure


def _named_params(model_chunks: Sequence[nn.Module]) -> dict[str, tuple]:
    """``name -> (parameter, ParamMeta)`` over this rank's chunks."""
    return {n: (p, meta) for n, p, meta in named_parameters(model_chunks)}


def _spec_of(meta) -> Optional[dict]:
    return meta.shard.to_dict() if meta.shard is not None else None


def _shard_id(meta, mesh: ParallelMesh) -> str:
    """``RofT``: which TP shard this rank holds (``0of1`` for a TP-replicated parameter; an
    expert's: its expert-TP shard)."""
    rank, size = mesh.shard_of(meta)
    return f"{rank}of{size}" if meta.shard is not None and size > 1 else "0of1"


def _open_for_write(path: str):
    """The file a checkpoint part is written to (Python I/O, so a full disk raises OSError
    ENOSPC rather than a bare iostream error)."""
    return open(path, "wb")


def _torch_save(obj, path: str) -> None:
    with _open_for_write(path) as fh:
        torch.save(obj, fh)


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with _open_for_write(tmp) as fh:
        fh.write(text.encode())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class _Writer(FileSystemWriter):
    """DCP's file writer; ``after_write`` runs once this rank's files are on disk (the
    ``--inject-fault R:N:kill-in-save`` drill), before the coordinator writes ``.metadata``."""

    def __init__(self, path: str, after_write: Optional[Callable[[], None]] = None):
        super().__init__(path, thread_count=1, sync_files=True)
        self.after_write = after_write

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        if self.after_write is not None:
            fut.wait()  # a torch.futures.Future: the files are on disk
            self.after_write()
        return fut


def _storage_writer(path: str, after_write: Optional[Callable[[], None]] = None) -> _Writer:
    """The DCP writer of one checkpoint (tests replace this to slow the write down)."""
    return _Writer(path, after_write)


def optimizer_states(optimizer: Optional[torch.optim.Optimizer],
                     params: dict[str, tuple]) -> dict[str, dict]:
    """``name -> {state key: value}``: the Adam states (and, for 16-bit parameters, the fp32
    ``master_param``) of this rank's parameters at their TP-local shapes: the distributed
    optimizer gathers its DP shards (collective), so DP replicas write identical keys once;
    ZeRO-3's states stay DTensors (DCP writes each rank's rows). The one place optimizer state
    is collected (:func:`loom.checkpoint.optimizer_state.optimizer_state_by_name`)."""
    if optimizer is None:
        return {}
    return optimizer_state_by_name(optimizer, {n: p for n, (p, _) in params.items()})


def rank_state_dict(model_chunks: Sequence[nn.Module], optimizer, mesh: ParallelMesh,
                    tracker: Optional[RNGTracker]) -> dict[str, Any]:
    """This rank's DCP state dict (keys: the module docstring). Four top-level sections, not
    one key per tensor: DCP does per-top-level-key work (logging) that costs ~0.5 ms each."""
    params = _named_params(model_chunks)
    out: dict[str, dict[str, Any]] = {"model": {}, "optim": {}, "param": {}, "rng": {}}
    for name, (p, meta) in params.items():  # ZeRO-3: a DTensor, DCP writes each DP rank's rows
        out["model"][f"{name}/{_shard_id(meta, mesh)}"] = p.detach()
        out["param"][name] = json.dumps({"full_shape": list(meta.full_shape),
                                         "shard": _spec_of(meta)})
    for name, states in optimizer_states(optimizer, params).items():
        prefix = f"{name}/{_shard_id(params[name][1], mesh)}/"
        for k, v in states.items():
            out["optim"][prefix + k] = v.detach() if torch.is_tensor(v) else v
    if tracker is not None:
        out["rng"][f"{mesh.rank:05d}"] = _to_bytes(get_rng_state(tracker))
    return {k: v for k, v in out.items() if v}


@dataclass
class PendingSave:
    """A checkpoint being written: ``future`` (None once synchronous) completes when every
    rank's files and DCP's ``.metadata`` are on disk; then :func:`finalize_save`."""

    save_dir: str
    iteration: int
    final: str
    tmp: str
    device: Any = None  # of the default group's collectives
    future: Any = None
    started: float = 0.0
    written_s: Optional[float] = None  # start of the save call -> every file written
    blocked_s: Optional[float] = None  # how long the save call held the step loop


def _write_common(job: PendingSave, scheduler, mesh: ParallelMesh, consumed_samples: int,
                  config: dict, tokenizer_file: Optional[str], data: Optional[dict]) -> None:
    """Rank 0: a fresh ``iter_N.tmp`` with ``common.pt``, ``metadata.json``, tokenizer."""
    os.makedirs(job.save_dir, exist_ok=True)
    shutil.rmtree(job.tmp, ignore_errors=True)
    os.makedirs(job.tmp)
    _torch_save({"iteration": job.iteration, "consumed_samples": consumed_samples,
                 "scheduler": scheduler.state_dict() if scheduler is not None else None,
                 "config": config, "data": data, "format": FORMAT},
                os.path.join(job.tmp, "common.pt"))
    meta = {"format": FORMAT, "iteration": job.iteration, "layout": mesh.sizes,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1}
    with _open_for_write(os.path.join(job.tmp, "metadata.json")) as fh:
        fh.write(json.dumps(meta, indent=1).encode())
    if tokenizer_file and os.path.exists(tokenizer_file):
        shutil.copyfile(tokenizer_file, os.path.join(job.tmp, "tokenizer.json"))


def start_save(save_dir: str, iteration: int, model_chunks: Sequence[nn.Module],
               optimizer: Optional[torch.optim.Optimizer], scheduler, mesh: ParallelMesh,
               tracker: RNGTracker, *, consumed_samples: int, config: dict,
               tokenizer_file: Optional[str] = None, async_save: bool = False, group=None,
               after_write: Optional[Callable[[], None]] = None,
               data: Optional[dict] = None) -> PendingSave:
    """Begin a checkpoint of ``iteration`` in ``iter_N.tmp``; collective over all ranks.
    ``async_save``: write in the background with ``dcp.async_save`` (the state is copied to
    CPU first; ``group``: a gloo group of all ranks, apart from the training's collectives);
    else write before returning. ``after_write``: see :class:`_Writer`. ``data``: the
    identities of the datasets trained on (:mod:`loom.checkpoint.data_match`), into
    ``common.pt``."""
    final = os.path.join(save_dir, f"iter_{iteration:07d}")
    job = PendingSave(save_dir, iteration, final, final + ".tmp", device=mesh.device,
                      started=time.perf_counter())
    try:
        failure = None
        try:
            if _rank() == 0:
                _write_common(job, scheduler, mesh, consumed_samples, config, tokenizer_file,
                              data)
        except OSError as e:
            failure = e
        _agree(failure, job.device)
        state = rank_state_dict(model_chunks, optimizer, mesh, tracker)
        writer = _storage_writer(job.tmp, after_write)
        single = not dist.is_initialized()
        with single_process_quiet():
            if async_save:
                job.future = dcp.async_save(state, storage_writer=writer, process_group=group,
                                            no_dist=single)
            else:
                dcp.save(state, storage_writer=writer, no_dist=single)
            job.written_s = time.perf_counter() - job.started
    except (OSError, CheckpointException) as e:
        raise save_failed(save_dir, iteration, job.tmp, e) from e
    return job


def _exchange(a: str, b: str) -> bool:
    """Swap directories ``a`` and ``b`` in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); False where the system or filesystem cannot. Raises OSError for any
    other failure."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def _move_into_place(job: PendingSave) -> None:
    """Rename ``iter_N.tmp`` to ``iter_N``. A checkpoint already there (a re-save of the same
    iteration) is never deleted before its replacement is in place: the two are swapped
    atomically and the old one, now ``iter_N.tmp``, removed (a kill in between leaves the new
    ``iter_N`` and a partial that the next start removes). Where the filesystem cannot swap,
    the pointer first moves to another complete checkpoint if it named this one."""
    if not os.path.exists(job.final):
        os.replace(job.tmp, job.final)
        return
    if _exchange(job.tmp, job.final):
        shutil.rmtree(job.tmp, ignore_errors=True)
        return
    from loom.checkpoint.safety import read_pointer, saved_iterations
    try:
        pointer = read_pointer(job.save_dir)
    except Exception:  # noqa: BLE001 - an unreadable pointer is rewritten below anyway
        pointer = None
    others = [i for i in saved_iterations(job.save_dir, complete_only=True) if i != job.iteration]
    if pointer == job.iteration and others:
        _atomic_write_text(os.path.join(job.save_dir, LATEST), str(others[-1]))
    shutil.rmtree(job.final)
    os.replace(job.tmp, job.final)


def finalize_save(job: PendingSave, barrier: bool = True) -> str:
    """Wait for ``job``'s files, then (rank 0) rename ``iter_N.tmp`` and move the pointer;
    returns the final directory. ``barrier``: every rank waits for the rename (synchronous
    saves; an asynchronous one finalizes on rank 0 alone, whenever its write completed)."""
    try:
        failure = None
        try:
            if job.future is not None:
                job.future.result()
                job.written_s = time.perf_counter() - job.started
                job.future = None
            if _rank() == 0:
                write_manifest(job.tmp)  # every file's size and checksum, before the rename
                _move_into_place(job)
                _atomic_write_text(os.path.join(job.save_dir, LATEST), str(job.iteration))
        except (OSError, CheckpointException) as e:
            failure = e
        if barrier:
            _agree(failure, job.device)
        elif failure is not None:
            raise failure
    except (OSError, CheckpointException) as e:
        raise save_failed(job.save_dir, job.iteration, job.tmp, e) from e
    return job.final


def save_checkpoint(save_dir: str, iteration: int, model_chunks: Sequence[nn.Module],
                    optimizer: Optional[torch.optim.Optimizer], scheduler, mesh: ParallelMesh,
                    tracker: RNGTracker, *, consumed_samples: int, config: dict,
                    tokenizer_file: Optional[str] = None,
                    after_write: Optional[Callable[[], None]] = None) -> str:
    """Write a checkpoint of ``iteration`` under ``save_dir``; collective over all ranks.

    Returns the final directory. Raises CheckpointWriteError naming ``save_dir`` and the OS error
    (e.g. "No space left on device") if the filesystem refuses a write; the partial
    ``iter_NNNNNNN.tmp`` is removed, the previous checkpoint and the ``latest`` pointer are
    untouched.
    """
    return finalize_save(start_save(save_dir, iteration, model_chunks, optimizer, scheduler, mesh,
                                    tracker, consumed_samples=consumed_samples, config=config,
                                    tokenizer_file=tokenizer_file, after_write=after_write))


_ShardIndex = open_checkpoint  # its name before format v2 (callers: ``_ShardIndex(ckpt)``)
