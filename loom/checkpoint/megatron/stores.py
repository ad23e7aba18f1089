"""The two on-disk formats of a Megatron checkpoint as one interface: ``covers(key, index)``,
``shape(key)``, ``dtype(key)``, ``read(keys)`` (full tensors), ``optimizer_key(state, key)``,
``optimizer_layout()`` and ``common`` (the non-tensor state: args, iteration, ...).

:class:`DistStore` (``torch_dist``): DCP's ``.metadata`` lists every key with its global shape
and the chunks written; a tensor is read whole with one ``dcp.load`` (no process group).
Optimizer states of the non-distributed optimizer, and of the distributed one saved with
``--dist-ckpt-optim-fully-reshardable``, are model-space tensors ``optimizer.state.<state>.<model
key>`` (``exp_avg``, ``exp_avg_sq``; the fp32 master weights as ``fp32_param`` or ``param``),
possibly under ``chained_<n>.``; the distributed optimizer's default ``dp_reshardable`` layout
(``optimizer.distributed.dp_group_idx_*``: flat per-DP-rank buckets) does not map to parameters.

:class:`TorchStore` (``torch``): every ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` read; its
``model`` (``model<v>`` per virtual pipeline chunk) keys renamed to global per-layer names (the
local layer index plus the layers of the stages and chunks before it, in Megatron's order:
chunk-major, then stage; local experts ``local_experts.<e>`` -> ``<ep e_local + e>``); the TP
shards of a key are joined by the caller's ``ShardSpec`` (:meth:`TorchStore.read`).
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Optional

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from loom.checkpoint.megatron.args import load_pickle
from loom.checkpoint.megatron.locate import diagnose, mp_rank_dirs
from loom.errors import ConfigError

_OPT = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(\w+?)\.(.+)$")
MASTER_STATES = ("fp32_param", "param")


class DistStore:
    """A ``torch_dist`` directory (see the module docstring)."""

    format = "torch_dist"

    def __init__(self, path: str):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        self.path = path
        try:
            self.md = FileSystemReader(path).read_metadata().state_dict_metadata
        except Exception as e:  # noqa: BLE001 - a damaged index: one line
            raise ConfigError(f"Megatron checkpoint {path}: DCP's .metadata is unreadable "
                              f"({str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__})"
                              f"; the save did not finish or the file was damaged") from None
        self.tensors = {k: v for k, v in self.md.items() if isinstance(v, TensorStorageMetadata)}
        self.opt: dict[str, dict[str, str]] = {}  # state -> model key -> dcp key
        for k in self.tensors:
            m = _OPT.match(k)
            if m:
                self.opt.setdefault(m[1], {})[m[2]] = k
        common = os.path.join(path, "common.pt")
        self.common = load_pickle(common) if os.path.exists(common) else {}
        self._cache: dict[str, torch.Tensor] = {}

    def covers(self, key: str, index: tuple[int, ...] = ()) -> bool:
        """Whether ``key`` holds a tensor with the leading ``index`` written."""
        md = self.tensors.get(key)
        if md is None:
            return False
        if not index:
            return True
        if len(md.size) < len(index) + 1:
            return False
        return any(all(c.offsets[d] <= i < c.offsets[d] + c.sizes[d]
                       for d, i in enumerate(index)) for c in md.chunks)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def read(self, wanted: Iterable[tuple], spec_of=None) -> dict[tuple, torch.Tensor]:
        """``{(key, index): tensor}`` in one ``dcp.load``: for a stacked key only the rows
        ``index`` (a layer, a layer's expert) are read, so a rank reads its own layers and a
        whole stack is never in memory at once. Each region is read once per store."""
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        want = {}
        for key, index in dict.fromkeys(wanted):
            if (key, index) in self._cache:
                continue
            size = self.tensors[key].size
            region = (*(1,) * len(index), *size[len(index):])
            want[(key, index)] = torch.zeros(region, dtype=self.dtype(key))
        if want:
            with warnings.catch_warnings():  # (one process reading alone is meant)
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({}, storage_reader=FileSystemReader(self.path), no_dist=True,
                         planner=_RegionLoadPlanner(want))
            self._cache.update({k: v.reshape(v.shape[len(k[1]):]) for k, v in want.items()})
        return {k: self._cache[k] for k in dict.fromkeys(wanted)}

    def forget(self) -> None:
        self._cache.clear()

    def optimizer_key(self, state: str, key: str) -> Optional[str]:
        return self.opt.get(state, {}).get(key)

    def optimizer_layout(self) -> tuple[bool, str]:
        """(whether the Adam states map to parameters, the one-line description)."""
        if "exp_avg" in self.opt or "momentum_buffer" in self.opt:
            return True, ("optimizer states by parameter (Adam's, SGD's or Muon's momentum: "
                          "Megatron's non-distributed optimizer, or the distributed one saved "
                          "fully reshardable)")
        if any(k.startswith(("optimizer.distributed.", "chained_")) and ".distributed." in k
               or k.startswith("optimizer.distributed.") for k in self.md):
            return False, ("its Adam states are the distributed optimizer's dp_reshardable "
                           "buckets (flat per-data-parallel-rank buffers in Megatron's bucket "
                           "order, which name no parameter; Megatron writes parameter-shaped "
                           "states with --dist-ckpt-optim-fully-reshardable)")
        return False, "it holds no optimizer state (saved with --no-save-optim)"

    def listing(self) -> dict[str, tuple]:
        """``{key: (global shape, dtype)}`` of every tensor, for ``loom checkpoint inspect``."""
        return {k: (tuple(v.size), v.properties.dtype) for k, v in self.tensors.items()}


class _RegionLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner over explicit regions ``{(key, index): tensor}``: the rows ``index``
    of the stored global tensor ``key`` (all of it for ``()``), read into ``tensor``."""

    def __init__(self, regions: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.regions = regions
        self.by_fqn: dict[str, list] = {}

    def create_local_plan(self) -> LoadPlan:
        items = []
        for (key, index), t in self.regions.items():
            offsets = (*index, *([0] * (t.ndim - len(index))))
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.size())
            for item in create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key],
                                                         [chunk]):
                items.append(item)
                self.by_fqn.setdefault((key, tuple(item.dest_index.offset)), t)
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = self.by_fqn[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        return narrow_tensor_by_index(t, read_item.dest_offsets, read_item.lengths)


_LAYER_KEY = re.compile(r"^(decoder\.layers\.|mtp\.layers\.)(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(.+)$")
_GROUPED = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")


class TorchStore:
    """A ``--ckpt-format torch`` directory (see the module docstring)."""

    format = "torch"

    def __init__(self, path: str, raw: Optional[dict] = None):
        """``raw``: the files' contents ``{(tp, pp, ep): dict}`` when already in memory (e.g.
        the state dicts of a live Megatron-Core model's ranks); else read from ``path``."""
        self.path = path
        files = mp_rank_dirs(path) if raw is None else {}
        if raw is None:
            raw = {rank: load_pickle(os.path.join(d, "model_optim_rng.pt"))
                   for rank, d in sorted(files.items())}
        legacy = next((sd for sd in raw.values() for _, m in self._chunks(sd)
                       if "language_model" in m), None)
        if legacy is not None:
            raise ConfigError(
                f"Megatron checkpoint {path} holds a legacy model (--use-legacy-models: "
                f"language_model.* keys); loom reads Megatron-Core's: convert it with Megatron-LM "
                f"<= core_v0.12's tools/checkpoint/convert.py --loader legacy --saver core")
        self.tp = 1 + max(t for t, _, _ in raw)
        self.pp = 1 + max(p for _, p, _ in raw)
        self.ep = 1 + max(e for _, _, e in raw)
        self.common = raw[min(raw)]
        self.has_optimizer = any("optimizer" in v for v in raw.values()) or any(
            os.path.exists(os.path.join(d, "distrib_optim.pt")) for d in files.values())
        self.shards: dict[str, dict[int, torch.Tensor]] = {}  # global key -> tp -> shard
        offsets = self._layer_offsets(raw)
        for (tp, pp, ep), sd in raw.items():
            for v, model in self._chunks(sd):
                for key, value in model.items():
                    if key.endswith("_extra_state") or not torch.is_tensor(value):
                        continue
                    name = self._global(key, offsets[(pp, v)], ep, model)
                    self.shards.setdefault(name, {})[tp] = value

    @staticmethod
    def _chunks(sd: dict) -> list[tuple[int, dict]]:
        if "model" in sd:
            return [(0, sd["model"])]
        return sorted((int(k[5:]), v) for k, v in sd.items() if re.fullmatch(r"model\d+", k))

    def _layer_offsets(self, raw: dict) -> dict[tuple[int, int], int]:
        """``{(pp, chunk): global index of its first decoder layer}`` (chunk-major order)."""
        counts = {}
        for (tp, pp, ep), sd in raw.items():
            if tp or ep:
                continue
            for v, model in self._chunks(sd):
                idx = {int(m[2]) for k in model for m in [_LAYER_KEY.match(k)]
                       if m and m[1] == "decoder.layers."}
                counts[(pp, v)] = max(idx) + 1 if idx else 0
        out, at = {}, 0
        for v in sorted({v for _, v in counts}):
            for p in range(self.pp):
                out[(p, v)] = at
                at += counts.get((p, v), 0)
        return out

    @staticmethod
    def _global(key: str, layer_offset: int, ep: int, model: dict) -> str:
        m = _LAYER_KEY.match(key)
        if m and m[1] == "decoder.layers.":
            key = f"{m[1]}{int(m[2]) + layer_offset}.{m[3]}"
        m = _LOCAL_EXPERT.match(key)
        if m:
            local = len({k.split("local_experts.")[1].split(".")[0] for k in model
                         if "local_experts." in k and k.startswith(m[1])})
            return f"{m[1]}{ep * local + int(m[2])}.{m[3]}"
        m = _GROUPED.match(key)
        if m:
            local = len({k for k in model if re.match(re.escape(m[1] + m[2] + "." + m[3]) + r"\d+$", k)})
            return f"{m[1]}{ep * local + int(m[4])}.{m[2]}.{m[3]}"
        return key

    def covers(self, key: str, index: tuple[int, ...] = ()) -> bool:
        return not index and key in self.shards

    def shape(self, key: str) -> tuple[int, ...]:
        shards = self.shards[key]
        return tuple(shards[min(shards)].shape)

    def dtype(self, key: str) -> torch.dtype:
        shards = self.shards[key]
        return shards[min(shards)].dtype

    def read(self, wanted: Iterable[tuple], spec_of=None) -> dict[tuple, Any]:
        """``{(key, ()): full tensor}``: the TP shards joined by ``spec_of(key) -> (ShardSpec
        or None, full shape)`` (a shard already of the full shape is TP-replicated: rank 0's
        is used); the ``torch`` format stacks nothing, so every index is ``()``."""
        from loom.parallel.registry import full_from_shards
        out = {}
        for k, _ in wanted:
            shards = [self.shards[k][t] for t in sorted(self.shards[k])]
            spec, full = spec_of(k) if spec_of else (None, None)
            if len(shards) == 1 or spec is None or (full is not None and tuple(
                    shards[0].shape[1:]) == tuple(full[1:]) and shards[0].shape[0] == full[0]):
                out[(k, ())] = shards[0]
            else:
                out[(k, ())] = full_from_shards(shards, spec)
        return out

    def forget(self) -> None:
        pass

    def optimizer_key(self, state: str, key: str) -> Optional[str]:
        return None

    def optimizer_layout(self) -> tuple[bool, str]:
        if self.has_optimizer:
            return False, ("the torch format keys its optimizer state by position in "
                           "Megatron's parameter groups (distrib_optim.pt: by bucket), not by "
                           "parameter name")
        return False, "it holds no optimizer state (saved with --no-save-optim)"

    def listing(self) -> dict[str, tuple]:
        return {k: (self.shape(k), self.dtype(k)) for k in self.shards}


def open_store(path: str, fmt: str):
    """The store of a located checkpoint directory (``fmt``: torch_dist or torch). Raises
    ConfigError (one line, :func:`~.locate.diagnose`) for a directory missing its files."""
    why = diagnose(path)
    if why:
        raise ConfigError(why)
    return DistStore(path) if fmt == "torch_dist" else TorchStore(path)
