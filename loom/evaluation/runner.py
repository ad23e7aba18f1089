"""Load a checkpoint at a TP x PP layout and run evaluation samples through it.

Loading reuses the training path: the checkpoint's config rebuilds the model of its family,
each rank builds its pipeline chunk (``build_chunk`` on the meta device, the family's plan, no
initialization) and ``load_model_weights`` cuts this rank's shards from the saved full tensors
(any saved layout). Samples are split round-robin over the DP replicas; each replica drives
its micro-batches through :func:`~loom.parallel.pipeline.schedules.forward_only` with the
task's forward step. On the last stage the vocabulary-parallel logits are gathered over TP one
sample at a time (``[1, s, Vp/t] -> [1, s, Vp]``, so at most one sample's full logits exist;
the padded columns kept, as the training loss keeps them, or cut to V with
``--exclude-padded-vocab``: ``ModelConfig.softmax_vocab_size``), the task scores it, and the
per-sample statistics (float64, padding rows excluded) land in one ``[samples, stats]`` table,
all-reduced once at the end (:func:`score_each`; :func:`score` sums it, in sample order: the
same sums at every layout).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from loom.errors import ConfigError

FLUSH_MICROBATCHES = 16  # micro-batches per forward_only call (bounds in-flight sends)
ROW_KEYS = ("tokens", "labels", "loss_mask", "valid", "padding_mask", "index")  # a row per sample


@dataclass
class EvalModel:
    """This rank's model chunks of one checkpoint at one layout."""

    chunks: list
    mesh: object
    cfg: object  # LoomConfig of the checkpoint (dropout off, --seq-length applied)
    checkpoint: str
    iteration: int


def check_layout(cfg, tp: int, pp: int, world: int) -> None:
    """Refuse a layout this model cannot take, naming the flag (before any process group)."""
    from loom.config.validate import _check_model
    from loom.models import get_family
    if world % (tp * pp):
        raise ConfigError(f"world size {world} is not divisible by --tensor-model-parallel-size "
                          f"{tp} x --pipeline-model-parallel-size {pp}: launch a multiple of "
                          f"{tp * pp} ranks")
    m = cfg.model
    family = get_family(m.model_type)
    _check_model(m, tp, family.replicates_kv_heads)
    at = copy.deepcopy(cfg)  # the family's own rules at this layout (e.g. Mamba heads over TP)
    at.parallel.tensor_model_parallel_size, at.parallel.context_parallel_size = tp, 1
    family.check(at, world)
    if m.num_layers % pp:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} does not divide the "
                          f"checkpoint's {m.num_layers} layers: choose a PP size dividing it")


def keep_trained_vocabulary(cfg, ckpt: str, tp: int) -> None:
    """With the padded vocabulary columns in the softmax (Megatron's default, not
    ``--exclude-padded-vocab``) the model's loss depends on its padded size Vp: evaluate with
    the checkpoint's own (``--padded-vocab-size`` := the rows of its saved word embedding or
    output layer, trained padded rows included), so every TP size gives the training
    layout's numbers. Raises ConfigError when ``tp`` does not divide it."""
    from loom.checkpoint.io import open_checkpoint
    m = cfg.model
    if m.exclude_padded_vocab or m.padded_vocab_size is not None:
        return
    shapes = open_checkpoint(ckpt).parameters()
    rows = next((v["shape"][0] for n, v in sorted(shapes.items())
                 if n.endswith(("word_embeddings.weight", "output_layer.weight"))), None)
    if rows is None:
        return
    if rows % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide the checkpoint's "
                          f"{rows} vocabulary rows (its padded columns are in the softmax): "
                          f"choose a TP size dividing {rows}")
    m.padded_vocab_size = rows


