"""Attention building blocks shared by model families, as plain math: rotary embeddings, the
scaled dot-product core, and the KV cache of generation.

Shapes: queries ``[b, heads, s_q, d]``, keys and values ``[b, groups, s_k, d]`` (GQA when
groups < heads). The core knows nothing of parallelism: tensor parallelism gives it fewer heads,
context parallelism (:mod:`loom.parallel.context`) wraps it to gather keys and values, and the
plan may hand it a per-TP-rank generator for dropout (``rng``). The core and the KV cache carry
the markers that activation recomputation looks for (:mod:`loom.parallel.interface`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.parallel.interface import NeverRecompute, SelectiveRecompute


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float,
                 scaling_factor: float = 1.0,
                 interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[s, d]`` of rotary embeddings (Su et al. 2021); ``scaling_factor``: linear
    position interpolation (frequencies / factor). Frequency i (``base^(-2i/d)``) sits at
    channels i and i + d/2 (the halves layout of ``rotate_half``, Megatron's default), or at
    channels 2i and 2i + 1 with ``interleaved`` (``--rotary-interleaved``: Megatron-Core's
    ``RotaryEmbedding.get_emb``, GPT-J's and the original LLaMA's pairs)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=positions.device) / head_dim))
    if scaling_factor != 1.0:
        inv_freq = inv_freq / scaling_factor
    freqs = torch.outer(positions.float(), inv_freq)
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool = False) -> torch.Tensor:
    """Rotate ``x [s, b, heads, d]`` by position; ``cos``/``sin`` are ``[s, r]``: the first r
    channels rotate, the rest pass (r < d: ``--rotary-percent``, Megatron-LM's
    ``_apply_rotary_pos_emb_bshd``; GPT-NeoX's partial rotary). The rotated pairs are channels
    (i, i + r/2) (halves), or (2i, 2i + 1) with ``interleaved`` (``--rotary-interleaved``,
    Megatron's ``_rotate_half(x, rotary_interleaved=True)``: ``[-x1, x0, -x3, x2, ...]``);
    ``cos``/``sin`` must be in the same layout (:func:`rope_cos_sin`)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin, interleaved), x[..., r:]], dim=-1)
    if interleaved:
        rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, None, None, :].to(x.dtype), sin[:, None, None, :].to(x.dtype)
    return x * cos + rotated * sin


def causal_mask(q_positions: torch.Tensor, seq_length: int) -> torch.Tensor:
    """Boolean ``[s_q, s_k]``: the query at global position p sees keys at positions <= p."""
    k_positions = torch.arange(seq_length, device=q_positions.device)
    return k_positions[None, :] <= q_positions[:, None]


def window_causal_mask(q_positions: torch.Tensor, seq_length: int,
                       window: Optional[int] = None) -> torch.Tensor:
    """Boolean ``[s_q, s_k]``: the query at position p sees keys ``j`` with
    ``0 <= p - j <= window`` (``window`` None: every ``j <= p``; Megatron's
    ``get_sliding_window_causal_mask`` with ``(window, 0)``; Gemma 3's local layers and
    gpt-oss's sliding layers)."""
    rel = q_positions[:, None] - torch.arange(seq_length, device=q_positions.device)[None, :]
    return (rel >= 0) & (rel <= window) if window is not None else rel >= 0


class DotProductAttention(nn.Module, SelectiveRecompute):
    """``softmax(q k^T / sqrt(d)) v`` under a causal mask by global position (keys are at
    positions ``0 .. s_k - 1``): ``q [b, a, s_q, d]``, ``k, v [b, g, s_k, d]`` ->
    ``[b, a, s_q, d]``. ``s_q == s_k`` is the plain causal case; one query (decoding) sees every
    key; otherwise the mask is built from ``q_positions [s_q]``.

    ``causal=False`` (a bidirectional encoder, BERT): every query sees every key, except the
    keys that ``key_padding_mask [b, s_k]`` (True = a real token) marks as padding. ``scale``:
    the scores' factor instead of ``1 / sqrt(d)`` (muP's ``1 / d``: Megatron's
    ``softmax_scale``; context parallelism reads it too)."""

    def __init__(self, dropout: float = 0.0, causal: bool = True,
                 scale: Optional[float] = None):
        super().__init__()
        self.dropout = dropout
        self.causal = causal
        self.scale = scale
        self.rng = None  # per-TP-rank generator (RNGTracker) for dropout over partitioned heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                q_positions: Optional[torch.Tensor] = None,
                key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        s_q, s_k = q.shape[2], k.shape[2]
        mask = None
        if not self.causal:
            p = self.dropout if self.training else 0.0
            if key_padding_mask is not None:
                mask = key_padding_mask.bool()[:, None, None, :]
            ctx = self.rng.fork() if (p > 0 and self.rng is not None) else contextlib.nullcontext()
            with ctx:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                      enable_gqa=q.shape[1] != k.shape[1],
                                                      scale=self.scale)
        if s_q != s_k and s_q > 1:
            if q_positions is None:
                raise ValueError(f"{s_q} queries against {s_k} keys need their positions")
            mask = causal_mask(q_positions, s_k)
        p = self.dropout if self.training else 0.0
        ctx = self.rng.fork() if (p > 0 and self.rng is not None) else contextlib.nullcontext()
        with ctx:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=s_q == s_k and s_q > 1,
                enable_gqa=q.shape[1] != k.shape[1], scale=self.scale)


@dataclass
class KVCache(NeverRecompute):
    """Keys and values of past positions, per layer: ``[b, g/t, s_max, d]`` each."""

    keys: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)
    length: int = 0  # positions already cached

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v [b, g, s, d]`` at the current length; return every cached position's.
        Raises RuntimeError if the layer's cache was not allocated."""
        if layer not in self.keys:
            raise RuntimeError(f"KV cache not allocated for layer {layer}")
        start, s = self.length, k.shape[2]
        if start > 0 and s != 1:
            raise ValueError("after the prompt, decode one token at a time")
        self.keys[layer][:, :, start:start + s] = k
        self.values[layer][:, :, start:start + s] = v
        return self.keys[layer][:, :, :start + s], self.values[layer][:, :, :start + s]
