"""A checkpoint save that failed, in one line (:func:`save_failed`): the OS error and the file
when known, the partial directory removed, and the free bytes of ``--save``'s filesystem, so a
full disk is named as one even when DCP reports only a RuntimeError of ``torch.save``."""

from __future__ import annotations

import errno
import os
import shutil
from typing import Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from loom.errors import CheckpointWriteError


def _os_error(err: BaseException) -> Optional[OSError]:
    """The OSError behind ``err`` (DCP wraps each rank's failure in a CheckpointException)."""
    if isinstance(err, OSError):
        return err
    if isinstance(err, CheckpointException):
        for exc, _ in err.failures.values():
            found = _os_error(exc)
            if found is not None:
                return found
    cause = err.__cause__ or err.__context__
    return _os_error(cause) if cause is not None else None


def free_bytes(path: str) -> Optional[int]:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent); None when
    it cannot be asked."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


FULL_BELOW = 64 << 20  # free bytes under which a failed write is called a full disk


def save_failed(save_dir: str, iteration: int, tmp: str,
                err: BaseException) -> CheckpointWriteError:
    """The one-line error of a failed save, naming the OS error and the file when known (DCP
    reports a write that failed inside ``torch.save`` as a RuntimeError without its OSError),
    the partial directory and the free bytes left on its filesystem (measured before the
    partial is removed: a full disk shows as almost nothing free)."""
    free = free_bytes(tmp)
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    os_err = _os_error(err)
    where = f" ({os_err.filename})" if os_err is not None and os_err.filename else ""
    if os_err is not None:
        why = os_err.strerror or str(os_err)
    else:
        inner = err
        if isinstance(err, CheckpointException) and err.failures:
            inner = next(iter(err.failures.values()))[0]
        why = f"a write failed ({type(inner).__name__}: {str(inner).splitlines()[0][:120]})" \
            if str(inner) else type(inner).__name__
    full = free is not None and (free < FULL_BELOW or (
        os_err is not None and os_err.errno == errno.ENOSPC))
    space = "" if free is None else \
        f"; {_size(free)} free on {save_dir}'s filesystem" + (": the disk is full" if full else "")
    return CheckpointWriteError(
        f"saving the checkpoint of iteration {iteration} to {save_dir} failed: "
        f"{why}{where} writing {tmp}{space}; removed the partial {tmp}, the previous checkpoint "
        f"is intact. Free space or choose another --save directory")
