"""The forward step and per-token statistics shared by the causal language-model tasks (GPT /
LLaMA and Mamba / hybrid families: their chunks share GPT's call signature)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def forward(chunk, batch: dict, hidden_states=None) -> torch.Tensor:
    """``[b, s, Vp/t]`` logits on the last stage (no labels: the head returns logits),
    ``[s, b, h]`` hidden states on the others."""
    return chunk(input_ids=batch["tokens"] if chunk.pre_process else None,
                 hidden_states=hidden_states, position_ids=batch["position_ids"])


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy ``[b, s]`` (fp32) of full-vocabulary ``logits [b, s, V]``."""
    b, s, V = logits.shape
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1),
                           reduction="none").view(b, s)


def masked_loss(logits: torch.Tensor, batch: dict) -> dict:
    """Per sample: ``loss_sum`` (summed over the masked-in positions) and ``targets``."""
    mask = batch["loss_mask"]
    return {"loss_sum": (token_losses(logits, batch["labels"]) * mask).sum(-1),
            "targets": mask.sum(-1)}
