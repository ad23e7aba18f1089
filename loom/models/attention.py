"""Attention building blocks shared by model families, as plain math: rotary embeddings, the
scaled dot-product core (:class:`DotProductAttention`; with attention sinks and a sliding
window, :class:`SinkWindowAttention`: gpt-oss's, Megatron-Core's ``DotProductAttention`` with
``softmax_type`` and ``window_size``), the KV cache of generation, and the fused-QKV
self-attention layer the GPT and Mamba families build from (:class:`SelfAttention`,
Megatron-Core's ``transformer/attention.py``).

* **Attention sinks** (``--softmax-type``): the softmax over a query's keys gets one more
  logit in its denominator, ``p_j = exp(z_j) / (exp(sink_a) + sum_i exp(z_i))``: ``off-by-one``
  fixes ``sink = 0`` (E. Miller, "Attention is off by one", 2023), ``learnable`` learns one
  logit per head (Megatron's ``softmax_offset [a]``, initialized like the weights; its shards
  follow the heads under TP). The weights of a row then sum to less than 1.
* **Sliding window** (``--window-size LEFT,0``): the query at position p sees keys
  ``p - LEFT .. p`` (Megatron's ``get_sliding_window_causal_mask``); with
  ``--window-attn-skip-freq`` some layers stay full (``ModelConfig.is_window_layer``).

Shapes: queries ``[b, heads, s_q, d]``, keys and values ``[b, groups, s_k, d]`` (GQA when
groups < heads). The core knows nothing of parallelism: tensor parallelism gives it fewer heads,
context parallelism (:mod:`loom.parallel.context`) wraps it to gather keys and values, and the
plan may hand it a per-TP-rank generator for dropout (``rng``). The core and the KV cache carry
the markers that activation recomputation looks for (:mod:`loom.parallel.interface`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ModelConfig
from loom.models.rope_scaling import llama3_inv_freq
from loom.parallel.interface import NeverRecompute, SelectiveRecompute


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float,
                 scaling_factor: float = 1.0, interleaved: bool = False,
                 interpolation: Optional[float] = None,
                 llama3_factor: Optional[float] = None,
                 llama3_bands: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[s, d]`` of rotary embeddings (Su et al. 2021) at ``positions [s]``.
    Frequency i (``base^(-2i/d)``) sits at channels i and i + d/2 (the halves layout of
    ``rotate_half``, Megatron's default), or at channels 2i and 2i + 1 with ``interleaved``
    (``--rotary-interleaved``: Megatron-Core's ``RotaryEmbedding.get_emb``, GPT-J's and the
    original LLaMA's pairs).

    Scalings: ``scaling_factor`` divides the frequencies (Gemma 3's linear scaling, HF's
    order of operations); ``interpolation`` multiplies the positions by its inverse
    (``--rotary-seq-len-interpolation-factor``: Megatron-Core's ``seq_len_interpolation_factor``,
    in its order of operations; Chen et al. 2023, "Extending Context Window of Large Language
    Models via Positional Interpolation"); ``llama3_factor`` applies Llama 3.1's frequency
    scaling (``--use-rope-scaling``: :func:`loom.models.rope_scaling.llama3_inv_freq`) with
    ``llama3_bands`` (low factor, high factor, original context; default Llama 3.1's)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=positions.device) / head_dim))
    if llama3_factor is not None:
        inv_freq = llama3_inv_freq(inv_freq, llama3_factor, *(llama3_bands or ()))
    if scaling_factor != 1.0:
        inv_freq = inv_freq / scaling_factor
    seq = positions.float()
    if interpolation is not None:
        seq = seq * (1 / interpolation)
    freqs = torch.outer(seq, inv_freq)
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


def chunk_causal_mask(q_positions: torch.Tensor, seq_length: int, chunk: int) -> torch.Tensor:
    """Boolean ``[s_q, s_k]``: the query at position p sees the keys ``j <= p`` of its own chunk
    of ``chunk`` positions, ``j // chunk == p // chunk`` (Llama 4's chunked attention,
    ``--attention-chunk-size``; transformers' ``create_chunked_causal_mask``)."""
    k = torch.arange(seq_length, device=q_positions.device)[None, :]
    p = q_positions[:, None]
    return (k <= p) & (k // chunk == p // chunk)


def temperature_scales(positions: torch.Tensor, floor_scale: int, slope: float) -> torch.Tensor:
    """``[s]`` fp32 query scales of Llama 4's attention temperature tuning
    (``--attn-temperature-floor-scale F``, ``--attn-temperature-scale a``):
    ``log(floor((p + 1) / F) + 1) a + 1`` at position p (transformers' ``Llama4TextAttention``;
    Nakanishi 2025, "Scalable-Softmax Is Superior for Attention")."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * slope + 1.0


class Documents(NamedTuple):
    """The ``positions`` a layer takes under ``--reset-attention-mask``: the tokens' sequence
    positions ``[s]`` and each token's document start ``starts [b, s]``
    (:func:`loom.data.document_masks.document_starts`)."""

    positions: torch.Tensor
    starts: torch.Tensor


def document_causal_mask(starts: torch.Tensor) -> torch.Tensor:
    """Boolean ``[b, 1, s, s]`` from ``starts [b, s]``: the query at j sees the keys
    ``starts[j] <= k <= j``, the earlier tokens of its own document (Megatron-Core's
    ``attention_mask[0, (i + 1):, :(i + 1)] = 0`` at each end-of-document index i,
    ``_get_ltor_masks_and_position_ids``, as True = attend)."""
    k = torch.arange(starts.shape[-1], device=starts.device)
    return ((k[None, None, :] <= k[None, :, None])
            & (k[None, None, :] >= starts[:, :, None]))[:, None]


MAX_LOGIT_CHUNK = 1 << 24  # score elements per chunk of max_attention_logits


@torch.no_grad()
def max_attention_logits(q: torch.Tensor, k: torch.Tensor, scale: Optional[float],
                         mask: Optional[torch.Tensor] = None,
                         causal: bool = False) -> torch.Tensor:
    """Per query head, the largest scaled pre-softmax score ``q k^T * scale`` over the batch
    and the unmasked (query, key) pairs: ``q [b, a, s_q, d]``, ``k [b, g, s_k, d]`` (GQA:
    head h uses group ``h // (a / g)``) -> fp32 ``[a]`` (-inf for a head that sees no key).
    ``scale`` None is ``1 / sqrt(d)``; ``mask`` (True = attend) broadcasts to
    ``[b, a, s_q, s_k]``; ``causal``: the query at i sees keys ``<= i`` (``s_q == s_k``).
    What Transformer Engine's ``return_max_logit`` returns to Megatron-Core's QK-clip
    (``extensions/transformer_engine.py``); computed in fp32, chunked over queries so that a
    chunk holds at most ``MAX_LOGIT_CHUNK`` scores."""
    b, a, s_q, d = q.shape
    s_k = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kf = k.float().repeat_interleave(a // k.shape[1], dim=1).transpose(-1, -2)
    best = torch.full((a,), float("-inf"), dtype=torch.float32, device=q.device)
    rows = max(1, MAX_LOGIT_CHUNK // max(1, b * a * s_k))
    for lo in range(0, s_q, rows):
        hi = min(s_q, lo + rows)
        scores = torch.matmul(q[:, :, lo:hi].float(), kf) * scale  # [b, a, rows, s_k]
        if mask is not None:
            m = mask if mask.shape[-2] == 1 else mask[..., lo:hi, :]
            scores = scores.masked_fill(~m, float("-inf"))
        if causal:
            seen = torch.arange(s_k, device=q.device)[None, :] <= \
                torch.arange(lo, hi, device=q.device)[:, None]
            scores = scores.masked_fill(~seen, float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best


class MaxLogitRecord:
    """What an attention core keeps for QK-clip and ``--log-max-attention-logit``: when
    ``record_max_logit`` is set (:func:`loom.training.qk_clip.attention_layers`), each training
    forward folds its per-head maximum scaled logit into ``max_logit`` (fp32 ``[a/t]``, the
    maximum over the step's micro-batches; None before the first), which the step reads and
    resets (Megatron-Core's ``current_max_attn_logits``)."""

    record_max_logit: bool = False
    max_logit: Optional[torch.Tensor] = None

    @torch.compiler.disable
    def _record(self, q: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor] = None,
                causal: bool = False, scores: Optional[torch.Tensor] = None) -> None:
        """Fold this forward's maxima in (``scores``: the masked scaled scores
        ``[b, a, s_q, s_k]`` when the core already has them)."""
        if not (self.record_max_logit and self.training):
            return
        with torch.no_grad():
            cur = scores.detach().float().amax(dim=(0, 2, 3)) if scores is not None else \
                max_attention_logits(q.detach(), k.detach(), self.scale, mask, causal)
        self.max_logit = cur if self.max_logit is None else torch.maximum(self.max_logit, cur)


class DotProductAttention(MaxLogitRecord, nn.Module, SelectiveRecompute):
    """``softmax(q k^T / sqrt(d)) v`` under a causal mask by global position (keys are at
    positions ``0 .. s_k - 1``): ``q [b, a, s_q, d]``, ``k, v [b, g, s_k, d]`` ->
    ``[b, a, s_q, d]``. ``s_q == s_k`` is the plain causal case; one query (decoding) sees every
    key; otherwise the mask is built from ``q_positions [s_q]``. ``q_positions`` as
    :class:`Documents` (``--reset-attention-mask``, ``s_q == s_k``): each query sees its own
    document's earlier keys only (:func:`document_causal_mask`).

    ``causal=False`` (a bidirectional encoder, BERT): every query sees every key, except the
    keys that ``key_padding_mask [b, s_k]`` (True = a real token) marks as padding. ``scale``:
    the scores' factor instead of ``1 / sqrt(d)`` (muP's ``1 / d``: Megatron's
    ``softmax_scale``; context parallelism reads it too). ``chunk``: each query sees only the
    keys of its own chunk of that many positions (:func:`chunk_causal_mask`, Llama 4's RoPE
    layers)."""

    def __init__(self, dropout: float = 0.0, causal: bool = True,
                 scale: Optional[float] = None, chunk: Optional[int] = None):
        super().__init__()
        self.dropout = dropout
        self.causal = causal
        self.scale = scale
        self.chunk = chunk
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
            self._record(q, k, mask)
            ctx = self.rng.fork() if (p > 0 and self.rng is not None) else contextlib.nullcontext()
            with ctx:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                      enable_gqa=q.shape[1] != k.shape[1],
                                                      scale=self.scale)
        if isinstance(q_positions, Documents):
            if s_q != s_k:
                raise ValueError(f"a document mask needs as many queries as keys, got {s_q} "
                                 f"queries against {s_k} keys")
            mask = document_causal_mask(q_positions.starts)
        elif s_q != s_k and s_q > 1:
            if q_positions is None:
                raise ValueError(f"{s_q} queries against {s_k} keys need their positions")
            mask = causal_mask(q_positions, s_k)
        if self.chunk is not None and s_k > self.chunk:  # keys beyond the first chunk
            pos = q_positions.positions if isinstance(q_positions, Documents) else q_positions
            if pos is None:  # the last s_q positions (a decoding step: the newest)
                pos = torch.arange(s_k - s_q, s_k, device=q.device)
            chunked = chunk_causal_mask(pos, s_k, self.chunk)
            mask = chunked if mask is None else mask & chunked
        p = self.dropout if self.training else 0.0
        is_causal = mask is None and s_q == s_k and s_q > 1
        self._record(q, k, mask, is_causal)
        ctx = self.rng.fork() if (p > 0 and self.rng is not None) else contextlib.nullcontext()
        with ctx:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p,
                is_causal=is_causal,
                enable_gqa=q.shape[1] != k.shape[1], scale=self.scale)


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
        self._record(q, k, scores=scores)
        sink = self.softmax_offset
        if sink is not None and sink.shape[0] != q.shape[1]:
            raise ValueError(f"{sink.shape[0]} sink logits for {q.shape[1]} heads")
        probs = sink_softmax(scores, sink)
        p = self.dropout if self.training else 0.0
        fork = self.rng.fork() if (p > 0 and self.rng is not None) else contextlib.nullcontext()
        with fork:
            probs = F.dropout(probs, p)
        return torch.matmul(probs, v)


@dataclass
class KVCache(NeverRecompute):
    """Keys and values of past positions, per layer: ``[b, g/t, s_max, d]`` each."""

    keys: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)
    length: int = 0  # positions already cached

    def allocate(self, layer: int, shapes: tuple[tuple, tuple], like: torch.Tensor,
                 dtype: Optional[torch.dtype] = None) -> None:
        """Zero key and value buffers of ``shapes`` (an attention module's ``cache_shapes``)
        for ``layer``, on ``like``'s device, in ``dtype`` (default: ``like``'s)."""
        self.keys[layer] = torch.zeros(shapes[0], dtype=dtype or like.dtype, device=like.device)
        self.values[layer] = torch.zeros(shapes[1], dtype=dtype or like.dtype, device=like.device)

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


