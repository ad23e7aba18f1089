"""gpt-oss's attention as plain math (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card";
Megatron-Core's ``DotProductAttention`` with ``softmax_type`` and ``window_size``).

* **Attention sinks** (``--softmax-type``): the softmax over a query's keys gets one more
  logit in its denominator, ``p_j = exp(z_j) / (exp(sink_a) + sum_i exp(z_i))``: ``off-by-one``
  fixes ``sink = 0`` (E. Miller, "Attention is off by one", 2023), ``learnable`` learns one
  logit per head (Megatron's ``softmax_offset [a]``, initialized like the weights; its shards
  follow the heads under TP). The weights of a row then sum to less than 1.
* **Sliding window** (``--window-size LEFT,0``): the query at position p sees keys
  ``p - LEFT .. p`` (Megatron's ``get_sliding_window_causal_mask``); with
  ``--window-attn-skip-freq`` some layers stay full (``ModelConfig.is_window_layer``).
* **YaRN RoPE of --enable-gpt-oss** (:func:`gpt_oss_rope`): :mod:`loom.models.yarn` with the
  correction range left unrounded (Megatron's ``yarn_correction_range_round_to_int=False``).

Shapes: ``q [b, heads, s_q, d]``, ``k, v [b, groups, s_k, d]``; the heads a rank holds are read
from ``q``, so the same code runs sharded.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.config.model_gptoss import GPT_OSS_YARN
from loom.models.attention import DotProductAttention, window_causal_mask
from loom.models.yarn import yarn_cos_sin


def sink_softmax(scores: torch.Tensor, sink: Optional[torch.Tensor]) -> torch.Tensor:
    """Softmax of ``scores [b, heads, s_q, s_k]`` along keys with the per-head ``sink
    [heads]`` logit added to the denominator (None: the plain softmax); computed in fp32
    (or wider), returned in ``scores``' dtype (Megatron's ``SoftmaxOne``)."""
    z = scores.to(torch.promote_types(scores.dtype, torch.float32))  # fp32 at least
    if sink is None:
        return torch.softmax(z, dim=-1).to(scores.dtype)
    col = sink.to(z.dtype).reshape(1, -1, 1, 1).expand(z.shape[0], -1, z.shape[2], 1)
    return torch.softmax(torch.cat([z, col], dim=-1), dim=-1)[..., :-1].to(scores.dtype)


class SinkWindowAttention(DotProductAttention):
    """``softmax_sink(q k^T / sqrt(d) + mask) v``: the causal (optionally sliding-window) core
    with attention sinks; keys at positions ``0 .. s_k - 1``, queries at ``q_positions``
    (default: the last s_q). ``softmax_offset [heads]``: the learnable sinks (a parameter), a
    zero buffer for off-by-one, absent for vanilla. ``scale``: instead of ``1 / sqrt(d)``
    (muP's)."""

    def __init__(self, dropout: float, heads: int, softmax_type: str = "vanilla",
                 window: Optional[int] = None, scale: Optional[float] = None):
        super().__init__(dropout, scale=scale)
        self.softmax_type, self.window = softmax_type, window
        if softmax_type == "learnable":
            self.softmax_offset = nn.Parameter(torch.empty(heads))
        elif softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads), persistent=False)
        else:
            self.softmax_offset = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                q_positions: Optional[torch.Tensor] = None,
                key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        s_q, s_k = q.shape[2], k.shape[2]
        if q_positions is None:
            q_positions = torch.arange(s_k - s_q, s_k, device=q.device)
        mask = window_causal_mask(q_positions, s_k, self.window)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / math.sqrt(q.shape[-1]) if self.scale is None else scores * self.scale
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = self.softmax_offset
        if sink is not None and sink.shape[0] != q.shape[1]:
            raise ValueError(f"{sink.shape[0]} sink logits for {q.shape[1]} heads")
        probs = sink_softmax(scores, sink)
        p = self.dropout if self.training else 0.0
        fork = self.rng.fork() if (p > 0 and self.rng is not None) else contextlib.nullcontext()
        with fork:
            probs = F.dropout(probs, p)
        return torch.matmul(probs, v)


def gpt_oss_rope(positions: torch.Tensor, dim: int, base: float) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """cos, sin ``[s, dim]`` (halves layout) of ``--enable-gpt-oss``'s YaRN RoPE:
    :func:`loom.models.yarn.yarn_cos_sin` with :data:`~loom.config.model_gptoss.GPT_OSS_YARN`
    and real-valued correction bounds (clamped to ``[0, dim - 1]``; attention factor
    ``m(factor, mscale) / m(factor, mscale_all_dim)``)."""
    return yarn_cos_sin(positions, dim, base, **GPT_OSS_YARN, round_to_int=False)
