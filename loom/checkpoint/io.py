"""Checkpoints: atomic, per-shard, keyed by global parameter names (so they load at any layout).

Layout of ``--save DIR`` (Megatron's names where they exist)::

    DIR/latest_checkpointed_iteration.txt      written last, atomically (os.replace)
    DIR/iter_0000100/metadata.json             format, iteration, parallel layout
    DIR/iter_0000100/common.pt                 iteration, consumed samples, LR scheduler, config
    DIR/iter_0000100/model_tp00_pp000.pt       one per (tp, pp) shard: weights, and every
                                               (``_ep001``...: the experts of EP rank 1...)
                                               parameter's full shape + ShardSpec
    DIR/iter_0000100/optim_tp00_pp000_dp000.pt Adam states by parameter name (dp rank 0, or
                                               every DP rank's shard with the distributed optimizer)
    DIR/iter_0000100/rng_00000.pt              every rank's generators
    DIR/iter_0000100/tokenizer.json            so `loom generate` needs no tokenizer flags

All ranks write into ``iter_0000100.tmp``; rank 0 renames it and only then moves the ``latest``
pointer, so a crash at any moment leaves the previous checkpoint intact and never a half-written
one. Loading rebuilds each full tensor from the saved shards (``full_from_shards``) and cuts this
rank's shard for the current layout (``local_shard``, reading the parameter registry), so a checkpoint saved at one TP/PP size
loads at another (e.g. TP=2 training -> TP=1 generation).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from loom.checkpoint.safety import LATEST, resolve_checkpoint
from loom.errors import CheckpointWriteError
from loom.parallel.mesh import ParallelMesh
from loom.parallel.random import RNGTracker, get_rng_state, set_rng_state
from loom.parallel.registry import ShardSpec, full_from_shards, local_shard, named_parameters
from loom.training.optimizer import load_optimizer_state_by_name, optimizer_state_by_name

FORMAT = "loom-checkpoint-v1"


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _named_params(model_chunks: Sequence[nn.Module]) -> dict[str, tuple]:
    """``name -> (parameter, ParamMeta)`` over this rank's chunks."""
    return {n: (p, meta) for n, p, meta in named_parameters(model_chunks)}


def _spec_of(meta) -> Optional[dict]:
    return meta.shard.to_dict() if meta.shard is not None else None


def canonical_name(name: str) -> str:
    """Parameter names of loom checkpoints written before recomputation kept names
    (``layers.N.layer.*`` under ``--recompute-granularity full``) map to today's names."""
    return re.sub(r"^layers\.(\d+)\.layer\.", r"layers.\1.", name)


def _open_for_write(path: str):
    """The file a checkpoint part is written to (Python I/O, so a full disk raises OSError
    ENOSPC rather than a bare iostream error)."""
    return open(path, "wb")


def _torch_save(obj, path: str) -> None:
    with _open_for_write(path) as fh:
        torch.save(obj, fh)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with _open_for_write(tmp) as fh:
        fh.write(text.encode())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _save_failed(save_dir: str, iteration: int, tmp: str, err: OSError) -> CheckpointWriteError:
    shutil.rmtree(tmp, ignore_errors=True)
    where = f" ({err.filename})" if getattr(err, "filename", None) else ""
    return CheckpointWriteError(
        f"saving the checkpoint of iteration {iteration} to {save_dir} failed: "
        f"{err.strerror or err}{where}; removed the partial {tmp}, the previous checkpoint is "
        f"intact. Free space or choose another --save directory")