def build_mesh(tp: int, pp: int):
    """The mesh of this run: one process without torchrun (and t = p = 1), else a process
    group from torchrun's environment (or the caller's, e.g. tests) with d = world / (t p)."""
    from loom.parallel.mesh import ParallelMesh, init_distributed
    world = dist.get_world_size() if dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and tp == pp == 1 and not dist.is_initialized():
        return ParallelMesh.single("cuda" if torch.cuda.is_available() else "cpu")
    device = init_distributed()
    return ParallelMesh.build(tp=tp, pp=pp, dp=world // (tp * pp), device=device)


def load_model(ckpt: str, cfg, mesh) -> EvalModel:
    """This rank's chunk of the checkpoint ``ckpt`` (a resolved ``iter_*`` directory) under
    ``mesh``; ``cfg`` is its (checked) LoomConfig."""
    from loom.checkpoint.io import _ShardIndex, load_model_weights, read_common
    from loom.models import get_family
    from loom.models.family import StageSpec
    from loom.parallel.parallelize import build_chunk
    from loom.parallel.pipeline.placement import chunk_layers
    from loom.parallel.random import RNGTracker

    tracker = RNGTracker(mesh.device)
    tracker.seed(0)
    p, r = mesh.pp_size, mesh.pp_rank
    (layers,) = chunk_layers(cfg.model.num_layers, p, r)
    stage = StageSpec(layers, pre_process=r == 0, post_process=r == p - 1)
    chunk = build_chunk(get_family(cfg.model.model_type), cfg.model, stage, mesh, tracker,
                        seed=None)
    load_model_weights(_ShardIndex(ckpt), [chunk], mesh)
    chunk.eval()
    return EvalModel([chunk], mesh, cfg, ckpt, int(read_common(ckpt)["iteration"]))


def _stack(rows, field: str, dtype, device) -> torch.Tensor:
    return torch.from_numpy(np.stack([getattr(r, field) for r in rows])).to(device=device,
                                                                             dtype=dtype)


def _batches(samples, indices, micro_batch: int, seq_length: int, device) -> list[dict]:
    out = []
    for i in range(0, len(samples), micro_batch):
        rows, index = list(samples[i:i + micro_batch]), list(indices[i:i + micro_batch])
        valid = [1.0] * len(rows) + [0.0] * (micro_batch - len(rows))
        index += [index[0]] * (micro_batch - len(rows))
        rows += [rows[0]] * (micro_batch - len(rows))  # padding rows, weighted 0
        batch = {
            "index": torch.tensor(index, dtype=torch.long, device=device),
            "tokens": _stack(rows, "inputs", torch.long, device),
            "labels": _stack(rows, "labels", torch.long, device),
            "loss_mask": _stack(rows, "mask", torch.float32, device),
            "valid": torch.tensor(valid, dtype=torch.float64, device=device),
            "position_ids": torch.arange(seq_length, device=device),
            "num_microbatches": 1}
        if rows[0].padding is not None:  # bidirectional families: 1 = real token
            batch["padding_mask"] = _stack(rows, "padding", torch.long, device)
        out.append(batch)
    return out


@torch.no_grad()
def score_each(model: EvalModel, task, samples, micro_batch: int) -> torch.Tensor:
    """``[len(samples), len(task.stats)]`` float64: ``task.score`` of each sample (every rank
    passes the same list and gets the whole table; each sample is scored by one DP replica)."""
    from loom.parallel.mappings import gather_from_tensor_parallel_region
    from loom.parallel.pipeline.schedules import forward_only
    mesh, cfg = model.mesh, model.cfg
    s, V = cfg.model.seq_length, cfg.model.softmax_vocab_size  # None: every padded column
    mine = list(range(len(samples)))[mesh.dp_rank::mesh.dp_size]
    keys = list(task.stats)
    table = torch.zeros(len(samples), len(keys), dtype=torch.float64, device=mesh.device)

    def forward_step(chunk, batch, hidden_states):
        out = task.forward(chunk, batch, hidden_states)

        def loss_fn(logits):
            for i in range(logits.shape[0]):  # one row at a time: [1, s, V] fp32 at most
                full = gather_from_tensor_parallel_region(logits[i:i + 1].float().contiguous(),
                                                          mesh.groups["tp"])[..., :V]
                row = {k: v[i:i + 1] if k in ROW_KEYS else v for k, v in batch.items()}
                stats = task.score(full, row)
                values = torch.stack([stats[k].double().reshape(1) for k in keys], dim=-1)
                table.index_add_(0, row["index"], values * row["valid"][:, None])
            return torch.zeros((), device=logits.device), {}
        return out, loss_fn

    step = FLUSH_MICROBATCHES * micro_batch  # built and run a group at a time
    for i in range(0, len(mine), step):
        group = mine[i:i + step]
        forward_only(model.chunks, _batches([samples[j] for j in group], group, micro_batch, s,
                                            mesh.device),
                     forward_step, mesh, p2p_shape=(s, micro_batch, cfg.model.hidden_size))
    if not (mesh.is_last_stage and mesh.tp_rank == 0):
        table.zero_()  # one owner of each sample's numbers
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
    return table


def score(model: EvalModel, task, samples, micro_batch: int) -> dict:
    """``{statistic: sum over samples}`` for each of ``task.stats``, of ``task.score`` over
    ``samples`` (:func:`score_each`, summed)."""
    return dict(zip(task.stats, score_each(model, task, samples, micro_batch).sum(0).tolist()))
