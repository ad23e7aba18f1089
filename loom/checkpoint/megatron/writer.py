"""Writing Megatron-Core's ``torch_dist`` format: what ``dist_checkpointing.load`` reads into
``GPTModel.sharded_state_dict()`` at any TP / PP, and Megatron-LM's ``--load`` resumes.

A directory holds ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``), ``common.pt``
(Megatron-LM's: ``args``, ``checkpoint_version`` 3.0, ``iteration``; plus ``loom``: loom's own
flat config and LR-schedule state, so loom reads its own writing back losslessly) and DCP's
files of global tensors under Megatron's keys (:mod:`.names`: stacked layers and experts,
Transformer Engine's norm names; the local spec's spelling of the MoE layers' pre-MLP norm and
MLA's latent norms written beside them, so either layer spec finds its key), in Megatron's
layouts (:mod:`.layout`). The embedding and output rows are re-padded to Megatron's padded
vocabulary for the target TP (``make_vocab_size_divisible_by x t``).

Adam states go in the non-distributed optimizer's model-space keys
(``optimizer.state.exp_avg.<key>``, ``exp_avg_sq``, ``fp32_param`` for a 16-bit run's fp32
weights) with ``common_step``: loom resumes them; the saved args say ``no_save_optim`` and
``no_save_rng``, so Megatron-LM loads the weights and iteration and starts fresh Adam states and
generators (its optimizer's param-group bookkeeping is not loom's to forge).

Each tensor is a list of chunks ``(offsets, tensor)`` of a global shape, written by
:class:`ChunkSavePlanner` through DCP (one process, or every rank its own chunks: identical
chunks of replicas are written once).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.default_planner import (DefaultSavePlanner,
                                                          create_default_global_save_plan)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)

from loom.checkpoint.megatron import layout
from loom.checkpoint.megatron.names import (CONV_PARTS, GDN_CONV_PARTS, GDN_IN_PROJ_PARTS,
                                            IN_PROJ_PARTS, attention_kind, gdn_of,
                                            is_norm_gain, keyed_per_layer, kind_of,
                                            layer_pattern, write_sources)

METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}
Chunks = dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's save planner over explicit chunks: ``chunks`` ``{key: [(offsets, tensor)]}`` of
    global ``sizes`` ``{key: shape}``, and ``objects`` ``{key: picklable}``. Chunks of a key
    need not cover it (Megatron's stacked keys of MoE-only layers)."""

    def __init__(self, chunks: Chunks, sizes: dict, objects: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks, self.sizes, self.objects = chunks, sizes, objects
        self.by_index: dict[tuple, Any] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, pieces in self.chunks.items():
            for offsets, t in pieces:
                index = MetadataIndex(key, torch.Size(offsets))
                self.by_index[(key, tuple(offsets))] = t
                items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.size()),
                    properties=TensorProperties.create_from_tensor(t),
                    size=torch.Size(self.sizes[key]))))
        for key, obj in self.objects.items():
            self.by_index[(key, None)] = obj
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def _create_global_plan(self, all_plans):
        return create_default_global_save_plan(self._dedup_save_plans(all_plans))

    def lookup_object(self, index: MetadataIndex) -> Any:
        offsets = tuple(index.offset) if index.offset is not None else None
        return self.by_index[(index.fqn, offsets)]

    def transform_object(self, write_item: WriteItem, obj: Any):
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(obj, buf)
            return buf
        return obj