def _write_checkpoint(final, tmp, save_dir, iteration, model_chunks, optimizer, scheduler, mesh,
                      tracker, consumed_samples, config, tokenizer_file) -> None:
    if _rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    c = mesh.coords
    params = _named_params(model_chunks)
    # The first DP replica writes (with expert parallelism: its e ranks, each adding its own
    # experts in an ``_epXXX`` file; dense weights come from EP rank 0 only).
    writer = c["dp"] < mesh.ep_size and c["cp"] == 0
    ep_rank = mesh.ep_rank
    suffix = f"_ep{ep_rank:03d}" if ep_rank > 0 else ""
    if ep_rank > 0:
        params = {n: pm for n, pm in params.items() if pm[1].expert_parallel}
    if writer:
        shard = {
            "model": {n: p.detach().cpu() for n, (p, _) in params.items()},
            "specs": {n: {"full_shape": list(meta.full_shape), "shard": _spec_of(meta)}
                      for n, (_, meta) in params.items()},
            "tp_rank": c["tp"], "pp_rank": c["pp"],
        }
        _torch_save(shard, os.path.join(tmp, f"model_tp{c['tp']:02d}_pp{c['pp']:03d}{suffix}.pt"))
    # full TP-local states by name (the distributed optimizer gathers its DP shards: collective)
    states = optimizer_state_by_name(optimizer, {n: p for n, (p, _) in params.items()})
    if writer:
        _torch_save(states, os.path.join(
            tmp, f"optim_tp{c['tp']:02d}_pp{c['pp']:03d}{suffix}_dp000.pt"))
    _torch_save(get_rng_state(tracker), os.path.join(tmp, f"rng_{mesh.rank:05d}.pt"))
    if _rank() == 0:
        _torch_save({"iteration": iteration, "consumed_samples": consumed_samples,
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "config": config}, os.path.join(tmp, "common.pt"))
        meta = {"format": FORMAT, "iteration": iteration, "layout": mesh.sizes,
                "world_size": dist.get_world_size() if dist.is_initialized() else 1}
        with _open_for_write(os.path.join(tmp, "metadata.json")) as fh:
            fh.write(json.dumps(meta, indent=1).encode())
        if tokenizer_file and os.path.exists(tokenizer_file):
            shutil.copyfile(tokenizer_file, os.path.join(tmp, "tokenizer.json"))
    _barrier()
    if _rank() == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(os.path.join(save_dir, LATEST), str(iteration))
    _barrier()


def save_checkpoint(save_dir: str, iteration: int, model_chunks: Sequence[nn.Module],
                    optimizer: torch.optim.Optimizer, scheduler, mesh: ParallelMesh,
                    tracker: RNGTracker, *, consumed_samples: int, config: dict,
                    tokenizer_file: Optional[str] = None) -> str:
    """Write a checkpoint of ``iteration`` under ``save_dir``; collective over all ranks.

    Returns the final directory. Raises CheckpointWriteError naming ``save_dir`` and the OS error
    (e.g. "No space left on device") if the filesystem refuses a write; the partial
    ``iter_NNNNNNN.tmp`` is removed, the previous checkpoint and the ``latest`` pointer are
    untouched.
    """
    final = os.path.join(save_dir, f"iter_{iteration:07d}")
    tmp = final + ".tmp"
    try:
        _write_checkpoint(final, tmp, save_dir, iteration, model_chunks, optimizer, scheduler,
                          mesh, tracker, consumed_samples, config, tokenizer_file)
    except OSError as e:
        raise _save_failed(save_dir, iteration, tmp, e) from e
    return final


def latest_checkpoint(load_dir: str, step: Optional[int] = None) -> Optional[str]:
    """The directory named by ``latest_checkpointed_iteration.txt`` (or ``iter_{step}``), or
    None when ``load_dir`` holds no checkpoint. Raises ConfigError naming the pointer file when
    it is unreadable or names a missing iteration (see
    :func:`loom.checkpoint.safety.resolve_checkpoint`)."""
    return resolve_checkpoint(load_dir, step)


def read_common(ckpt_dir: str) -> dict:
    return torch.load(os.path.join(ckpt_dir, "common.pt"), map_location="cpu", weights_only=False)