class L2Norm(nn.Module):
    """``x [..., d] -> x / sqrt(mean(x^2) + eps)`` over the last dimension, computed in fp32 and
    returned in ``x``'s dtype; no parameters (``--qk-l2-norm``, Llama 4; Megatron-Core's
    ``torch_norm.L2Norm``)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class SelfAttention(nn.Module):
    """``x [s, b, h] -> [s, b, h]``: fused QKV projection (a query heads, g key/value groups of
    dimension d), RoPE, the attention core, output projection.

    ``--attention-output-gate`` (Qwen3-Next; Megatron-Core's ``attention_output_gate``): the
    fused projection also yields a gate ``G [s, b, a d]`` (loom's rows ``[Q; G; K; V]``, each
    block split over TP), and the attention output ``o [s, b, a d]`` becomes
    ``o * sigmoid(G)`` (computed in fp32, cast back) before the output projection. Megatron
    interleaves the same rows per query group, ``[g][a/g q heads, a/g gate heads, k, v][d]``.

    A layer ``--no-rope-freq`` marks (``ModelConfig.is_no_rope_layer``; Llama 4's NoPE layers)
    does not rotate its queries and keys: Megatron-Core's ``Attention.forward`` drops the
    rotary embedding there. ``--qk-layernorm`` (a learned per-head norm) or ``--qk-l2-norm`` (:class:`L2Norm`)
    normalizes each query and key head before RoPE (``--qk-l2-norm-rope-layers-only``: in the
    RoPE layers only). Llama 4's other attention (:mod:`loom.config.model_llama4`): a RoPE layer
    under ``--attention-chunk-size`` attends within its chunk (the core's ``chunk``); a NoPE
    layer under ``--attn-temperature-floor-scale`` scales its queries by position
    (:func:`temperature_scales`)."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        a, g, d, h = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim, cfg.hidden_size
        self.layer_number, self.head_dim = layer_number, d
        self.rotates = not cfg.is_no_rope_layer(layer_number)  # --no-rope-freq: a NoPE layer
        self.temperature = (cfg.attn_temperature_floor_scale, cfg.attn_temperature_scale) \
            if cfg.is_temperature_layer(layer_number) else None  # Llama 4's NoPE layers
        self.gated = cfg.attention_output_gate
        blocks = (a, a, g, g) if self.gated else (a, g, g)  # heads of [Q; (G;) K; V]
        self.shares = tuple(n / sum(blocks) for n in blocks)  # shares of the fused width
        bias = not cfg.disable_bias_linear
        self.linear_qkv = nn.Linear(h, sum(blocks) * d, bias=bias or cfg.add_qkv_bias)
        self.q_layernorm = self.k_layernorm = None
        if cfg.qk_layernorm:  # per-head norm of queries and keys before RoPE (Megatron, Qwen3)
            norm = nn.RMSNorm if cfg.normalization == "RMSNorm" else nn.LayerNorm
            self.q_layernorm, self.k_layernorm = (norm(d, eps=cfg.norm_epsilon) for _ in "qk")
        elif cfg.qk_l2_norm and (self.rotates or not cfg.qk_l2_norm_rope_layers_only):
            # Llama 4's, in the same slots (Megatron-Core's L2Norm)
            self.q_layernorm, self.k_layernorm = L2Norm(cfg.norm_epsilon), L2Norm(cfg.norm_epsilon)
        if cfg.softmax_type != "vanilla" or cfg.is_window_layer(layer_number):  # gpt-oss
            self.core_attention = SinkWindowAttention(
                cfg.attention_dropout, a, cfg.softmax_type,
                cfg.window[0] if cfg.is_window_layer(layer_number) else None,
                scale=cfg.attention_softmax_scale)
        else:
            self.core_attention = DotProductAttention(
                cfg.attention_dropout, scale=cfg.attention_softmax_scale,
                chunk=cfg.attention_chunk_size if cfg.is_chunked_layer(layer_number) else None)
        self.linear_proj = nn.Linear(a * d, h, bias=bias)

    def _widths(self, width: int) -> list[int]:
        """This rank's widths of the fused blocks (TP splits each block alike)."""
        return [round(width * share) for share in self.shares]

    def cache_shapes(self, batch: int, max_len: int) -> tuple[tuple, tuple]:
        """Shapes of this rank's key and value caches of ``batch`` sequences:
        ``[b, g/t, max_len, d]`` each (g/t read from the fused QKV width)."""
        w, d = self.linear_qkv.weight, self.head_dim
        shape = (batch, self._widths(w.shape[0])[-1] // d, max_len, d)
        return shape, shape

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None,
                positions: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        d = self.head_dim
        qkv = self.linear_qkv(x)  # [s, b, (a (+ a) + 2g) d]
        s, b, width = qkv.shape
        parts = qkv.split(self._widths(width), dim=-1)
        (q, gate, k, v) = parts if self.gated else (parts[0], None, *parts[1:])
        q, k, v = q.view(s, b, -1, d), k.view(s, b, -1, d), v.view(s, b, -1, d)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rope is not None and self.rotates:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.temperature is not None:  # [s] scales of the queries' positions
            pos = positions.positions if isinstance(positions, Documents) else positions
            if pos is None:
                pos = torch.arange(s, device=q.device)
            scales = temperature_scales(pos, *self.temperature)[:, None, None, None]
            q = (q.float() * scales).to(q.dtype)
        q, k, v = (y.permute(1, 2, 0, 3) for y in (q, k, v))  # [b, heads, s, d]
        if cache is not None:
            k, v = cache.update(self.layer_number, k, v)
        out = self.core_attention(q, k, v, positions)
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)
        if gate is not None:  # Megatron's _apply_output_gate: the sigmoid in fp32
            out = (out * torch.sigmoid(gate.float())).to(out.dtype)
        return self.linear_proj(out)
