"""``loom train --ckpt-format torch_dist``: the training run's checkpoints in Megatron-Core's
``torch_dist`` format, which Megatron-Core's ``dist_checkpointing.load`` and Megatron-LM's
``--load`` read (:mod:`.writer`), and which loom resumes (:mod:`.index`).

What it holds: the weights; the Adam states (``exp_avg``, ``exp_avg_sq``, a 16-bit run's fp32
weights as ``fp32_param``) in the non-distributed optimizer's model-space keys with the step
count; the iteration and consumed samples (also in Megatron-LM's ``args``); under ``loom`` in
``common.pt`` loom's flat config, LR-scheduler state and data identities. Not held: the
generators (Megatron's RNG state is its own; a resume starts fresh ones, so dropout masks
differ from an uninterrupted run). Megatron-LM loads the weights and iteration and starts its
own Adam states (the saved args say ``no_save_optim``: its optimizer's param-group bookkeeping is
not loom's to forge).

How: every rank all-gathers each of its parameters (and Adam states) over its TP group into the
full tensor, lays it out as Megatron does and hands DCP its chunk of the global (layer- and
expert-stacked) tensor; DP / CP replicas hand identical chunks, which DCP writes once. The
files go into ``iter_N.tmp`` and are finalized like loom's own (checksums, rename, pointer:
:func:`loom.checkpoint.io.finalize_save`). A save is synchronous (``--async-save`` applies to
``loom_dcp``). Peak memory: one full (un-TP-sharded) copy of this rank's stage, weights and
Adam states, during the save.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from loom.checkpoint.megatron.writer import (METADATA, ChunkSavePlanner, adam_step,
                                             megatron_args, megatron_chunks, optimizer_chunks)


def _full(t: torch.Tensor, meta, mesh) -> torch.Tensor:
    """The whole tensor of this rank's TP shard ``t`` (an expert's: expert-TP shard; ZeRO-3:
    gathered over DP x CP first)."""
    from loom.parallel.fsdp import full_tensor
    from loom.parallel.registry import full_from_shards
    t = full_tensor(t).detach()
    size = mesh.shard_of(meta)[1]
    if meta.shard is None or size == 1:
        return t.cpu().clone()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=mesh.groups[mesh.shard_group(meta)])
    return full_from_shards([p.cpu() for p in parts], meta.shard)


def rank_chunks(model_chunks: Sequence, optimizer, mesh, model_cfg) -> tuple[dict, dict, dict, dict]:
    """``(chunks, sizes, objects, states)`` this rank hands DCP: its stage's weights and Adam
    states, full and in Megatron's layout (collective over the TP group, and for the
    distributed optimizer over DP x CP)."""
    from loom.checkpoint.io import optimizer_states
    from loom.parallel.registry import named_parameters
    params = {n: (p, meta) for n, p, meta in named_parameters(model_chunks)}
    own = {n: pm for n, pm in params.items() if not pm[1].duplicate}
    full = {n: _full(p, meta, mesh) for n, (p, meta) in own.items()}
    states = {}
    for name, st in optimizer_states(optimizer, params).items():
        if name not in own:
            continue
        p, meta = own[name]
        states[name] = {k: _full(v, meta, mesh) if torch.is_tensor(v) and v.ndim > 0 else v
                        for k, v in st.items()}
    objects: dict = {}
    chunks, sizes = megatron_chunks(full, model_cfg, mesh.tp_size, objects)
    more, more_sizes = optimizer_chunks(states, model_cfg, mesh.tp_size)
    chunks.update(more)
    sizes.update(more_sizes)
    return chunks, sizes, objects, states


def start_megatron_save(save_dir: str, iteration: int, model_chunks: Sequence, optimizer,
                        scheduler, mesh, *, consumed_samples: int, config: dict, model_cfg,
                        tokenizer_file: Optional[str] = None,
                        after_write: Optional[Callable[[], None]] = None,
                        data: Optional[dict] = None):
    """Write the checkpoint of ``iteration`` into ``iter_N.tmp`` (collective over all ranks);
    returns loom's :class:`~loom.checkpoint.io.PendingSave` for ``finalize_save``. Raises
    CheckpointWriteError like loom's own save when the filesystem refuses a write."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from loom.checkpoint.io import (PendingSave, _agree, _rank, _storage_writer,
                                    single_process_quiet)
    from loom.checkpoint.save_errors import save_failed
    final = os.path.join(save_dir, f"iter_{iteration:07d}")
    job = PendingSave(save_dir, iteration, final, final + ".tmp", device=mesh.device,
                      started=time.perf_counter())
    try:
        failure = None
        chunks, sizes, objects, states = rank_chunks(model_chunks, optimizer, mesh, model_cfg)
        try:
            if _rank() == 0:
                os.makedirs(save_dir, exist_ok=True)
                shutil.rmtree(job.tmp, ignore_errors=True)
                os.makedirs(job.tmp)
        except OSError as e:
            failure = e
        _agree(failure, job.device)
        with single_process_quiet():
            dcp.save({}, storage_writer=_storage_writer(job.tmp, after_write),
                     planner=ChunkSavePlanner(chunks, sizes, objects),
                     no_dist=not dist.is_initialized())
        failure = None
        try:
            if _rank() == 0:
                _write_common(job, model_cfg, config, consumed_samples, scheduler, states,
                              mesh, data, tokenizer_file)
        except OSError as e:
            failure = e
        _agree(failure, job.device)
        job.written_s = time.perf_counter() - job.started
    except (OSError, CheckpointException) as e:
        raise save_failed(save_dir, iteration, job.tmp, e) from e
    return job


def _write_common(job, model_cfg, config: dict, consumed: int, scheduler, states: dict, mesh,
                  data: Optional[dict], tokenizer_file: Optional[str]) -> None:
    """Rank 0: Megatron-LM's ``common.pt`` (with loom's own entry) and ``metadata.json``."""
    import json

    from loom.checkpoint.io import _torch_save
    common = {"args": megatron_args(model_cfg, config, job.iteration, consumed, mesh.tp_size,
                                    optimizer=False),
              "checkpoint_version": 3.0, "iteration": job.iteration,
              "num_floating_point_operations_so_far": 0,
              "loom": {"config": config, "consumed_samples": consumed, "data": data,
                       "scheduler": scheduler.state_dict() if scheduler is not None else None}}
    common["args"].pipeline_model_parallel_size = mesh.pp_size
    step = adam_step(states)
    if step is not None:
        common["optimizer"] = {"state": {"common_step": torch.tensor(step)}}
    _torch_save(common, os.path.join(job.tmp, "common.pt"))
    with open(os.path.join(job.tmp, "metadata.json"), "w", encoding="utf-8") as fh:
        json.dump(METADATA, fh)
    if tokenizer_file and os.path.exists(tokenizer_file):
        shutil.copyfile(tokenizer_file, os.path.join(job.tmp, "tokenizer.json"))