class _ShardIndex:
    """Which saved file holds each parameter, and its spec; tensors memory-mapped on demand."""

    def __init__(self, ckpt_dir: str):
        self.files = {}
        for path in sorted(glob.glob(os.path.join(ckpt_dir, "model_tp*_pp*.pt"))):
            m = re.search(r"model_tp(\d+)_pp(\d+)(?:_ep(\d+))?\.pt$", path)
            self.files[(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))] = torch.load(
                path, map_location="cpu", mmap=True, weights_only=True)
        if not self.files:
            raise FileNotFoundError(f"no model shards in {ckpt_dir}")
        for sd in self.files.values():
            sd["optimizer"] = {}
        for path in sorted(glob.glob(os.path.join(ckpt_dir, "optim_tp*_pp*_dp*.pt"))):
            m = re.search(r"optim_tp(\d+)_pp(\d+)(?:_ep(\d+))?_dp\d+\.pt$", path)
            self.files[(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))]["optimizer"].update(
                torch.load(path, map_location="cpu", mmap=True, weights_only=True))
        self.owner: dict[str, list[tuple[int, int]]] = {}
        self.saved_name: dict[str, str] = {}  # today's name -> the name in the files
        for key, sd in self.files.items():
            for name in sd["model"]:
                self.owner.setdefault(canonical_name(name), []).append(key)
                self.saved_name[canonical_name(name)] = name

    def full(self, name: str, section: str = "model", state_key: Optional[str] = None) -> torch.Tensor:
        keys = self.owner.get(name)
        if not keys:
            raise KeyError(f"parameter {name} not in checkpoint")
        saved = self.saved_name[name]
        pp = keys[0][1]
        keys = sorted(k for k in keys if k[1] == pp)  # one stage's TP shards, by tp rank
        spec = ShardSpec.from_dict(self.files[keys[0]]["specs"][saved]["shard"])
        if section == "model":
            shards = [self.files[k]["model"][saved] for k in keys]
        else:
            shards = [self.files[k]["optimizer"][saved][state_key] for k in keys]
        return full_from_shards(shards, spec)

    def saved_shape(self, name: str) -> torch.Size:
        """Shape of the first saved shard of ``name``."""
        return self.files[self.owner[name][0]]["model"][self.saved_name[name]].shape

    def optimizer_keys(self, name: str) -> dict:
        key = self.owner[name][0]
        return self.files[key]["optimizer"].get(self.saved_name[name], {})


@torch.no_grad()
def load_model_weights(index: _ShardIndex, model_chunks: Sequence[nn.Module],
                       mesh: ParallelMesh) -> None:
    for name, (p, meta) in _named_params(model_chunks).items():
        p.copy_(local_shard(index.full(name), meta, mesh.tp_rank, mesh.tp_size, name))


def load_checkpoint(load_dir: str, model_chunks: Sequence[nn.Module],
                    optimizer: Optional[torch.optim.Optimizer], scheduler, mesh: ParallelMesh,
                    tracker: Optional[RNGTracker], step: Optional[int] = None) -> Optional[dict]:
    """Restore the latest checkpoint of ``load_dir`` into this rank's model (and optimizer,
    scheduler, RNG); returns the common state (``iteration``, ``consumed_samples``, ``config``),
    or None when ``load_dir`` holds no checkpoint yet (the run then starts from scratch).
    ``step`` (``--ckpt-step``) loads ``iter_{step}`` instead of the pointer's iteration; a broken
    pointer raises ConfigError naming the file.

    Works across layouts: weights and Adam states are resharded by name (also across DP sizes
    and with or without the distributed optimizer). RNG states are restored
    only when the world size matches (otherwise the generators keep their fresh seeds).
    """
    ckpt = latest_checkpoint(load_dir, step)
    if ckpt is None:
        return None
    index = _ShardIndex(ckpt)
    load_model_weights(index, model_chunks, mesh)
    if optimizer is not None:
        params, states = _named_params(model_chunks), {}
        for name, (p, meta) in params.items():
            saved = index.optimizer_keys(name)
            if not saved:
                continue
            state = {}
            for k, v in saved.items():
                if torch.is_tensor(v) and v.shape == index.saved_shape(name) and v.ndim > 0:
                    v = local_shard(index.full(name, "optimizer", k), meta, mesh.tp_rank,
                                    mesh.tp_size, name)
                state[k] = v.clone().to(p.device) if torch.is_tensor(v) else v
            states[name] = state
        load_optimizer_state_by_name(optimizer, {n: p for n, (p, _) in params.items()}, states)
    common = read_common(ckpt)
    if scheduler is not None and common.get("scheduler") is not None:
        scheduler.load_state_dict(common["scheduler"])
        # load_state_dict restores the schedule, not the optimizer's current lr: set it too.
        for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    with open(os.path.join(ckpt, "metadata.json")) as fh:
        meta = json.load(fh)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng_path = os.path.join(ckpt, f"rng_{mesh.rank:05d}.pt")
    if tracker is not None and meta.get("world_size") == world and meta["layout"] == mesh.sizes \
            and os.path.exists(rng_path):
        set_rng_state(torch.load(rng_path, weights_only=False), tracker)
    common["checkpoint_dir"] = ckpt
    return common
