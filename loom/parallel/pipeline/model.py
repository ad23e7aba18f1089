"""This rank's model chunk(s) of the pipeline, and the tied-embedding gradient all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.models.gpt import GPTModel
from loom.parallel.pipeline.layout import chunk_layers


def build_pipeline_chunks(cfg, mesh, tracker) -> list[GPTModel]:
    """Chunk k of stage r holds the layers of virtual stage ``k p + r``; the first virtual stage
    holds the embedding, the last the final norm, output layer and loss. The trainer calls
    ``init_weights(seed)`` on each chunk (weights then equal the single-process model's)."""
    par, p, r = cfg.parallel, mesh.pp_size, mesh.pp_rank
    layers = chunk_layers(cfg.model.num_layers, p, r, par.num_layers_per_virtual_pipeline_stage,
                          par.decoder_first_pipeline_num_layers,
                          par.decoder_last_pipeline_num_layers)
    v = len(layers)
    chunks = []
    for k, numbers in enumerate(layers):
        pre, post = (k == 0 and r == 0), (k == v - 1 and r == p - 1)
        chunk = GPTModel(cfg.model, mesh, tracker, layer_numbers=numbers, pre_process=pre,
                         post_process=post,
                         recompute_granularity=cfg.training.recompute_granularity,
                         sequence_parallel=cfg.parallel.sequence_parallel)
        if post and not pre and chunk.tied:
            # Only the word embeddings serve as the output layer here: drop the (unused) learned
            # positions, and keep the duplicate out of the gradient norm.
            chunk.embedding.position_embeddings = None
            chunk.embedding.word_embeddings.weight.shared_duplicate = True
        chunk.virtual_stage = k * p + r
        chunks.append(chunk)
    return chunks


def tied_embedding_weight(model_chunks) -> "torch.nn.Parameter | None":
    """The word-embedding weight this rank shares over the embedding group, if any."""
    for chunk in model_chunks:
        if chunk.tied and (chunk.pre_process or chunk.post_process) and hasattr(chunk, "embedding"):
            return chunk.embedding.word_embeddings.weight
    return None


def allreduce_embedding_grads(model_chunks, mesh) -> None:
    """Sum the tied word-embedding gradient of the first and last stage (after DP reduction), so
    both copies take the same optimizer step (Megatron's ``_allreduce_word_embedding_grads``)."""
    if mesh.pp_size == 1:
        return
    group = mesh.groups.get("embedding")
    w = tied_embedding_weight(model_chunks)
    if group is None or w is None or w.grad is None:
        return
    dist.all_reduce(w.grad, group=group)
