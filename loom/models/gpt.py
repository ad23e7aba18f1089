"""Decoder-only language model: GPT-2 or LLaMA layout, one class.

Embedding (vocab-parallel, plus learned positions for GPT-2) -> L pre-LN layers -> final norm ->
output layer (tied to the embedding, or untied for LLaMA) -> vocab-parallel cross-entropy.
A pipeline stage builds only its own layers (``layer_numbers``) and, on the first/last stage,
the embedding/output; parameter names carry the global layer index, so every stage and every TP
size names (and therefore initializes) each weight identically.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from loom.config import ModelConfig
from loom.parallel.context import local_positions
from loom.parallel.mappings import copy_to_tensor_parallel_region
from loom.parallel.mesh import ParallelMesh
from loom.parallel.random import RNGTracker
from loom.parallel.sequence import (gather_from_sequence_parallel_region, mark_sequence_parallel,
                                    scatter_to_sequence_parallel_region)
from loom.parallel.tensor import (ColumnParallelLinear, VocabParallelEmbedding,
                                  initialize_parameters, normal_init, vocab_padded_init,
                                  vocab_parallel_cross_entropy)
from loom.models.transformer import (CheckpointedLayer, KVCache, TransformerLayer, build_norm,
                                     rope_cos_sin)


class Embedding(nn.Module):
    """Word embeddings (vocab-parallel) plus learned absolute positions; ``[b, s] -> [s, b, h]``."""

    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh, padded_vocab: int):
        super().__init__()
        std = cfg.init_method_std
        self.word_embeddings = VocabParallelEmbedding(padded_vocab, cfg.hidden_size, mesh,
                                                      vocab_size=cfg.vocab_size,
                                                      init_fn=normal_init(std))
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden_size,
                                                    device=mesh.device)
            w = self.position_embeddings.weight
            w.full_shape, w.init_fn = tuple(w.shape), normal_init(std)
        self.dropout = cfg.hidden_dropout

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(ids)  # [b, s, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(positions)[None]
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        return nn.functional.dropout(x, self.dropout, self.training)


class GPTModel(nn.Module):
    """The language model, or one pipeline stage of it.

    Args: ``cfg`` (``vocab_size`` must be set), ``mesh``, ``tracker`` (TP dropout RNG),
    ``layer_numbers`` (global indices of this stage's layers; default all),
    ``pre_process`` (holds the embedding), ``post_process`` (holds final norm, output layer, loss),
    ``recompute_granularity`` (None / selective / full), ``sequence_parallel`` (activations
    between TP regions are ``[s/t, b, h]``; :mod:`loom.parallel.sequence`).
    """

    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh, tracker: RNGTracker, *,
                 layer_numbers: Optional[Sequence[int]] = None, pre_process: bool = True,
                 post_process: bool = True, recompute_granularity: Optional[str] = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel and mesh.tp_size > 1
        if cfg.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size must be set before building the model")
        self.cfg, self.mesh = cfg, mesh
        self.pre_process, self.post_process = pre_process, post_process
        self.padded_vocab = cfg.padded_vocab_size(mesh.tp_size)
        self.tied = not cfg.untie_embeddings_and_output_weights
        layer_numbers = list(range(cfg.num_layers)) if layer_numbers is None else list(layer_numbers)
        if pre_process or (post_process and self.tied):
            # The last stage of a tied model keeps its own copy of the word embeddings (same name,
            # hence same init); the pipeline keeps the copies equal by all-reducing their grads.
            self.embedding = Embedding(cfg, mesh, self.padded_vocab)
        layers = {}
        for i in layer_numbers:
            layer = TransformerLayer(cfg, mesh, tracker, i, self.sequence_parallel)
            if recompute_granularity == "selective":
                layer.self_attention.recompute_core = True
            layers[str(i)] = CheckpointedLayer(layer, tracker) if recompute_granularity == "full" else layer
        self.layers = nn.ModuleDict(layers)
        if post_process:
            self.final_norm = build_norm(cfg, mesh.device)
            if self.sequence_parallel:
                mark_sequence_parallel(self.final_norm)
            if not self.tied:
                self.output_layer = ColumnParallelLinear(cfg.hidden_size, self.padded_vocab, mesh,
                                                         bias=False, init_fn=vocab_padded_init(
                                                             normal_init(cfg.init_method_std),
                                                             cfg.vocab_size))

    def init_weights(self, seed: int) -> "GPTModel":
        """Initialize every weight from ``seed`` exactly as the single-process model would."""
        initialize_parameters(self, seed, self.mesh.tp_rank, self.mesh.tp_size)
        return self

    def output_weight(self) -> torch.Tensor:
        """``[Vp/t, h]``: the word embeddings when tied, else the output layer's weight."""
        return self.embedding.word_embeddings.weight if self.tied else self.output_layer.weight

    autocast_dtype: Optional[torch.dtype] = None  # --bf16: matmuls in bf16, fp32 master weights

    def forward(self, input_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                hidden_states: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        """First stage: ``input_ids [b, s]``; later stages: ``hidden_states [s, b, h]``
        (with context parallelism, ``s`` is this CP rank's ``s/c`` load-balanced tokens).

        Returns, on the last stage, the per-token loss ``[b, s]`` (fp32) when ``labels`` is given,
        else this rank's vocabulary shard of the logits ``[b, s, Vp/t]``; on other stages the
        hidden states ``[s, b, h]``.
        """
        if self.autocast_dtype is not None:
            with torch.autocast(self.mesh.device.type, dtype=self.autocast_dtype):
                return self._forward(input_ids, labels, hidden_states, cache)
        return self._forward(input_ids, labels, hidden_states, cache)

    def _forward(self, input_ids, labels, hidden_states, cache):
        offset = cache.length if cache is not None else 0
        x = hidden_states
        s = input_ids.shape[1] if self.pre_process else x.shape[0] * (
            self.mesh.tp_size if self.sequence_parallel else 1)
        device = input_ids.device if self.pre_process else x.device
        cp = self.mesh.sizes["cp"]
        q_positions = None
        if cp > 1 and cache is None:  # this rank's s/c tokens of the sequence (load-balanced)
            positions = q_positions = local_positions(s * cp, self.mesh.coords["cp"], cp, device)
        else:
            positions = torch.arange(offset, offset + s, device=device)
        tp_group = self.mesh.groups["tp"]
        if self.pre_process:
            x = self.embedding(input_ids, positions)
            if self.sequence_parallel:  # [s, b, h] -> this rank's [s/t, b, h]
                x = scatter_to_sequence_parallel_region(x, tp_group)
        rope = None
        if self.cfg.position_embedding_type == "rope":
            rope = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rotary_base)
        for layer in self.layers.values():
            x = layer(x, rope, cache, q_positions)
        if not self.post_process:
            return x
        x = self.final_norm(x)
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tp_group)
        else:
            x = copy_to_tensor_parallel_region(x, tp_group)
        logits = nn.functional.linear(x, self.output_weight()).transpose(0, 1)  # [b, s, Vp/t]
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.mesh, self.cfg.vocab_size)

    def allocate_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``max_len`` positions."""
        cache = KVCache()
        for name, layer in self.layers.items():
            layer = layer.layer if isinstance(layer, CheckpointedLayer) else layer
            att = layer.self_attention
            shape = (batch, att.groups, max_len, att.head_dim)
            dt = dtype or att.linear_qkv.weight.dtype
            cache.keys[int(name)] = torch.zeros(shape, dtype=dt, device=self.mesh.device)
            cache.values[int(name)] = torch.zeros(shape, dtype=dt, device=self.mesh.device)
        return cache
