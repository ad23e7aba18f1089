"""Checkpoints of the previous format still load: ``loom-checkpoint-v1`` (one ``torch.save``
file per (tp, pp) shard, written by loom before checkpoints moved onto
``torch.distributed.checkpoint``) is read by :mod:`loom.checkpoint.legacy`, including v1
checkpoints written before recomputation kept parameter names (under
``--recompute-granularity full`` the old code saved ``layers.N.layer.*``; the loader maps those
to today's names). Weights, Adam states and iteration come back exactly.
"""

from __future__ import annotations

import glob
import os

import torch

from loom.config import LoomConfig
from loom.parallel.mesh import ParallelMesh
from testkit.config import MEGATRON_DROPOUT, PRE_ISSUE_21, tiny_config


def make_cfg() -> LoomConfig:
    return tiny_config("gpt", PRE_ISSUE_21, MEGATRON_DROPOUT, seq_length=8,
                       make_vocab_size_divisible_by=8, world=1)


def _write_v1(tr, root: str) -> str:
    """The trainer's state as loom wrote it in format v1 (one process: tp 0, pp 0), with the
    pre-refactor full-recompute names; returns the iteration directory."""
    import json

    from loom.checkpoint.legacy import LEGACY_FORMAT
    from loom.parallel.random import get_rng_state
    ckpt = os.path.join(root, f"iter_{tr.iteration:07d}")
    os.makedirs(ckpt)
    named = {n: p for n, p in tr.model_chunks[0].named_parameters()}
    reg = tr.model_chunks[0].registry
    torch.save({"model": {_old(n): p.detach().clone() for n, p in named.items()},
                "specs": {_old(n): {"full_shape": list(reg[n].full_shape),
                                    "shard": reg[n].shard.to_dict() if reg[n].shard else None}
                          for n in named},
                "tp_rank": 0, "pp_rank": 0}, os.path.join(ckpt, "model_tp00_pp000.pt"))
    names = {id(p): n for n, p in named.items()}
    torch.save({_old(names[id(p)]): {k: v.clone() if torch.is_tensor(v) else v
                                     for k, v in st.items()}
                for p, st in tr.optimizer.state.items()},
               os.path.join(ckpt, "optim_tp00_pp000_dp000.pt"))
    torch.save(get_rng_state(tr.tracker), os.path.join(ckpt, "rng_00000.pt"))
    torch.save({"iteration": tr.iteration, "consumed_samples": tr.consumed_samples,
                "scheduler": tr.scheduler.state_dict(), "config": tr.cfg.to_flat()},
               os.path.join(ckpt, "common.pt"))
    with open(os.path.join(ckpt, "metadata.json"), "w") as fh:
        json.dump({"format": LEGACY_FORMAT, "iteration": tr.iteration, "layout": tr.mesh.sizes,
                   "world_size": 1}, fh)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(tr.iteration))
    return ckpt


def _old(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "layers":
        return ".".join(parts[:2] + ["layer"] + parts[2:])
    return name


def test_v1_checkpoint_with_old_full_recompute_names_loads(tmp_path):
    from loom.checkpoint.safety import check_checkpoint_files
    from loom.training.trainer import Trainer
    tr = Trainer(make_cfg(), mesh=ParallelMesh.single())
    for _ in range(2):
        tr.train_step()
    ckpt = _write_v1(tr, str(tmp_path))
    next_loss = tr.train_step()["loss"]  # before another Trainer reseeds this process's RNG
    check_checkpoint_files(ckpt)
    names = torch.load(glob.glob(os.path.join(ckpt, "model_*.pt"))[0], weights_only=False)["model"]
    assert any(".layer." in n for n in names)  # really the old naming
    fresh = Trainer(make_cfg(), mesh=ParallelMesh.single())
    assert fresh.load(str(tmp_path)) and fresh.iteration == 2
    for n, p in fresh.model_chunks[0].named_parameters():
        assert torch.equal(p, names[_old(n)]), n
    assert all(fresh.optimizer.state[p] for p in fresh.params)  # Adam states restored
    assert fresh.train_step()["loss"] == next_loss  # exact resume
    from loom.checkpoint.cli import inspect
    info = inspect(str(tmp_path))
    assert info["format"] == "loom-checkpoint-v1" and info["iteration"] == 2
    assert info["parameters"] and not any(".layer." in n for n in info["parameters"])
