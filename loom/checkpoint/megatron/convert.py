"""``loom checkpoint convert --to-megatron LOOM_CKPT --save OUT`` and ``--from-megatron DIR
--save OUT [model flags]``.

``--to-megatron`` writes Megatron-LM's layout: ``OUT/iter_NNNNNNN/`` (the loom checkpoint's
iteration) in the ``torch_dist`` format (:mod:`.writer`) and ``OUT/latest_checkpointed_
iteration.txt``. The vocabulary rows are padded for ``--tensor-model-parallel-size`` (default 1)
x ``--make-vocab-size-divisible-by``: give the TP the Megatron run will use when the padding
differs.

``--from-megatron`` writes a loom checkpoint of the Megatron checkpoint's iteration and consumed
samples: its weights, and its Adam states where they map (:class:`~.index.MegatronIndex`); the
model is the saved args' unless flags given here say otherwise (a bare Megatron-Core checkpoint
has no args: give the model flags).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from loom.errors import ConfigError


def _write_pointer(root: str, iteration: int) -> None:
    path = os.path.join(root, "latest_checkpointed_iteration.txt")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(str(iteration))
    os.replace(tmp, path)


def write_megatron_checkpoint(out: str, iteration: int, full: dict, states: dict, cfg,
                              flat: dict, consumed: int, scheduler=None, target_tp: int = 1,
                              distributed: bool = False) -> str:
    """``out/iter_NNNNNNN`` (and the pointer) in Megatron's ``torch_dist`` format from loom's
    full tensors ``full`` and Adam states ``states`` of a model of ``cfg`` (``flat``: its flat
    loom config, kept for loom's own reading); returns the iteration directory."""
    from loom.checkpoint.megatron.writer import (adam_step, megatron_args, megatron_chunks,
                                                 optimizer_chunks, write_megatron_dir)
    objects: dict = {}
    chunks, sizes = megatron_chunks(full, cfg, target_tp, objects)
    common = {"args": megatron_args(cfg, flat, iteration, consumed, target_tp, optimizer=False),
              "checkpoint_version": 3.0, "iteration": iteration,
              "num_floating_point_operations_so_far": 0,
              "loom": {"config": flat, "scheduler": scheduler, "consumed_samples": consumed}}
    step = adam_step(states) if states else None
    if states:
        more, more_sizes = optimizer_chunks(states, cfg, target_tp)
        chunks.update(more)
        sizes.update(more_sizes)
        if step is not None:
            common["optimizer"] = {"state": {"common_step": torch.tensor(step)}}
    path = os.path.join(out, f"iter_{iteration:07d}")
    write_megatron_dir(path, chunks, sizes, common, objects, distributed=distributed)
    if not distributed or torch.distributed.get_rank() == 0:
        _write_pointer(out, iteration)
    return path


def to_megatron(ckpt_path: str, out_dir: str, step: Optional[int] = None,
                overwrite: bool = False, target_tp: int = 1) -> str:
    """A loom checkpoint (``ckpt_path``: a root or one ``iter_N``) as a Megatron-LM checkpoint
    root ``out_dir``; returns the iteration directory written. Raises ConfigError for a missing
    checkpoint, one that is already Megatron's, or a non-empty ``out_dir`` without
    ``overwrite``."""
    from loom.checkpoint.io import open_checkpoint, read_common
    from loom.checkpoint.megatron.locate import format_of
    from loom.checkpoint.safety import resolve_checkpoint
    from loom.checkpoint.targets import check_output_dir
    from loom.config import LoomConfig
    check_output_dir(out_dir, f"--to-megatron output {out_dir}", overwrite)
    if format_of(ckpt_path) or (os.path.isdir(ckpt_path) and _is_megatron_root(ckpt_path)):
        raise ConfigError(f"--to-megatron {ckpt_path} is already a Megatron checkpoint")
    ckpt = ckpt_path if os.path.exists(os.path.join(ckpt_path, "common.pt")) else \
        resolve_checkpoint(ckpt_path, step)
    if ckpt is None:
        raise ConfigError(f"--to-megatron {ckpt_path}: no loom checkpoint there")
    common = read_common(ckpt)
    flat = common["config"]
    cfg = LoomConfig.from_flat(flat, ignore_retired=True).model
    from loom.models import get_family
    if not get_family(cfg.model_type).megatron_checkpoints:
        raise ConfigError(f"--to-megatron: a {cfg.model_type} model has no Megatron-Core "
                          f"GPTModel / MambaModel layout (loom writes the gpt and mamba families)")
    index = open_checkpoint(ckpt)
    optim_names = [n for n in index.names if index.has_optimizer_state(n)]
    full, states, _ = index.load(index.names, optim_names)
    return write_megatron_checkpoint(out_dir, int(common["iteration"]), full, states, cfg,
                                     flat, int(common.get("consumed_samples") or 0),
                                     common.get("scheduler"), target_tp)


def _is_megatron_root(path: str) -> bool:
    from loom.checkpoint.megatron.locate import locate
    try:
        return locate(path) is not None
    except ConfigError:
        return True


def from_megatron(src: str, out_dir: str, flags: dict, step: Optional[int] = None,
                  overwrite: bool = False) -> str:
    """A loom checkpoint in ``out_dir`` from the Megatron checkpoint ``src`` (root, iteration
    directory or bare ``dist_checkpointing`` directory); ``flags``: model flags given on the
    command line (flat, None = not given), which win over the saved args. Returns the
    checkpoint path."""
    from loom.checkpoint.io import save_checkpoint
    from loom.checkpoint.megatron.common import open_index, read_common
    from loom.checkpoint.megatron.locate import diagnose, locate
    from loom.checkpoint.reader import restore_model_and_optimizer
    from loom.checkpoint.targets import check_output_dir
    from loom.config import LoomConfig, ModelConfig
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    from loom.parallel.random import RNGTracker
    check_output_dir(out_dir, f"--from-megatron output {out_dir}", overwrite, allow_import=True)
    found = locate(src, step)
    if found is None:
        raise ConfigError(diagnose(src) or f"--from-megatron {src}: not a Megatron checkpoint "
                                           f"(no metadata.json with a sharded_backend, no "
                                           f"mp_rank_* directories, no pointer naming one)")
    common = read_common(found)
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    given = {k: v for k, v in flags.items() if k in model_fields and v is not None}
    if not common["has_args"] and not given:
        raise ConfigError(f"--from-megatron {found.path}: a bare Megatron-Core checkpoint (no "
                          f"saved args): give the model flags (--num-layers, --hidden-size, "
                          f"--num-attention-heads, --vocab-size, ...)")
    cfg = LoomConfig.from_flat({**common["config"], **given}, ignore_retired=True).model
    index = open_index(found, cfg)
    index.check_complete()
    optim_names = [n for n in index.names if index.has_optimizer_state(n)]
    full, states, _ = index.load(index.names, optim_names)
    mesh = ParallelMesh.single()
    tracker = RNGTracker(mesh.device)
    tracker.seed(0)
    model = build_model(get_family(cfg.model_type), cfg, mesh, tracker, seed=None)
    optimizer = torch.optim.AdamW(model.parameters())
    # weights and Adam states alike re-padded to this model's vocabulary (a TP=2 run saved
    # Vp(t=2) rows of the embedding, its states and its fp32 main weights)
    restore_model_and_optimizer([model], optimizer, mesh, full, states)
    return save_checkpoint(out_dir, common["iteration"], [model], optimizer, None, mesh,
                           tracker, consumed_samples=common["consumed_samples"],
                           config=dataclasses.asdict(cfg))
