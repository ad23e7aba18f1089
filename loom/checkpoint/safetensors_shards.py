"""Sharded safetensors written one tensor at a time, as ``transformers``' ``save_pretrained``
lays them out: ``model.safetensors`` when everything fits one shard, else
``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json`` (``metadata``:
``total_size`` bytes and ``total_parameters``; ``weight_map``: tensor name -> file).

The layout is planned first from names, shapes and the dtype alone (:func:`plan_shards`:
tensors in the given order, a new shard when the next tensor would take the current one past
``max_shard_size``, a tensor larger than that alone in its shard, as ``transformers`` does), so
every file's header is known before any weight is read; :class:`ShardWriter` then writes each
tensor's bytes at its offset as soon as it is computed, in any order, and the caller frees it.
Memory never holds more than the tensors being converted.

The format (https://github.com/huggingface/safetensors, "Format"): 8 bytes little-endian
header length N, N bytes of JSON header (``{name: {dtype, shape, data_offsets: [begin, end]}``,
``__metadata__``: string -> string), padded with spaces to a multiple of 8, then the tensors'
bytes back to back (offsets relative to the end of the header, no holes).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field

import torch

from loom.errors import ConfigError

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.float64: "F64", torch.int64: "I64", torch.int32: "I32"}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text) -> int:
    """Bytes of a size as ``transformers``' ``max_shard_size`` reads it: an int, or
    ``"5GB"`` / ``"500MB"`` (powers of 10) / ``"2GiB"`` (powers of 2). Raises ConfigError
    naming ``--max-shard-size`` otherwise."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).upper() not in _UNITS:
            raise ConfigError(f"--max-shard-size {text!r}: give bytes or a size such as 5GB, "
                              f"500MB or 2GiB")
        size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size < 1:
        raise ConfigError(f"--max-shard-size {text!r}: give a positive size")
    return size


@dataclass
class Shard:
    """One file: its name, tensor name -> (begin, end) byte offsets in the data section, and
    the header bytes (length prefix included)."""
    file: str
    offsets: dict = field(default_factory=dict)
    header: bytes = b""

    @property
    def size(self) -> int:
        return max((end for _, end in self.offsets.values()), default=0)


def _header(tensors: dict, offsets: dict, dtype: torch.dtype) -> bytes:
    head = {name: {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(tensors[name]),
                   "data_offsets": list(offsets[name])} for name in offsets}
    head["__metadata__"] = {"format": "pt"}
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def plan_shards(shapes: dict, dtype: torch.dtype, max_shard_size: int) -> list[Shard]:
    """Shards for ``shapes`` (HF name -> shape, in writing order) stored as ``dtype``: greedy,
    a new shard when the next tensor would pass ``max_shard_size`` bytes."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if groups[-1] and used + nbytes > max_shard_size:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += nbytes
    n = len(groups)
    shards = []
    for i, names in enumerate(groups):
        shard = Shard(SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
        pos = 0
        for name in names:
            end = pos + math.prod(shapes[name]) * dtype.itemsize
            shard.offsets[name] = (pos, end)
            pos = end
        shard.header = _header(shapes, shard.offsets, dtype)
        shards.append(shard)
    return shards


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The little-endian bytes of ``t`` (contiguous, row-major), without copying twice."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class ShardWriter:
    """Writes the files of ``shards`` into ``out_dir`` under temporary names (headers first,
    each file sized to its final length); :meth:`write` puts one tensor's bytes in place;
    :meth:`finish` checks every tensor arrived once, renames the files into place and writes
    the index (more than one shard). ``dtype``: what every tensor is cast to."""

    def __init__(self, out_dir: str, shards: list[Shard], dtype: torch.dtype):
        self.out_dir, self.shards, self.dtype = out_dir, shards, dtype
        self.where = {name: s for s in shards for name in s.offsets}
        self.written: set[str] = set()
        self.tmp = {s.file: os.path.join(out_dir, f".{s.file}.tmp{os.getpid()}") for s in shards}
        for s in shards:
            with open(self.tmp[s.file], "wb") as fh:  # the umask's mode: readable as usual
                fh.write(s.header)
                fh.truncate(len(s.header) + s.size)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Cast ``tensor`` to the export dtype and write it at its planned offset. Raises
        ValueError for a name not planned, written twice, or of another shape."""
        shard = self.where.get(name)
        if shard is None or name in self.written:
            raise ValueError(f"{name}: {'written twice' if shard else 'not in the plan'}")
        begin, end = shard.offsets[name]
        data = tensor_bytes(tensor.to(self.dtype))
        if len(data) != end - begin:
            raise ValueError(f"{name}: {tuple(tensor.shape)} is not the planned shape")
        with open(self.tmp[shard.file], "r+b") as fh:
            fh.seek(len(shard.header) + begin)
            fh.write(data)
        self.written.add(name)

    def finish(self) -> list[str]:
        """Rename every file into place (and write the index); returns the file names. Raises
        ValueError naming tensors never written."""
        missing = sorted(set(self.where) - self.written)
        if missing:
            raise ValueError(f"tensors never written: {missing[:5]}")
        for s in self.shards:
            os.replace(self.tmp[s.file], os.path.join(self.out_dir, s.file))
        files = [s.file for s in self.shards]
        if len(self.shards) > 1:
            weight_map = {name: self.where[name].file for name in sorted(self.where)}
            total = sum(s.size for s in self.shards)
            index = {"metadata": {"total_size": total,
                                  "total_parameters": total // self.dtype.itemsize},
                     "weight_map": weight_map}
            tmp = os.path.join(self.out_dir, f".{INDEX}.tmp{os.getpid()}")
            with open(tmp, "w") as fh:
                json.dump(index, fh, indent=2)
            os.replace(tmp, os.path.join(self.out_dir, INDEX))
            files.append(INDEX)
        return files

    def abort(self) -> None:
        """Remove the temporary files (an export that failed leaves nothing half-written)."""
        for path in self.tmp.values():
            if os.path.exists(path):
                os.remove(path)
