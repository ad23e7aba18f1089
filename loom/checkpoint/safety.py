"""Checkpoint directories checked before the first step: nothing is rewound or overwritten.

Torch-free (but for reading DCP's ``.metadata``), so ``loom train`` runs these checks in every
rank before any process group starts:

- :func:`resolve_checkpoint` (of :mod:`loom.paths`, re-exported with the layout of a
  checkpoint root): the checkpoint ``--load`` names. A ``latest`` pointer that is
  unreadable or names a missing iteration is an error naming the file (``--ckpt-step N`` picks
  an iteration explicitly); an empty or absent directory means a fresh start.
- :func:`check_save_dir`: ``--save`` is a writable directory (or can be created) with room for
  one checkpoint, and holds no checkpoint newer than the run's start unless
  ``--overwrite-checkpoints``.
- :func:`remove_partial_checkpoints`: leftover ``iter_NNNNNNN.tmp`` directories of a crashed save.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import zipfile
from typing import Optional

from loom.checkpoint.integrity import FORMAT as DCP_FORMAT  # noqa: F401 - re-exported
from loom.checkpoint.integrity import OLD_FORMATS
from loom.errors import ConfigError
from loom.paths import (LATEST, available_checkpoints, is_complete,  # noqa: F401 - re-exported
                        iteration_dir, read_pointer, resolve_checkpoint, saved_iterations)

_PARTIAL = re.compile(r"^iter_\d+\.tmp$")


def _again(path: str) -> str:
    return (f"give --ckpt-step N to load another checkpoint "
            f"({available_checkpoints(os.path.dirname(os.path.abspath(path)))})")


def dcp_storage(path: str, again: str = ""):
    """DCP's ``.metadata`` of the checkpoint ``path`` (verified against the manifest first);
    ConfigError naming it when unreadable."""
    from torch.distributed.checkpoint import FileSystemReader

    from loom.checkpoint.integrity import verify_read
    verify_read(path, [".metadata"], again)
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unpickling error means a damaged file
        raise ConfigError(f"checkpoint file {os.path.join(path, '.metadata')} is unreadable "
                          f"({e}); it was truncated or overwritten"
                          + (f": {again}" if again else "")) from None


def needed_files(path: str, metadata) -> list[str]:
    """The files a reader of the checkpoint ``path`` may open: DCP's ``.metadata``,
    ``common.pt``, ``metadata.json``, every file ``metadata`` (DCP's index) references, and
    ``tokenizer.json`` when there: what its manifest must list."""
    from loom.checkpoint.integrity import CORE
    refs = sorted({info.relative_path for info in metadata.storage_data.values()})
    tok = ["tokenizer.json"] if os.path.isfile(os.path.join(path, "tokenizer.json")) else []
    return list(CORE) + refs + tok


def _check_dcp_files(path: str) -> None:
    """A DCP checkpoint: its manifest present (format v3) and listing every file a reader
    opens; ``.metadata`` readable and matching its checksum; every ``.distcp`` file it names
    holds the byte ranges it records and has the manifest's size; ``metadata.json`` agrees
    with the directory and ``.metadata``. ConfigError names the file. The shards are hashed
    when they are read (:func:`loom.checkpoint.integrity.verify_read`)."""
    from loom.checkpoint.integrity import check_coverage, check_descriptions
    again = _again(path)
    metadata = dcp_storage(path, again)
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        file = os.path.join(path, rel)
        have = os.path.getsize(file) if os.path.isfile(file) else -1
        if have < size:
            what = "missing" if have < 0 else f"truncated ({have} of {size} bytes)"
            raise ConfigError(f"checkpoint file {file} is {what}: {again}")
    check_coverage(path, needed_files(path, metadata), again)
    check_descriptions(path, (DCP_FORMAT,) + OLD_FORMATS, metadata.state_dict_metadata)


def check_checkpoint_files(path: str) -> None:
    """Refuse a checkpoint whose files are truncated, unreadable or not covered by its
    manifest; ConfigError names the file. DCP: see :func:`_check_dcp_files`; v1: each ``.pt``
    file must be a readable zip with its central directory."""
    dcp = os.path.exists(os.path.join(path, ".metadata"))
    names = sorted(n for n in os.listdir(path) if n.endswith(".pt"))
    if not dcp and not any(n.startswith("model_") for n in names):
        from loom.checkpoint.integrity import MANIFEST
        if os.path.isfile(os.path.join(path, MANIFEST)):  # v2/v3 whose .metadata is gone
            raise ConfigError(f"checkpoint file {os.path.join(path, '.metadata')} is missing "
                              f"({MANIFEST} lists it): {_again(path)}")
        raise ConfigError(f"checkpoint {path} holds neither DCP's .metadata nor a "
                          f"model_tp*_pp*.pt shard; {_again(path)}")
    if dcp:
        _check_dcp_files(path)
        return
    for name in names:
        file = os.path.join(path, name)
        try:
            with zipfile.ZipFile(file) as zf:
                zf.infolist()
        except (OSError, zipfile.BadZipFile) as e:
            raise ConfigError(
                f"checkpoint file {file} is unreadable ({e}); it was truncated or overwritten: "
                f"{_again(path)}") from None


def integrity_note(path: str) -> Optional[str]:
    """One line for a checkpoint whose files cannot be verified because its format predates
    the mandatory manifest (v1, or v2 without one); None otherwise (a current-format checkpoint
    without its manifest is refused: :func:`loom.checkpoint.integrity.manifest_of`)."""
    from loom.checkpoint.integrity import MANIFEST, UNVERIFIED, _claimed_format
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return None
    fmt = _claimed_format(path) or "loom-checkpoint-v1"
    if fmt not in UNVERIFIED:
        return None
    return (f"checkpoint {path} is format {fmt}, saved before loom kept checksums "
            f"({MANIFEST}): its file sizes are checked, their contents cannot be")


def check_fresh_load(load: str, save: Optional[str]) -> None:
    """``--load`` names no checkpoint: allowed (a fresh start, said by the caller) only for an
    empty or absent directory that is also ``--save`` (a job that resumes itself) or an empty
    directory; partial ``iter_N.tmp`` directories of a first save cut short do not count (the
    start removes them from ``--save``: :func:`remove_partial_checkpoints`). Refused, with ConfigError naming ``--load``: a path that does not exist (a typo;
    unless it is ``--save``), a symlink loop or unreadable path, and a directory holding other
    files (a dataset directory, say), so a wrong path never silently starts from scratch."""
    try:
        os.stat(load)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(f"--load {load}: a symbolic-link loop; point it at the checkpoint "
                              f"directory") from None
        if e.errno != errno.ENOENT:
            raise ConfigError(f"--load {load}: cannot read it ({e.strerror})") from None
        if save and os.path.abspath(save) == os.path.abspath(load):
            return
        raise ConfigError(f"--load {load} does not exist: check the path (to start from "
                          f"scratch, drop --load, or give the same directory as --save)") from None
    if not os.path.isdir(load):
        return  # resolve_checkpoint refuses a file
    others = sorted(n for n in os.listdir(load) if not n.startswith(".") and not
                    _PARTIAL.match(n) and n != LATEST + ".tmp")  # a first save cut short
    if others:
        from loom.checkpoint.megatron.locate import diagnose
        said = diagnose(load)  # another program's checkpoint (torchtitan's step-N, ...)
        if said:
            raise ConfigError(f"--load {load}: {said}")
        raise ConfigError(f"--load {load} holds no checkpoint (no {LATEST}, no iter_*) but other "
                          f"files ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): "
                          f"give the checkpoint directory (the --save of the run to resume)")


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def check_save_dir(save_dir: str, start_iteration: int, overwrite: bool = False,
                   expected_bytes: int = 0, resumed_from_pointer: bool = False) -> None:
    """Refuse a ``--save`` directory that would lose data or fail at the first save.

    Checks, without creating anything: ``save_dir`` (or its nearest existing parent) is a
    directory this process can write in; it has ``expected_bytes`` free (bytes, one checkpoint);
    it holds no checkpoint (``iter_N`` or pointer) newer than ``start_iteration`` unless
    ``overwrite`` (``--overwrite-checkpoints``). With ``resumed_from_pointer`` (the run resumes
    from this directory's own ``latest`` pointer), ``iter_N`` directories above the pointer are
    an interrupted save's uncommitted output (renamed, pointer not yet moved) and may be
    replaced. Raises ConfigError naming ``--save``.
    """
    base = _nearest_existing(save_dir)
    if not os.path.isdir(base):
        raise ConfigError(f"--save {save_dir}: {base} is a file, not a directory; choose another "
                          f"--save directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".loom-write-check-", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--save {save_dir}: cannot write in {base} ({e.strerror}); choose a "
                          f"writable --save directory") from None
    free = shutil.disk_usage(base).free
    if expected_bytes > free:
        raise ConfigError(f"--save {save_dir}: a checkpoint needs about {_size(expected_bytes)} "
                          f"but only {_size(free)} is free on {base}; free space or choose "
                          f"another --save directory")
    if overwrite or not os.path.isdir(save_dir):
        return
    newer = [] if resumed_from_pointer else \
        [i for i in saved_iterations(save_dir) if i > start_iteration]
    try:
        pointer = read_pointer(save_dir)
    except ConfigError:  # a broken pointer: replaceable when resuming from an explicit checkpoint
        pointer = None
        if start_iteration == 0:
            newer = newer or [-1]
    if pointer is not None and pointer > start_iteration:
        newer = sorted(set(newer) | {pointer})
    if newer:
        held = ", ".join(map(str, [i for i in newer if i >= 0])) or f"an unreadable {LATEST}"
        raise ConfigError(
            f"--save {save_dir} already holds checkpoints newer than this run's start "
            f"(iteration {start_iteration}): {held}; saving would overwrite them. Resume with "
            f"--load {save_dir}, choose another --save directory, or give "
            f"--overwrite-checkpoints")


def remove_partial_checkpoints(save_dir: str) -> list[str]:
    """Delete leftover ``iter_NNNNNNN.tmp`` directories and a pointer's ``.tmp`` of a crashed
    save; returns the removed paths. Call on one rank only (rank 0), after the checks passed."""
    if not os.path.isdir(save_dir):
        return []
    removed = []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if _PARTIAL.match(name) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif name == LATEST + ".tmp" and os.path.isfile(path):
            os.remove(path)
            removed.append(path)
    return removed


def last_checkpoint_before(save_dir: str, iteration: int) -> Optional[int]:
    """The newest complete checkpoint in ``save_dir`` below ``iteration`` (None if none)."""
    older = [i for i in saved_iterations(save_dir, complete_only=True) if i < iteration]
    return older[-1] if older else None


def prune_checkpoints(save_dir: str, keep_last: Optional[int],
                      keep_before: Optional[int] = None,
                      retain_interval: Optional[int] = None) -> list[str]:
    """Delete all but the newest ``keep_last`` complete ``iter_NNNNNNN`` directories
    (``--keep-last``; None with ``retain_interval``: 1, Megatron's ``--save-retain-interval``
    alone keeps only the latest besides its multiples), never the one the ``latest`` pointer
    names, never an iteration divisible by ``retain_interval``, never the newest complete one
    below ``keep_before`` (the run's first non-finite iteration: the last checkpoint before
    training diverged), and never one a reader holds (:mod:`loom.checkpoint.holds`; pruning
    runs under the same lock as a reader's choice). Returns the removed paths. Call on rank 0
    after a save completed."""
    from loom.checkpoint.holds import held_checkpoints, root_guard
    if keep_last is None:
        if retain_interval is None:
            return []
        keep_last = 1
    pointer = os.path.join(save_dir, LATEST)
    try:
        with open(pointer) as fh:
            latest = int(fh.read().strip())
    except (OSError, ValueError):
        return []
    removed = []
    with root_guard(save_dir):
        iters = sorted(int(n[5:]) for n in os.listdir(save_dir)
                       if n.startswith("iter_") and n[5:].isdigit()
                       and os.path.isdir(os.path.join(save_dir, n)))
        good = last_checkpoint_before(save_dir, keep_before) if keep_before is not None else None
        held = held_checkpoints(save_dir)
        for it in iters[:-keep_last] if len(iters) > keep_last else []:
            name = f"iter_{it:07d}"
            if it in (latest, good) or name in held or (retain_interval and
                                                        it % retain_interval == 0):
                continue
            path = os.path.join(save_dir, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
