"""Checkpoints written before recomputation kept parameter names still load: under
``--recompute-granularity full`` the old code saved ``layers.N.layer.*``; the loader maps those
to today's names (and the weights, Adam states and iteration come back exactly).
"""

from __future__ import annotations

import glob
import os

import torch

from loom.config import LoomConfig, ModelConfig
from loom.parallel.mesh import ParallelMesh


def make_cfg() -> LoomConfig:
    cfg = LoomConfig(model=ModelConfig.gpt2(num_layers=2, hidden_size=32, num_attention_heads=4,
                                            seq_length=8, vocab_size=100,
                                            make_vocab_size_divisible_by=8))
    cfg.training.micro_batch_size = 2
    cfg.data.mock_data = True
    return cfg.validate(1)


def _rename_to_old_format(ckpt: str) -> int:
    """Rewrite every shard file of ``ckpt`` with the pre-refactor full-recompute names."""
    renamed = 0
    for path in glob.glob(os.path.join(ckpt, "*_tp*_pp*.pt")):
        sd = torch.load(path, weights_only=False)
        for section in ("model", "specs"):
            if section in sd:
                sd[section] = {_old(n): v for n, v in sd[section].items()}
        if "model" not in sd:  # optimizer shard: name -> state
            sd = {_old(n): v for n, v in sd.items()}
        renamed += 1
        torch.save(sd, path)
    return renamed


def _old(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "layers":
        return ".".join(parts[:2] + ["layer"] + parts[2:])
    return name


def test_old_full_recompute_names_load(tmp_path):
    from loom.training.trainer import Trainer
    tr = Trainer(make_cfg(), mesh=ParallelMesh.single())
    for _ in range(2):
        tr.train_step()
    ckpt = tr.save(str(tmp_path))
    next_loss = tr.train_step()["loss"]  # before another Trainer reseeds this process's RNG
    assert _rename_to_old_format(ckpt) >= 2
    names = torch.load(glob.glob(os.path.join(ckpt, "model_*.pt"))[0], weights_only=False)["model"]
    assert any(".layer." in n for n in names)  # really the old naming
    fresh = Trainer(make_cfg(), mesh=ParallelMesh.single())
    assert fresh.load(str(tmp_path)) and fresh.iteration == 2
    saved = torch.load(glob.glob(os.path.join(ckpt, "model_*.pt"))[0], weights_only=False)["model"]
    for n, p in fresh.model_chunks[0].named_parameters():
        assert torch.equal(p, saved[_old(n)]), n
    assert all(fresh.optimizer.state[p] for p in fresh.params)  # Adam states restored
    assert fresh.train_step()["loss"] == next_loss  # exact resume
