"""Gated DeltaNet, the linear-attention layer of Qwen3-Next (Yang, Kautz, Hatamizadeh 2024,
"Gated Delta Networks: Improving Mamba2 with Delta Rule"; Megatron-Core's ``GatedDeltaNet``,
``--experimental-attention-variant gdn`` with ``--linear-attention-freq``), as plain math.

Sizes: ``nk`` key heads of ``dk`` (``--linear-num-key-heads``, ``--linear-key-head-dim``),
``nv`` value heads of ``dv`` (a multiple of nk: key head j serves value heads
``j r .. j r + r - 1``, r = nv / nk), ``K`` the convolution width. ``x [s, b, h]``:

1. ``in_proj``: ``[Q (nk dk); K (nk dk); V (nv dv); Z (nv dv); beta (nv); alpha (nv)]``
   (Megatron's ``in_proj`` sections in the same order, without its fused input norm, which is
   the layer's ``input_layernorm`` here);
2. a causal depthwise convolution of width K over the channels of ``[Q; K; V]`` (left-padded
   with K - 1 zeros), then SiLU;
3. queries and keys L2-normalized per head (``x / sqrt(sum x^2 + 1e-6)``), queries scaled by
   ``1 / sqrt(dk)``, each repeated over its r value heads;
4. per value head, log-decay ``g_t = -exp(A_log) softplus(alpha_t + dt_bias)`` and write
   strength ``beta_t = sigmoid(beta_t)`` (fp32);
5. the gated delta rule on a state ``S [dk, dv]`` from zero:
   ``S <- exp(g_t) S``, ``S <- S + beta_t k_t (v_t - S^T k_t)^T``, ``o_t = S^T q_t``
   (:func:`gated_delta_rule`, in chunks of 64 tokens as Megatron's kernels);
6. ``o`` normalized per head (``out_norm`` over dv: ``--normalization``, weight shared by the
   heads) times ``silu(Z)`` (fp32, cast back), then ``out_proj`` (``nv dv -> h``).

Under tensor parallelism every block of ``in_proj``, the convolution channels, ``A_log`` and
``dt_bias`` split by heads (nk/t key heads with their nv/t value heads), ``out_proj`` is
row-parallel: the layer costs the collectives of an attention layer. Local sizes are read from
the parameters, so the same code runs sharded.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ModelConfig
from loom.errors import ConfigError


def gdn_blocks(cfg: ModelConfig) -> tuple[int, ...]:
    """Widths of ``in_proj``'s fused blocks ``(Q, K, V, Z, beta, alpha)`` (each split over TP
    alike)."""
    qk = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    v = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    nv = cfg.linear_num_value_heads
    return (qk, qk, v, v, nv, nv)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum x^2 + eps)`` over the last dimension (FLA's ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """The gated delta rule, computed in float64: ``q, k [b, s, H, dk]`` (q already scaled), ``v [b, s, H,
    dv]``, ``g`` (log-decay) and ``beta [b, s, H]`` -> ``o [b, s, H, dv]`` in v's dtype. The
    state ``S [dk, dv]`` starts at zero; per token ``S <- exp(g) S``,
    ``S <- S + beta k (v - S^T k)^T``, ``o = S^T q``.

    Computed a chunk of C tokens at a time (C = ``chunk_size``; Yang et al. 2024, sec. 3.3):
    with ``G`` the cumulative log-decay inside the chunk, ``D_tj = exp(G_t - G_j)`` (j <= t)
    and ``S0`` the state entering it, the writes ``u_j = beta_j (v_j - S_{j}'^T k_j)`` solve
    the unit lower-triangular system ``(I + A) U = beta V - beta exp(G) K S0`` with
    ``A_tj = beta_t D_tj k_t.k_j`` (j < t); then ``O = exp(G) Q S0 + (D * Q K^T) U`` and the
    state leaving is ``exp(G_C) S0 + (exp(G_C - G) K)^T U``: the token-by-token recurrence
    exactly, with C times fewer sequential steps."""
    dtype = v.dtype
    q, k, v, g, beta = (t.double().transpose(1, 2) for t in (q, k, v, g, beta))  # [b, H, s, .]
    b, heads, s, dk = k.shape
    c = min(chunk_size, s)
    pad = -s % c
    if pad:  # zero tokens at the end: nothing written, outputs dropped
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (s + pad) // c
    q, k, v = (t.reshape(b, heads, n, c, -1) for t in (q, k, v))
    cum = g.reshape(b, heads, n, c).cumsum(-1)  # G
    beta = beta.reshape(b, heads, n, c, 1)
    ones = torch.ones(c, c, dtype=torch.bool, device=k.device)
    diff = cum[..., :, None] - cum[..., None, :]  # G_t - G_j
    decay = diff.masked_fill(~ones.tril(), float("-inf")).exp()  # D, zero above the diagonal
    a = (beta * (k @ k.transpose(-1, -2)) * decay).masked_fill(~ones.tril(-1), 0.0)
    eye = torch.eye(c, dtype=k.dtype, device=k.device)
    w = torch.linalg.solve_triangular(eye + a, beta * v, upper=False, unitriangular=True)
    kw = torch.linalg.solve_triangular(eye + a, beta * cum.exp()[..., None] * k, upper=False,
                                       unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    leave = (cum[..., -1:] - cum).exp()[..., None] * k  # exp(G_C - G_j) k_j
    state = k.new_zeros(b, heads, dk, v.shape[-1])
    out = []
    for i in range(n):
        u = w[:, :, i] - kw[:, :, i] @ state
        out.append(cum[:, :, i, :, None].exp() * (q[:, :, i] @ state) + qk[:, :, i] @ u)
        state = cum[:, :, i, -1, None, None].exp() * state + leave[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(out, dim=2).reshape(b, heads, n * c, -1)[:, :, :s]
    return o.transpose(1, 2).to(dtype)


class GatedDeltaNet(nn.Module):
    """``x [s, b, h] -> [s, b, h]``: one Gated DeltaNet layer (see the module); the same call
    as :class:`~loom.models.attention.SelfAttention` (RoPE and positions unused)."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        self.key_head_dim, self.value_head_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.heads_per_key = cfg.linear_num_value_heads // cfg.linear_num_key_heads
        blocks = gdn_blocks(cfg)
        self.shares = tuple(n / sum(blocks) for n in blocks)
        h, conv = cfg.hidden_size, sum(blocks[:3])
        self.in_proj = nn.Linear(h, sum(blocks), bias=False)  # Megatron: no bias
        self.conv1d = nn.Conv1d(conv, conv, cfg.linear_conv_kernel_dim, groups=conv, bias=False)
        self.A_log = nn.Parameter(torch.empty(cfg.linear_num_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(cfg.linear_num_value_heads))
        norm = nn.RMSNorm if cfg.normalization == "RMSNorm" else nn.LayerNorm
        self.out_norm = norm(self.value_head_dim, eps=cfg.norm_epsilon)
        self.out_proj = nn.Linear(blocks[2], h, bias=False)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None,
                positions: Optional[torch.Tensor] = None, cache=None) -> torch.Tensor:
        if cache is not None:
            raise ConfigError("generation with Gated DeltaNet layers: loom keeps no recurrent "
                              "state for them yet")
        dk, dv = self.key_head_dim, self.value_head_dim
        proj = self.in_proj(x).transpose(0, 1)  # [b, s, W]
        b, s, width = proj.shape
        q, k, v, z, beta, alpha = proj.split([round(width * r) for r in self.shares], dim=-1)
        w = self.conv1d.weight  # [C, 1, K], this rank's channels
        qkv = torch.cat([q, k, v], dim=-1).transpose(1, 2)  # [b, C, s]
        qkv = F.silu(F.conv1d(qkv, w, padding=w.shape[-1] - 1, groups=w.shape[0])[..., :s])
        q, k, v = qkv.transpose(1, 2).split([q.shape[-1], k.shape[-1], v.shape[-1]], dim=-1)
        q, k = (l2_normalize(y.reshape(b, s, -1, dk)).repeat_interleave(self.heads_per_key, 2)
                for y in (q, k))
        v = v.reshape(b, s, -1, dv)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())
        o = gated_delta_rule(q * dk ** -0.5, k, v, g, beta.float().sigmoid())
        gate = F.silu(z.reshape(b, s, -1, dv).float())
        o = (self.out_norm(o) * gate).to(x.dtype)
        return self.out_proj(o.reshape(b, s, -1).transpose(0, 1))
