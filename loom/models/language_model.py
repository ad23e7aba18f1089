"""The language-model forward step and loss the GPT and Mamba families share (Gemma 3 shares the
loss): Megatron-LM's ``forward_step`` and ``loss_func`` of ``pretrain_gpt.py``, with the MoE
layers' auxiliary losses and metrics (:mod:`loom.models.moe`) and, on a chunk that runs them,
the multi-token prediction losses (:mod:`loom.models.mtp`).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from loom.models.chunk import LanguageModelChunk
from loom.models.moe import MoEContext
from loom.models.mtp import MTPContext, mtp_metrics


def lm_loss(per_token: torch.Tensor, moe: Optional[MoEContext] = None,
            mtp: Optional[MTPContext] = None, loss_mask: Optional[torch.Tensor] = None
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean of the per-token loss ``[b, s]`` (with ``loss_mask [b, s]``, ``--eod-mask-loss``:
    Megatron's ``sum(loss x mask) / sum(mask)`` over this micro-batch's tokens, at least 1 in
    the denominator) (plus, in training with ``--mtp-num-layers``, the
    weighted multi-token prediction loss), and the metrics: ``lm loss``, ``mtp loss`` (mean over
    the depths), for MoE models
    the auxiliary losses summed over this chunk's MoE layers (already in the gradient through
    :class:`~loom.models.moe.AuxLossScaler`) and the per-expert token load (min, max, max/mean)."""
    if loss_mask is None:
        loss = per_token.float().mean()
    else:
        mask = loss_mask.float()
        loss = (per_token.float() * mask).sum() / mask.sum().clamp_min(1.0)
    metrics = {"lm loss": loss.detach(), **mtp_metrics(mtp)}
    if mtp is not None and mtp.losses:
        loss = loss + mtp.weighted
    if moe is not None and moe.metrics:
        for kind in ("aux loss", "z loss", "dropped"):
            metrics[f"moe {kind}"] = sum(v.float() for k, v in moe.metrics.items()
                                         if k.startswith(f"moe {kind}/"))
        load = sum(v for k, v in moe.metrics.items() if k.startswith("moe load/")).float()
        metrics.update({"moe load min": load.min(), "moe load max": load.max(),
                        "moe load imbalance": load.max() / load.mean().clamp_min(1e-9)})
    return loss, metrics


DOCUMENT_INPUTS = ("document_starts", "document_position_ids")
"""The batch keys of :class:`loom.data.document_masks.DocumentResets` a chunk takes as inputs."""


def forward_step(chunk: LanguageModelChunk, batch: dict, hidden_states: Optional[torch.Tensor] = None):
    """Megatron's forward step: ``batch`` has ``tokens``, ``labels`` ``[b, s]``,
    ``position_ids [s]`` and ``num_microbatches`` (m: MoE auxiliary losses are scaled by 1/m
    like the LM loss), and, from ``--reset-attention-mask`` / ``--reset-position-ids``,
    ``document_starts`` / ``document_position_ids`` ``[b, s]``; returns ``(output, loss_fn)``."""
    moe = mtp = None
    if chunk.cfg.num_experts or chunk.cfg.dsa:  # MoE's / DSA's auxiliary-loss scale
        moe = MoEContext(scale=1.0 / batch.get("num_microbatches", 1))
    if chunk.cfg.mtp_num_layers and chunk.post_process:
        s = batch["tokens"].shape[1]
        positions = batch.get("position_ids")
        mtp = MTPContext(batch["tokens"], batch["labels"], torch.arange(
            s, device=batch["tokens"].device) if positions is None else positions)
    extra = {k: v for k, v in (("moe", moe), ("mtp", mtp))  # Mamba shares this step, no MTP
             if k in chunk.extra_inputs}
    extra.update((k, batch[k]) for k in DOCUMENT_INPUTS if k in batch)  # loom.data.document_masks
    out = chunk(input_ids=batch["tokens"] if chunk.pre_process else None,
                labels=batch["labels"] if chunk.post_process else None,
                hidden_states=hidden_states, position_ids=batch.get("position_ids"), **extra)
    return out, functools.partial(lm_loss, moe=moe, mtp=mtp, loss_mask=batch.get("loss_mask"))
