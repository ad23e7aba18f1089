"""Multi-token prediction (MTP; DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv
2412.19437, sec. 2.2, eq. 21-25; Megatron-Core's ``MultiTokenPredictionBlock``) as plain math.

D sequential modules on the last pipeline stage. Module k (1..D) takes the previous depth's
hidden states ``h^{k-1} [s, b, h]`` (``h^0``: the main model's final-normed output) and the
embeddings of the tokens shifted left by k (the shared embedding; the last k positions padded
with token 0 and masked out of the loss): ``h^k = norm_f(layer(W_eh [norm_e(emb); norm_h(
h^{k-1})]))``, then the shared output head predicts token ``t + 1 + k`` at position t. Under
context parallelism the shift crosses the CP chunks and each rank's loss is its share of
the global mean times c (the plan installs both; gradients are averaged over CP). The MTP
loss is the mean over the D depths of each depth's mean cross-entropy over its unmasked
positions, weighted by ``--mtp-loss-scaling-factor`` (eq. 25) and added to the LM loss in
training; evaluation and generation skip the modules. Parameter names:
``mtp.layers.<k-1>.{enorm,hnorm,eh_proj,mtp_model_layer,final_layernorm}`` (Megatron's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from loom.config import ModelConfig
from loom.models.chunk import build_norm


@dataclass
class MTPContext:
    """What the MTP modules need beyond the hidden states, per micro-batch: ``tokens`` and
    ``labels`` ``[b, s]``, ``position_ids [s]``; filled by :func:`mtp_loss`: ``losses`` (each
    depth's mean loss, a scalar tensor in the graph) and ``weighted`` (the loss term added to
    the LM loss)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    losses: list = field(default_factory=list)
    weighted: Optional[torch.Tensor] = None


def roll_left(x: torch.Tensor) -> torch.Tensor:
    """``x [..., s]`` shifted one position left along the last dimension, 0 at the end
    (Megatron-Core's ``roll_tensor`` without context parallelism)."""
    out = torch.roll(x, shifts=-1, dims=-1)
    out[..., -1] = 0
    return out


def local_token_count(count: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(tokens the loss is averaged over, loss multiplier)`` of this rank's unmasked
    ``count``: itself and 1 (no context parallelism)."""
    return count, 1.0


class MultiTokenPredictionLayer(nn.Module):
    """Depth k: ``(h^{k-1} [s, b, h], emb [s, b, h], layer inputs) -> h^k [s, b, h]``.
    ``layer``: the transformer layer (built by the caller, global index L + k - 1)."""

    def __init__(self, cfg: ModelConfig, layer: nn.Module):
        super().__init__()
        self.enorm = build_norm(cfg)
        self.hnorm = build_norm(cfg)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.mtp_model_layer = layer
        self.final_layernorm = build_norm(cfg)

    def forward(self, hidden: torch.Tensor, emb: torch.Tensor, inputs: tuple) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        return self.final_layernorm(self.mtp_model_layer(x, *inputs))


class MultiTokenPrediction(nn.Module):
    """The D modules, ``layers.<k-1>`` (``build_layer(number)`` builds each transformer layer).
    ``shift`` (:func:`roll_left`) and ``token_count`` (:func:`local_token_count`) are what
    context parallelism replaces (the plan: the shift across the CP chunks, the count over
    the CP group)."""

    def __init__(self, cfg: ModelConfig, build_layer):
        super().__init__()
        self.shift, self.token_count = roll_left, local_token_count
        self.layers = nn.ModuleList(
            MultiTokenPredictionLayer(cfg, build_layer(cfg.num_layers + k))
            for k in range(cfg.mtp_num_layers))


def mtp_loss(chunk, hidden: torch.Tensor, ctx: MTPContext, inputs: tuple) -> torch.Tensor:
    """Run the chunk's MTP modules on the final-normed ``hidden [s, b, h]`` and return the
    weighted MTP loss ``factor / D * sum_k loss_k`` (a scalar, also ``ctx.weighted``); each
    ``loss_k`` is appended to ``ctx.losses``. ``chunk`` has ``embedding``, ``mtp``, ``head`` and ``output_weight()``;
    ``inputs``: the layers' extra inputs (RoPE, positions, no cache, MoE context)."""
    cfg = chunk.cfg
    tokens, labels, positions = ctx.tokens, ctx.labels, ctx.position_ids
    mask = torch.ones_like(labels, dtype=torch.float32)
    shift = chunk.mtp.shift
    for layer in chunk.mtp.layers:
        tokens, labels, mask, positions = (shift(t) for t in (tokens, labels, mask, positions))
        hidden = layer(hidden, chunk.embedding(tokens, positions), inputs)
        per_token = chunk.head(hidden, chunk.output_weight(), labels)  # [b, s] fp32
        count, scale = chunk.mtp.token_count(mask.sum())
        ctx.losses.append(scale * (per_token * mask).sum() / count.clamp_min(1))
    ctx.weighted = cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers * sum(ctx.losses)
    return ctx.weighted


def mtp_metrics(ctx: Optional[MTPContext]) -> dict:
    """``mtp loss`` (the mean over depths, unweighted) and ``mtp_<k> loss`` per depth."""
    if ctx is None or not ctx.losses:
        return {}
    out = {f"mtp_{k + 1} loss": v.detach() for k, v in enumerate(ctx.losses)}
    out["mtp loss"] = sum(out.values()) / len(ctx.losses)
    return out