def _vocab_rows(cfg, target_tp: int) -> int:
    """Megatron's padded vocabulary for ``target_tp`` (``--make-vocab-size-divisible-by``; V
    itself with ``--no-pad-vocab-size``)."""
    if cfg.padded_vocab_size:
        return cfg.padded_vocab_size
    if getattr(cfg, "no_pad_vocab_size", False):
        return cfg.vocab_size
    m = cfg.make_vocab_size_divisible_by * target_tp
    return -(-cfg.vocab_size // m) * m


def _repad(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    n = min(rows, t.shape[0])
    out[:n] = t[:n]
    return out


def megatron_chunks(full: dict[str, torch.Tensor], cfg, target_tp: int = 1,
                    objects: Optional[dict] = None, values: bool = True) -> tuple[Chunks, dict]:
    """``(chunks, sizes)`` of loom's full tensors ``full`` (``{name: tensor}``) of a model of
    ``cfg`` under Megatron's keys and layouts; the GPT stack's layers stacked on ``[L, ...]``
    (experts ``[L, E, ...]``), a Mamba / hybrid stack's per layer with its in-projection and conv
    in parts. ``objects`` (when given) receives the ``_extra_state`` entry of each module with a
    weight (:func:`extra_state_key`), which Megatron-Core's load asks for. ``values``: the
    tensors are weights (or fp32 main weights), not Adam's moments: under
    ``--apply-layernorm-1p`` a norm's gain g is stored as Megatron's w = g - 1."""
    chunks: Chunks = {}
    sizes: dict[str, tuple] = {}
    pattern = layer_pattern(cfg)
    gdn = gdn_of(cfg)
    # Megatron's Mamba stack keys each layer on its own, and so does a GPT stack whose layers
    # differ (TransformerBlock's non_homogeneous_layers: Gated DeltaNet, dense and MoE layers)
    per_layer = keyed_per_layer(cfg)
    rows = _vocab_rows(cfg, target_tp)
    zero_centred = bool(getattr(cfg, "apply_layernorm_1p", False))
    L, E = cfg.num_layers, cfg.num_experts or 0
    for name, t in full.items():
        attention = attention_kind(name, pattern, cfg.multi_latent_attention, gdn)
        t = layout.to_megatron(t.detach().cpu(), kind_of(name), cfg.num_attention_heads,
                               cfg.num_kv_groups, getattr(cfg, "attention_output_gate", False))
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t = _repad(t, rows)
        if values and zero_centred and is_norm_gain(name):
            t = t - 1
        layer = re.match(r"^layers\.(\d+)\.", name)
        moe = bool(layer) and cfg.is_moe_layer(int(layer[1]))
        for src in write_sources(name, attention, stacked=not per_layer, moe_layer=moe,
                                 mamba_stack=pattern is not None):
            dims = _put(chunks, sizes, src, t, L, E, cfg)
            if objects is not None and src.key.endswith(".weight"):
                objects[extra_state_key(src.key[:-len(".weight")], src.index, dims)] = [None]
    return chunks, sizes


def extra_state_key(module: str, index: tuple[int, ...], dims: tuple[int, ...]) -> str:
    """Megatron-Core's ``ShardedObject`` key of ``module``'s ``_extra_state`` (the linear
    layers' FP8 metadata; None here, stored as Megatron stores a ``ShardedObject``: the list of
    its values): ``<module>._extra_state/shard_<offsets>_<shape>`` over the stacked dimensions
    (``shard_0_1`` when there are none)."""
    offs, shape = ".".join(map(str, index or (0,))), ".".join(map(str, dims or (1,)))
    return f"{module}._extra_state/shard_{offs}_{shape}"


def _put(chunks: Chunks, sizes: dict, src, t: torch.Tensor, L: int, E: int, cfg) -> tuple:
    """Add ``t`` at ``src`` (its leading ``index`` on the stacked dimensions, or its parts);
    returns the stacked dimensions' sizes."""
    key = src.key
    if src.parts:
        segs = _part_sizes(src.parts, cfg)
        pieces = t.split(segs, dim=0)
        for part, piece in zip(src.parts, pieces):
            chunks.setdefault(key + part, []).append(((0,) * piece.ndim, piece.contiguous()))
            sizes[key + part] = tuple(piece.shape)
        return ()
    index = src.index
    dims = ((L, E) if re.match(r"^decoder\.layers\.\D", key) else (E,))[:len(index)]
    chunks.setdefault(key, []).append(((*index, *([0] * t.ndim)),
                                       t.reshape((1,) * len(index) + tuple(t.shape)).contiguous()))
    sizes[key] = (*dims, *t.shape)
    return dims


def _part_sizes(parts: tuple[str, ...], cfg) -> list[int]:
    from loom.models.gpt.gdn import gdn_blocks
    from loom.models.mamba.model import mamba_sizes
    if parts == tuple("." + p for p in GDN_IN_PROJ_PARTS):
        return list(gdn_blocks(cfg))
    if parts == tuple("." + p for p in GDN_CONV_PARTS):
        return list(gdn_blocks(cfg)[:3])
    s = mamba_sizes(cfg)
    if parts == tuple("." + p for p in IN_PROJ_PARTS):
        return list(s["in_segments"])
    if parts == tuple("." + p for p in CONV_PARTS):
        return list(s["conv_segments"])
    raise ValueError(f"unknown parts {parts}")


def optimizer_chunks(states: dict, cfg, target_tp: int = 1) -> tuple[Chunks, dict]:
    """Optimizer states ``{name: {exp_avg, exp_avg_sq, momentum_buffer, master_param, step}}``
    (Adam's; SGD's and Muon's momentum) as the non-distributed optimizer's model-space keys
    ``optimizer.state.<state>.<key>`` (the fp32 master weights as ``fp32_param``)."""
    chunks: Chunks = {}
    sizes: dict = {}
    for state, meg in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"),
                       ("momentum_buffer", "momentum_buffer"), ("master_param", "fp32_param")):
        full = {n: st[state] for n, st in states.items() if torch.is_tensor(st.get(state))}
        c, sz = megatron_chunks(full, cfg, target_tp, values=state == "master_param")
        chunks.update({f"optimizer.state.{meg}.{k}": v for k, v in c.items()})
        sizes.update({f"optimizer.state.{meg}.{k}": v for k, v in sz.items()})
    return chunks, sizes


def adam_step(states: dict) -> Optional[float]:
    """The step count of loom's Adam states (all parameters share it)."""
    for st in states.values():
        if "step" in st:
            return float(st["step"])
    return None


def megatron_args(cfg, flat: dict, iteration: int, consumed: int, target_tp: int,
                  optimizer: bool) -> argparse.Namespace:
    """Megatron-LM's ``args`` for ``common.pt``: loom's model flags (Megatron's names; the few
    it spells otherwise: ``add_bias_linear``), the padded vocabulary, the layout it is padded
    for, the progress (``skipped_train_samples``: iterations x B - consumed under
    ``--decrease-batch-size-if-needed``), and ``no_save_optim`` / ``no_save_rng`` (see the
    module docstring)."""
    ns = {k: v for k, v in flat.items() if isinstance(v, (bool, int, float, str, list, type(None)))}
    ns.update(add_bias_linear=not cfg.disable_bias_linear,
              padded_vocab_size=_vocab_rows(cfg, target_tp),
              add_position_embedding=cfg.position_embedding_type == "learned_absolute",
              tensor_model_parallel_size=target_tp, pipeline_model_parallel_size=1,
              expert_model_parallel_size=1, ckpt_format="torch_dist", use_dist_ckpt=True,
              iteration=iteration, consumed_train_samples=consumed, consumed_valid_samples=0,
              no_save_optim=not optimizer, no_save_rng=True, params_dtype=torch.float32,
              num_query_groups=cfg.num_kv_groups, ffn_hidden_size=cfg.ffn_size,
              kv_channels=cfg.head_dim, group_query_attention=cfg.num_kv_groups !=
              cfg.num_attention_heads,
              # --apply-layernorm-1p under Megatron-LM's dest (its older dest,
              # apply_layernorm_1p, comes from ``flat``)
              layernorm_zero_centered_gamma=bool(getattr(cfg, "apply_layernorm_1p", False)))
    ns.pop("model_type", None)
    batch = flat.get("global_batch_size")  # --decrease-batch-size-if-needed's left-out samples
    ns["skipped_train_samples"] = max(iteration * batch - consumed, 0) if batch and flat.get(
        "decrease_batch_size_if_needed") else 0
    from loom.config.model_moe import parse_moe_layer_freq
    for key in ("moe_layer_freq", "linear_attention_freq", "no_rope_freq"):  # int or list
        if ns.get(key) is not None:
            text = str(ns[key]).strip()
            ns[key] = int(text) if text.isdigit() else \
                parse_moe_layer_freq(text, cfg.num_layers, "--" + key.replace("_", "-"))
    if ns.get("experimental_attention_variant") == "gated_delta_net":
        ns["experimental_attention_variant"] = "gdn"  # Megatron's canonical name
    return argparse.Namespace(**ns)


def write_megatron_dir(out: str, chunks: Chunks, sizes: dict, common: dict,
                       objects: Optional[dict] = None, distributed: bool = False) -> None:
    """Write the ``torch_dist`` directory ``out``: DCP files of ``chunks`` (every rank its own
    with ``distributed``), then ``common.pt`` and ``metadata.json`` (rank 0)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from loom.checkpoint.reader import single_process_quiet
    rank0 = not distributed or dist.get_rank() == 0
    if rank0:
        os.makedirs(out, exist_ok=True)
    if distributed:
        dist.barrier()
    planner = ChunkSavePlanner(chunks, sizes, objects or {})
    with single_process_quiet():
        dcp.save({}, storage_writer=FileSystemWriter(out), planner=planner,
                 no_dist=not distributed)
    if rank0:
        torch.save(common, os.path.join(out, "common.pt"))
        with open(os.path.join(out, "metadata.json"), "w", encoding="utf-8") as fh:
            json.dump(METADATA, fh)
