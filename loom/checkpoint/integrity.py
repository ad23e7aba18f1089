"""Know what you load: per-file checksums of every checkpoint, and the agreement of its
descriptions (torch-free: ``loom train`` checks before any process group starts).

``iter_N/manifest.json`` (written by rank 0 once every file is on disk, before the rename that
makes the checkpoint complete)::

    {"algorithm": "blake2b", "files": {"__0_0.distcp": {"size": 1234, "blake2b": "..."}, ...}}

covers every file of the directory (DCP's ``.metadata`` and ``.distcp`` shards, ``common.pt``,
``metadata.json``, ``tokenizer.json``). :func:`verify_manifest` re-reads each file once
(blake2b, about 1 GB/s per core: a start costs one read of the checkpoint) and names the first
file whose size or hash differs: a flipped byte in a shard is refused, never trained on.
:func:`check_descriptions` refuses a ``metadata.json`` that claims another iteration, format
or layout than the directory name, the pointer and DCP's ``.metadata`` (its ``rng.RRRRR``
keys: one per saved rank; its ``RofT`` shard keys: the saved TP size). Checkpoints written
before the manifest existed load with sizes checked only (:func:`verify_manifest` says so).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Optional

from loom.data.checks import file_digest  # blake2b, the same as the datasets'
from loom.errors import ConfigError

MANIFEST = "manifest.json"
ALGORITHM = "blake2b"


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


def manifest_problems(ckpt_dir: str, hashes: bool = True) -> Optional[list[str]]:
    """What differs from ``manifest.json``: one line per missing, resized or changed file
    (``hashes``: compare the digests too, else sizes only); None when the checkpoint has no
    manifest (written before loom kept one)."""
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            files = json.load(fh)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{path} is unreadable ({e})"]
    problems = []
    for name, want in files.items():
        file = os.path.join(ckpt_dir, name)
        if not os.path.isfile(file):
            problems.append(f"{file} is missing")
            continue
        size = os.path.getsize(file)
        if size != want["size"]:
            problems.append(f"{file} has {size} bytes, {want['size']} when saved")
        elif hashes and file_digest(file) != want[ALGORITHM]:
            problems.append(f"{file} changed since it was saved (its {ALGORITHM} checksum "
                            f"differs from {MANIFEST})")
    return problems


def _stamp(ckpt_dir: str) -> tuple:
    """(name, size, mtime) of every file: what a repeated verification in one process keys on."""
    out = []
    for name in sorted(os.listdir(ckpt_dir)):
        st = os.stat(os.path.join(ckpt_dir, name))
        out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


@functools.lru_cache(maxsize=8)
def _problems_cached(ckpt_dir: str, stamp: tuple) -> Optional[tuple]:
    found = manifest_problems(ckpt_dir)
    return None if found is None else tuple(found)


def verify_manifest(ckpt_dir: str, again: str = "") -> bool:
    """Refuse a checkpoint whose files differ from its manifest: ConfigError naming the first
    such file (``again``: the fix appended, e.g. "give --ckpt-step N ..."). False when there is
    no manifest to check against, True when every file matched. The files are read once per
    process while unchanged (``loom train`` checks twice before the first step)."""
    problems = _problems_cached(os.path.abspath(ckpt_dir), _stamp(ckpt_dir))
    if problems:
        raise ConfigError(f"checkpoint file {problems[0]}: the checkpoint is corrupted"
                          + (f"; {again}" if again else ""))
    return problems is not None


def read_metadata_json(ckpt_dir: str) -> dict:
    """``metadata.json`` of a checkpoint; ConfigError naming it when unreadable."""
    path = os.path.join(ckpt_dir, "metadata.json")
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
