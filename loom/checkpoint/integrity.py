"""Know what you load: per-file checksums of every checkpoint, and the agreement of its
descriptions (torch-free: ``loom train`` checks before any process group starts).

``iter_N/manifest.json`` (written by rank 0 once every file is on disk, before the rename that
makes the checkpoint complete)::

    {"algorithm": "blake2b", "files": {"__0_0.distcp": {"size": 1234, "blake2b": "..."}, ...}}

covers every file of the directory (DCP's ``.metadata`` and ``.distcp`` shards, ``common.pt``,
``metadata.json``, ``tokenizer.json``). A ``loom-checkpoint-v3`` checkpoint (:data:`FORMAT`)
always has one: without it the checkpoint is refused (:func:`manifest_of`), so deleting the
manifest cannot switch the checks off; one that leaves out a file DCP's ``.metadata``
references, or a file loom reads, is refused too (:func:`check_coverage`), so editing it cannot
either (a manifest rewritten to match altered files is beyond what a checksum without a
secret can catch). Format v2 checkpoints (written before v3 made the manifest mandatory) are
checked against their manifest when they have one; common.pt records the format it was written
in, so a v3 checkpoint relabelled v2 in ``metadata.json`` is refused when ``common.pt`` is read
(:func:`loom.checkpoint.reader.read_common`).

Hashing happens where a file is read (:func:`verify_read`): each rank hashes the whole files
it opens, several at once on up to 8 threads (blake2b: 0.4-0.5 GB/s per core measured on the
2-core test machine; one extra pass over what it loads, once per process while the file is
unchanged); the checks before a process group read only DCP's ``.metadata`` and
``metadata.json`` (hashed) and compare every other file's size with the manifest.
:func:`check_descriptions` refuses a ``metadata.json`` that claims another iteration, format
or layout than the directory name, the pointer and DCP's ``.metadata`` (its ``rng.RRRRR``
keys: one per saved rank; its ``RofT`` shard keys: the saved TP size).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Iterable, Optional

from loom.data.checks import file_digest  # blake2b, the same as the datasets'
from loom.errors import ConfigError
from loom.paths import available_checkpoints

MANIFEST = "manifest.json"
ALGORITHM = "blake2b"
FORMAT = "loom-checkpoint-v3"  # v2's layout; manifest.json mandatory (loom.checkpoint.io)
OLD_FORMATS = ("loom-checkpoint-v2",)  # DCP, written before the manifest was mandatory
UNVERIFIED = OLD_FORMATS + ("loom-checkpoint-v1",)  # formats that may lack a manifest
CORE = (".metadata", "common.pt", "metadata.json")  # every DCP checkpoint's own files


def write_manifest(ckpt_dir: str) -> str:
    """Hash every file of ``ckpt_dir`` into ``ckpt_dir/manifest.json`` (fsynced); its path."""
    files = {}
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        if name != MANIFEST and os.path.isfile(path):
            files[name] = {"size": os.path.getsize(path), ALGORITHM: file_digest(path)}
    out = os.path.join(ckpt_dir, MANIFEST)
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"algorithm": ALGORITHM, "files": files}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    return out


def _claimed_format(ckpt_dir: str) -> Optional[str]:
    """The format ``metadata.json`` claims (None when it is unreadable: reported elsewhere)."""
    try:
        with open(os.path.join(ckpt_dir, "metadata.json"), encoding="utf-8") as fh:
            meta = json.load(fh)
        return meta.get("format") if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


def _stamp(path: str) -> tuple:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


@functools.lru_cache(maxsize=64)
def _manifest_cached(ckpt_dir: str, stamp: Optional[tuple], fmt: Optional[str]):
    if stamp is None:
        return None
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
        files = manifest["files"]
        if manifest.get("algorithm") != ALGORITHM or not isinstance(files, dict) or not all(
                isinstance(v, dict) and isinstance(v.get("size"), int)
                and isinstance(v.get(ALGORITHM), str) for v in files.values()):
            raise ValueError(f"not {{'algorithm': '{ALGORITHM}', 'files': {{name: {{size, "
                             f"{ALGORITHM}}}}}}}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"checkpoint file {path} is unreadable ({e})"
    return files


def _fix(ckpt_dir: str, again: Optional[str]) -> str:
    """``; AGAIN`` (default: load another checkpoint of the same root, naming them)."""
    if again is None:
        root = os.path.dirname(os.path.abspath(ckpt_dir))
        again = f"give --ckpt-step N to load another checkpoint ({available_checkpoints(root)})"
    return f"; {again}" if again else ""


def manifest_of(ckpt_dir: str, again: Optional[str] = None) -> Optional[dict]:
    """``{name: {size, blake2b}}`` of ``ckpt_dir``'s manifest; None for a checkpoint of an
    older format without one (format v2, written before the manifest was mandatory), or a
    bare DCP directory without ``metadata.json`` (not a complete loom checkpoint: ``--load``
    and the readers' checks refuse it before reading, :mod:`loom.paths`). Raises
    ConfigError for a current-format checkpoint without it, or an unreadable one (``again``:
    the fix appended; default: "give --ckpt-step N to load another checkpoint (...)")."""
    ckpt_dir = os.path.abspath(ckpt_dir)
    path = os.path.join(ckpt_dir, MANIFEST)
    fmt = _claimed_format(ckpt_dir)
    found = _manifest_cached(ckpt_dir, _stamp(path) if os.path.isfile(path) else None, fmt)
    tail = _fix(ckpt_dir, again)
    if isinstance(found, str):
        raise ConfigError(f"{found}: the checkpoint cannot be verified{tail}")
    if found is None and fmt is not None and fmt not in UNVERIFIED:
        raise ConfigError(f"checkpoint {ckpt_dir} has no {MANIFEST}, which every {FORMAT} "
                          f"checkpoint has: its files cannot be verified (the manifest was "
                          f"deleted); restore it{tail}")
    return found


def check_coverage(ckpt_dir: str, needed: Iterable[str],
                   again: Optional[str] = None) -> Optional[dict]:
    """Refuse a manifest that leaves out a file of ``needed`` (the files DCP's ``.metadata``
    references, :data:`CORE`, ``tokenizer.json`` when there) or whose listed files have
    other sizes now; ConfigError naming the manifest and the file. Returns the manifest
    (None: an older format without one)."""
    files = manifest_of(ckpt_dir, again)
    if files is None:
        return None
    tail = _fix(ckpt_dir, again)
    manifest = os.path.join(os.path.abspath(ckpt_dir), MANIFEST)
    for name in dict.fromkeys(needed):
        if name not in files:
            raise ConfigError(f"checkpoint file {manifest} does not list {name}, which the "
                              f"checkpoint holds or DCP's .metadata references: the manifest "
                              f"was edited or files were mixed in; restore it{tail}")
    for name, want in files.items():
        file = os.path.join(ckpt_dir, name)
        if not os.path.isfile(file):
            raise ConfigError(f"checkpoint file {file} is missing ({MANIFEST} lists it){tail}")
        size = os.path.getsize(file)
        if size != want["size"]:
            raise ConfigError(f"checkpoint file {file} has {size} bytes, {want['size']} when "
                              f"saved: the checkpoint is corrupted{tail}")
    return files


@functools.lru_cache(maxsize=4096)
def _digest(path: str, stamp: tuple) -> str:
    return file_digest(path)


def _prefetch_digests(ckpt_dir: str, names: list[str], threads: int = 8) -> None:
    """Hash several files at once (hashlib releases the GIL: one core each, up to
    ``threads``); the results land in :func:`_digest`'s cache. Errors are left to the caller's
    own checks."""
    todo = []
    for name in names:
        try:
            todo.append((os.path.abspath(os.path.join(ckpt_dir, name)),
                         _stamp(os.path.join(ckpt_dir, name))))
        except OSError:
            continue
    if len(todo) < 2:
        return
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(min(threads, len(todo), os.cpu_count() or 1)) as pool:
        list(pool.map(lambda item: _digest(*item), todo))


def verify_read(ckpt_dir: str, names: Iterable[str], again: Optional[str] = None) -> None:
    """Before reading ``names`` (files of ``ckpt_dir``): refuse any whose blake2b differs from
    the manifest (ConfigError naming the first). Each file is hashed once per process while its
    size, modification time and inode stay the same. Nothing to check for an older format
    without a manifest; a current-format checkpoint without one is refused
    (:func:`manifest_of`)."""
    files = manifest_of(ckpt_dir, again)
    if files is None:
        return
    tail = _fix(ckpt_dir, again)
    manifest = os.path.join(os.path.abspath(ckpt_dir), MANIFEST)
    names = sorted(set(names))
    _prefetch_digests(ckpt_dir, [n for n in names if n in files])
    for name in names:
        file = os.path.join(ckpt_dir, name)
        want = files.get(name)
        if want is None:
            raise ConfigError(f"checkpoint file {manifest} does not list {name}, which loom "
                              f"reads: the manifest was edited or files were mixed in; restore "
                              f"it{tail}")
        try:
            stamp = _stamp(file)
        except FileNotFoundError:
            raise ConfigError(f"checkpoint file {file} is missing ({MANIFEST} lists it): the "
                              f"checkpoint was removed or damaged while being read{tail}") from None
        if stamp[0] != want["size"]:
            raise ConfigError(f"checkpoint file {file} has {stamp[0]} bytes, {want['size']} "
                              f"when saved: the checkpoint is corrupted{tail}")
        if _digest(os.path.abspath(file), stamp) != want[ALGORITHM]:
            raise ConfigError(f"checkpoint file {file} changed since it was saved (its "
                              f"{ALGORITHM} checksum differs from {MANIFEST}): the checkpoint "
                              f"is corrupted{tail}")


def manifest_problems(ckpt_dir: str, needed: Iterable[str] = ()) -> Optional[list[str]]:
    """Every problem of ``ckpt_dir`` against its manifest, one line each (a missing manifest of
    a current-format checkpoint, a file of ``needed`` it leaves out, a missing, resized or
    changed file): what ``loom checkpoint inspect`` reports. None for an older format without
    a manifest."""
    try:
        files = manifest_of(ckpt_dir)
    except ConfigError as e:
        return [str(e)]
    if files is None:
        return None
    problems = [f"{MANIFEST} does not list {n}" for n in dict.fromkeys(needed) if n not in files]
    for name, want in files.items():
        file = os.path.join(ckpt_dir, name)
        if not os.path.isfile(file):
            problems.append(f"{file} is missing")
        elif os.path.getsize(file) != want["size"]:
            problems.append(f"{file} has {os.path.getsize(file)} bytes, {want['size']} when saved")
        elif _digest(os.path.abspath(file), _stamp(file)) != want[ALGORITHM]:
            problems.append(f"{file} changed since it was saved (its {ALGORITHM} checksum "
                            f"differs from {MANIFEST})")
    return problems


def read_metadata_json(ckpt_dir: str) -> dict:
    """``metadata.json`` of a checkpoint, verified against the manifest; ConfigError naming it
    when unreadable or changed."""
    path = os.path.join(ckpt_dir, "metadata.json")
    verify_read(ckpt_dir, ["metadata.json"])
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint file {path} is unreadable ({e})") from None
    return meta


def check_descriptions(ckpt_dir: str, formats: tuple[str, ...], dcp_keys=None,
                       pointer: Optional[int] = None) -> dict:
    """Refuse a checkpoint whose ``metadata.json`` disagrees with the directory name
    (``iter_N``), the ``pointer`` (the iteration the ``latest`` file named, if it was used),
    the known ``formats``, or DCP's keys ``dcp_keys`` (the saved world size: one ``rng.RRRRR``
    key per rank when generators were saved; the TP size: the ``RofT`` shard suffixes);
    returns the metadata. ConfigError names ``metadata.json`` and what it claims."""
    meta = read_metadata_json(ckpt_dir)
    path = os.path.join(ckpt_dir, "metadata.json")
    name = os.path.basename(os.path.normpath(ckpt_dir))
    it = meta.get("iteration")
    if name.startswith("iter_") and name[5:].isdigit() and it != int(name[5:]):
        raise ConfigError(f"checkpoint file {path} claims iteration {it} but lies in {name}: "
                          f"the files are mixed up; restore the directory")
    if pointer is not None and it != pointer:
        raise ConfigError(f"checkpoint file {path} claims iteration {it} but the latest pointer "
                          f"names {pointer}; restore the directory")
    if meta.get("format") not in formats:
        raise ConfigError(f"checkpoint file {path} claims format {meta.get('format')!r}; loom "
                          f"reads {', '.join(formats)}")
    layout, world = meta.get("layout"), meta.get("world_size")
    if not isinstance(layout, dict) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"checkpoint file {path} holds no valid layout / world_size "
                          f"({layout!r}, {world!r}); restore the file")
    if dcp_keys is not None:
        ranks = {k for k in dcp_keys if k.startswith("rng.")}
        if ranks and len(ranks) != world:
            raise ConfigError(f"checkpoint file {path} claims {world} ranks but DCP's .metadata "
                              f"holds the generators of {len(ranks)}; restore the file")
        tps = {int(k.rsplit("/", 1)[1].split("of")[1]) for k in dcp_keys
               if k.startswith("model.") and "of" in k.rsplit("/", 1)[-1]}
        tp = layout.get("tp")
        if tps - {1} and tps - {1} != {tp}:
            raise ConfigError(f"checkpoint file {path} claims layout {layout} but DCP's "
                              f".metadata holds TP shards of size {sorted(tps - {1})}; restore "
                              f"the file")
    return meta
