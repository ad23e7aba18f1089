"""Reading checkpoints: :class:`DcpIndex` for ``loom-checkpoint-v3`` / ``v2`` (DCP; keys described in
:mod:`loom.checkpoint.io`), :func:`open_checkpoint` picks it or the read-only v1 reader
(:class:`~loom.checkpoint.legacy.LegacyIndex`). Both answer ``names``, ``parameters()``,
``has_optimizer_state(name)`` and ``load(names, optim_names, rng_rank)`` with full (unsharded)
tensors; :func:`load_checkpoint` and :func:`load_model_weights` cut this rank's shards
(``local_shard``) for the current layout. Also re-exported by :mod:`loom.checkpoint.io`.

Every file is verified against the checkpoint's manifest when it is read, by the rank that
reads it (:func:`loom.checkpoint.integrity.verify_read`): DCP's ``.metadata`` when the index
opens, the ``.distcp`` files holding the entries a load asks for, ``common.pt``.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from contextlib import contextmanager
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from loom.checkpoint.legacy import LegacyIndex, canonical_name, is_legacy
from loom.checkpoint.megatron import common as megatron
from loom.checkpoint.megatron.locate import locate
from loom.checkpoint.optimizer_state import load_optimizer_state_by_name
from loom.checkpoint.safety import resolve_checkpoint
from loom.errors import ConfigError
from loom.parallel.mesh import ParallelMesh
from loom.parallel.random import RNGTracker, set_rng_state
from loom.parallel.fsdp import shard_like
from loom.parallel.registry import ShardSpec, full_from_shards, local_shard, named_parameters


@contextmanager
def single_process_quiet():
    """Silence DCP's warning that a read/write without a process group is single-process (it
    is meant: each rank reads its own keys; one process saves alone)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class DcpIndex:
    """A v2 checkpoint's keys (from DCP's ``.metadata``); :meth:`load` reads what is asked.
    Parameters go by today's names (:func:`~loom.checkpoint.legacy.canonical_name`: a
    checkpoint saved before a module was renamed loads into the renamed module)."""

    def __init__(self, ckpt_dir: str):
        from loom.checkpoint.safety import dcp_storage
        self.path = ckpt_dir
        self.metadata = dcp_storage(ckpt_dir)  # DCP's .metadata, verified
        self.md = self.metadata.state_dict_metadata
        self.model: dict[str, dict[str, str]] = {}  # name -> {"RofT": key}
        self.optim: dict[str, dict[str, dict[str, str]]] = {}  # name -> {state: {"RofT": key}}
        self.saved_name: dict[str, str] = {}  # today's name -> the name in the checkpoint
        for key in self.md:
            kind, _, rest = key.partition(".")
            if kind == "model":
                saved, _, shard = rest.rpartition("/")
                name = canonical_name(saved)
                self.saved_name[name] = saved
                self.model.setdefault(name, {})[shard] = key
            elif kind == "optim":
                saved, shard, state = rest.rsplit("/", 2)
                self.optim.setdefault(canonical_name(saved), {}).setdefault(state, {})[shard] = key

    @property
    def names(self) -> list[str]:
        return list(self.model)

    def has_optimizer_state(self, name: str) -> bool:
        return name in self.optim

    def _read(self, keys: Iterable[str]) -> dict[str, Any]:
        """One ``dcp.load`` of ``keys`` into empty tensors of the saved shapes (objects: as
        saved); each rank reads only its own keys (no collective), after verifying the files
        that hold them."""
        keys = list(keys)
        want: dict[str, dict[str, Any]] = {}
        for k in keys:
            m = self.md[k]
            kind, _, rest = k.partition(".")
            want.setdefault(kind, {})[rest] = torch.empty(m.size, dtype=m.properties.dtype) \
                if isinstance(m, TensorStorageMetadata) else b""
        if want:
            from loom.checkpoint.integrity import verify_read
            asked = set(keys)
            verify_read(self.path, {info.relative_path for index, info
                                    in self.metadata.storage_data.items() if index.fqn in asked})
            with single_process_quiet():
                dcp.load(want, storage_reader=FileSystemReader(self.path), no_dist=True)
        return {f"{kind}.{k}": v for kind, section in want.items() for k, v in section.items()}

    def _missing(self, name: str) -> KeyError:
        return KeyError(f"parameter {name} not in checkpoint {self.path}")

    @staticmethod
    def _ordered(shards: dict[str, str]) -> list[str]:
        return [shards[s] for s in sorted(shards, key=lambda s: int(s.split("of")[0]))]

    def _spec_key(self, name: str) -> str:
        return f"param.{self.saved_name[name]}"

    def parameters(self) -> dict[str, dict]:
        """``name -> {shape (global), dtype}``, without reading any tensor."""
        specs = self._read(self._spec_key(n) for n in self.model)
        return {n: {"shape": json.loads(specs[self._spec_key(n)])["full_shape"],
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
        keys += [self._spec_key(n) for n in set(names) | set(optim_names)]
        keys += [k for n in optim_names for st in self.optim.get(n, {}).values()
                 for k in st.values()]
        rng_key = f"rng.{rng_rank:05d}" if rng_rank is not None else None
        if rng_key in self.md:
            keys.append(rng_key)
        got = self._read(dict.fromkeys(keys))

        def full(name: str, shards: dict[str, str]) -> torch.Tensor:
            spec = ShardSpec.from_dict(json.loads(got[self._spec_key(name)])["shard"])
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


def open_checkpoint(ckpt_dir: str, model_cfg=None):
    """The reader of ``ckpt_dir``: :class:`DcpIndex` (v2), the read-only v1
    :class:`~loom.checkpoint.legacy.LegacyIndex`, or a Megatron checkpoint's
    :class:`~loom.checkpoint.megatron.index.MegatronIndex` (for a model of ``model_cfg``,
    default: its saved args'); all have ``names``, ``parameters()``,
    ``has_optimizer_state(name)`` and ``load(names, optim_names, rng_rank)``."""
    found = megatron.found_at(ckpt_dir)
    if found is not None:
        return megatron.open_index(found, model_cfg)
    return LegacyIndex(ckpt_dir) if is_legacy(ckpt_dir) else DcpIndex(ckpt_dir)


def latest_checkpoint(load_dir: str, step: Optional[int] = None) -> Optional[str]:
    """The directory named by ``latest_checkpointed_iteration.txt`` (or ``iter_{step}``), or
    None when ``load_dir`` holds no checkpoint. Raises ConfigError naming the pointer file when
    it is unreadable or names a missing iteration (see
    :func:`loom.checkpoint.safety.resolve_checkpoint`). A Megatron-LM checkpoint directory
    (:func:`loom.checkpoint.megatron.locate.locate`) resolves the same way."""
    found = locate(load_dir, step)
    return found.path if found is not None else resolve_checkpoint(load_dir, step)


def read_common(ckpt_dir: str, verify: bool = True) -> dict:
    """``common.pt`` of a checkpoint (iteration, consumed samples, scheduler, config), verified
    against the manifest. Raises ConfigError naming the file when it is corrupt or unreadable
    (one line, no traceback), or written in another format than ``metadata.json`` claims (a
    checkpoint relabelled to skip the manifest). ``verify=False``: neither (``loom checkpoint
    inspect`` describing a checkpoint it reports damaged). A Megatron checkpoint's:
    :func:`loom.checkpoint.megatron.common.read_common`."""
    found = megatron.found_at(ckpt_dir)
    if found is not None:
        return megatron.read_common(found)
    from loom.checkpoint.integrity import _claimed_format, verify_read
    path = os.path.join(ckpt_dir, "common.pt")
    if verify:
        verify_read(ckpt_dir, ["common.pt"])
    try:
        common = torch.load(path, map_location="cpu", weights_only=False)
        if not isinstance(common, dict) or "iteration" not in common:
            raise ValueError("it holds no checkpoint state")
    except Exception as e:  # noqa: BLE001 - any unpickling error means a damaged file
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"checkpoint file {path} is unreadable ({why}); it was truncated or "
                          f"overwritten: give --ckpt-step N to load another checkpoint") from None
    written, claimed = common.get("format"), _claimed_format(ckpt_dir)
    if verify and written is not None and claimed != written:
        raise ConfigError(f"checkpoint file {os.path.join(ckpt_dir, 'metadata.json')} claims "
                          f"format {claimed!r} but {path} was written as {written}: the files "
                          f"were edited; restore the checkpoint")
    return common


def _named_params(model_chunks: Sequence[nn.Module]) -> dict[str, tuple]:
    """``name -> (parameter, ParamMeta)`` over this rank's chunks."""
    return {n: (p, meta) for n, p, meta in named_parameters(model_chunks)}


@torch.no_grad()
def load_model_weights(index, model_chunks: Sequence[nn.Module], mesh: ParallelMesh) -> None:
    """Copy this rank's shard of every parameter from ``index`` (:func:`open_checkpoint`)."""
    params = _named_params(model_chunks)
    full, _, _ = index.load(params)
    for name, (p, meta) in params.items():
        p.copy_(shard_like(p, local_shard(full[name], meta, *mesh.shard_of(meta), name)))


@torch.no_grad()
def restore_model_and_optimizer(model_chunks: Sequence[nn.Module], optimizer, mesh: ParallelMesh,
                                full: dict, states: dict) -> None:
    """Copy this rank's shard of the full weights ``full`` (``{name: tensor}``) into the model
    and install the full Adam states ``states`` (:func:`_restore_optimizer`): the vocabulary
    rows of both re-padded to this layout's (``local_shard``)."""
    params = _named_params(model_chunks)
    for name, (p, meta) in params.items():
        p.copy_(shard_like(p, local_shard(full[name], meta, *mesh.shard_of(meta), name)))
    _restore_optimizer(optimizer, params, full, {n: s for n, s in states.items() if n in params},
                       mesh)


def _restore_optimizer(optimizer, params: dict[str, tuple], full: dict, states: dict,
                       mesh: ParallelMesh) -> None:
    """Install the loaded Adam states (and fp32 ``master_param``), resharded for this layout:
    cut to this TP rank's shape (``local_shard``; ZeRO-3: this DP rank's rows, ``shard_like``),
    then :func:`loom.checkpoint.optimizer_state.load_optimizer_state_by_name` (the distributed
    optimizer keeps its DP shard of each)."""
    local_states = {}
    for name, saved in states.items():
        p, meta = params[name]
        state = {}
        for k, v in saved.items():
            if torch.is_tensor(v) and v.ndim > 0 and v.shape == full[name].shape:
                v = shard_like(p, local_shard(v, meta, *mesh.shard_of(meta), name))
            state[k] = v
        local_states[name] = state
    load_optimizer_state_by_name(optimizer, {n: p for n, (p, _) in params.items()}, local_states)


@torch.no_grad()
def load_checkpoint(load_dir: str, model_chunks: Sequence[nn.Module],
                    optimizer: Optional[torch.optim.Optimizer], scheduler, mesh: ParallelMesh,
                    tracker: Optional[RNGTracker], step: Optional[int] = None,
                    model_cfg=None) -> Optional[dict]:
    """Restore the latest checkpoint of ``load_dir`` into this rank's model (and optimizer,
    scheduler, RNG); returns the common state (``iteration``, ``consumed_samples``, ``config``;
    ``checkpoint_dir``, ``saved_layout``, ``optimizer_restored``, ``rng_restored``: what was
    loaded), or None when ``load_dir`` holds no checkpoint yet (the run then starts from scratch).
    ``step`` (``--ckpt-step``) loads ``iter_{step}`` instead of the pointer's iteration; a broken
    pointer raises ConfigError naming the file.

    Works across layouts: weights and Adam states are resharded by name (also across DP sizes
    and with or without the distributed optimizer). RNG states are restored
    only when the world size and layout match (otherwise the generators keep their fresh seeds).
    A Megatron checkpoint is read as a model of ``model_cfg`` (default: its saved args'):
    weights, Adam states where its layout maps (else ConfigError unless ``optimizer`` is None),
    the scheduler at its iteration; its generators are not loom's (fresh seeds).
    """
    ckpt = latest_checkpoint(load_dir, step)
    if ckpt is None:
        return None
    found = megatron.found_at(ckpt)
    index = open_checkpoint(ckpt, model_cfg)
    same_layout, meta = False, {}  # (a Megatron checkpoint's generators are not loom's)
    if found is not None:
        index.check_complete()
        if optimizer is not None and not index.optim_ok:
            raise ConfigError(megatron.optimizer_refusal(found))
    else:
        from loom.checkpoint.integrity import read_metadata_json
        meta = read_metadata_json(ckpt)
        world = dist.get_world_size() if dist.is_initialized() else 1
        same_layout = meta.get("world_size") == world and meta.get("layout") == mesh.sizes
    params = _named_params(model_chunks)
    optim_names = [] if optimizer is None else [n for n in params
                                                if index.has_optimizer_state(n)]
    full, states, rng = index.load(params, optim_names,
                                   mesh.rank if tracker is not None and same_layout else None)
    for name, (p, pmeta) in params.items():  # ZeRO-3 (DTensor): this DP rank's slice
        p.copy_(shard_like(p, local_shard(full[name], pmeta, *mesh.shard_of(pmeta), name)))
    if optimizer is not None:
        _restore_optimizer(optimizer, params, full, states, mesh)
    common = read_common(ckpt)
    if scheduler is not None and (found is not None or common.get("scheduler") is None):
        scheduler.last_epoch = common["iteration"]  # the schedule continues at its iteration
        # (Megatron's; a converted torchtitan run's, which saves no loom scheduler state)
    if scheduler is not None and common.get("scheduler") is not None:
        scheduler.load_state_dict(common["scheduler"])
        # load_state_dict restores the schedule, not the optimizer's current lr: set it too.
        for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    if rng is not None:
        set_rng_state(rng, tracker)
    common["checkpoint_dir"] = ckpt
    common.update(saved_layout=meta.get("layout"), optimizer_restored=bool(optim_names),
                  rng_restored=rng is not None)  # what the run's resume line says
    return common
