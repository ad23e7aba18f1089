"""Reading checkpoints: :class:`DcpIndex` for ``loom-checkpoint-v2`` (DCP; keys described in
:mod:`loom.checkpoint.io`), :func:`open_checkpoint` picks it or the read-only v1 reader
(:class:`~loom.checkpoint.legacy.LegacyIndex`). Both answer ``names``, ``parameters()``,
``has_optimizer_state(name)`` and ``load(names, optim_names, rng_rank)`` with full (unsharded)
tensors; the caller cuts its shard (``local_shard``).
"""

from __future__ import annotations

import io
import json
import warnings
from contextlib import contextmanager
from typing import Any, Iterable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from loom.checkpoint.legacy import LegacyIndex, is_legacy
from loom.parallel.registry import ShardSpec, full_from_shards


@contextmanager
def single_process_quiet():
    """Silence DCP's warning that a read/write without a process group is single-process (it
    is meant: each rank reads its own keys; one process saves alone)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class DcpIndex:
    """A v2 checkpoint's keys (from DCP's ``.metadata``); :meth:`load` reads what is asked."""

    def __init__(self, ckpt_dir: str):
        self.path = ckpt_dir
        self.metadata = FileSystemReader(ckpt_dir).read_metadata()  # DCP's .metadata
        self.md = self.metadata.state_dict_metadata
        self.model: dict[str, dict[str, str]] = {}  # name -> {"RofT": key}
        self.optim: dict[str, dict[str, dict[str, str]]] = {}  # name -> {state: {"RofT": key}}
        for key in self.md:
            kind, _, rest = key.partition(".")
            if kind == "model":
                name, _, shard = rest.rpartition("/")
                self.model.setdefault(name, {})[shard] = key
            elif kind == "optim":
                name, shard, state = rest.rsplit("/", 2)
                self.optim.setdefault(name, {}).setdefault(state, {})[shard] = key

    @property
    def names(self) -> list[str]:
        return list(self.model)

    def has_optimizer_state(self, name: str) -> bool:
        return name in self.optim

    def _read(self, keys: Iterable[str]) -> dict[str, Any]:
        """One ``dcp.load`` of ``keys`` into empty tensors of the saved shapes (objects: as
        saved); each rank reads only its own keys (no collective)."""
        want: dict[str, dict[str, Any]] = {}
        for k in keys:
            m = self.md[k]
            kind, _, rest = k.partition(".")
            want.setdefault(kind, {})[rest] = torch.empty(m.size, dtype=m.properties.dtype) \
                if isinstance(m, TensorStorageMetadata) else b""
        if want:
            with single_process_quiet():
                dcp.load(want, storage_reader=FileSystemReader(self.path), no_dist=True)
        return {f"{kind}.{k}": v for kind, section in want.items() for k, v in section.items()}

    def _missing(self, name: str) -> KeyError:
        return KeyError(f"parameter {name} not in checkpoint {self.path}")

    @staticmethod
    def _ordered(shards: dict[str, str]) -> list[str]:
        return [shards[s] for s in sorted(shards, key=lambda s: int(s.split("of")[0]))]

    def parameters(self) -> dict[str, dict]:
        """``name -> {shape (global), dtype}``, without reading any tensor."""
        specs = self._read(f"param.{n}" for n in self.model)
        return {n: {"shape": json.loads(specs[f"param.{n}"])["full_shape"],
                    "dtype": self.md[next(iter(self.model[n].values()))].properties.dtype}
                for n in self.model}

    def load(self, names: Iterable[str], optim_names: Iterable[str] = (),
             rng_rank: Optional[int] = None) -> tuple[dict, dict, Optional[dict]]:
        """(full weights by name, Adam states by name: full tensors for parameter-shaped
        states, the saved value otherwise, the generators of ``rng_rank`` or None), in one
        ``dcp.load`` of every TP shard these parameters were saved in."""
        names, optim_names = list(names), list(optim_names)
        for n in names + optim_names:
            if n not in self.model:
                raise self._missing(n)
        keys = [k for n in names for k in self.model[n].values()]
        keys += [f"param.{n}" for n in set(names) | set(optim_names)]
        keys += [k for n in optim_names for st in self.optim.get(n, {}).values()
                 for k in st.values()]
        rng_key = f"rng.{rng_rank:05d}" if rng_rank is not None else None
        if rng_key in self.md:
            keys.append(rng_key)
        got = self._read(dict.fromkeys(keys))

        def full(name: str, shards: dict[str, str]) -> torch.Tensor:
            spec = ShardSpec.from_dict(json.loads(got[f"param.{name}"])["shard"])
            return full_from_shards([got[k] for k in self._ordered(shards)], spec)

        model = {n: full(n, self.model[n]) for n in names}
        optim = {}
        for n in optim_names:
            shape = self.md[next(iter(self.model[n].values()))].size
            optim[n] = {}
            for state, shards in self.optim.get(n, {}).items():
                first = got[self._ordered(shards)[0]]
                param_shaped = torch.is_tensor(first) and first.ndim > 0 and first.shape == shape
                optim[n][state] = full(n, shards) if param_shaped else first
        rng = torch.load(io.BytesIO(got[rng_key]), weights_only=False) \
            if rng_key in got else None
        return model, optim, rng


def open_checkpoint(ckpt_dir: str):
    """The reader of ``ckpt_dir``: :class:`DcpIndex` (v2) or the read-only v1
    :class:`~loom.checkpoint.legacy.LegacyIndex`; both have ``names``, ``parameters()``,
    ``has_optimizer_state(name)`` and ``load(names, optim_names, rng_rank)``."""
    return LegacyIndex(ckpt_dir) if is_legacy(ckpt_dir) else DcpIndex(ckpt_dir)
