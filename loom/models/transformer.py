"""Pre-LN decoder layer: attention (MHA or GQA, optional RoPE) and MLP (GeLU or SwiGLU).

Activations are ``[s, b, h]`` (Megatron-LM's layout). Heads and query groups are split over the
TP group: QKV is one :class:`ColumnParallelLinear` holding this rank's ``a/t`` query heads and
``g/t`` key/value groups, the output projection a :class:`RowParallelLinear`; the MLP is
column-then-row parallel. So each layer runs exactly 2 TP all-reduces forward (``g`` in the two
row-parallel layers) and 2 backward (``f`` in the two column-parallel layers) (SHO sec. 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from loom.config import ModelConfig
from loom.parallel.context import causal_mask, gather_sequence
from loom.parallel.mesh import ParallelMesh
from loom.parallel.random import RNGTracker
from loom.parallel.sequence import mark_sequence_parallel
from loom.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, normal_init,
                                  scaled_normal_init)


def build_norm(cfg: ModelConfig, device) -> nn.Module:
    """LayerNorm or RMSNorm over the hidden dimension (``--normalization``)."""
    if cfg.normalization == "RMSNorm":
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon, device=device)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_epsilon, device=device)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[s, d]`` of rotary embeddings (Su et al. 2021), halves layout (``rotate_half``)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=positions.device) / head_dim))
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [s, b, heads, d]`` by position; ``cos``/``sin`` are ``[s, d]``."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, None, None, :].to(x.dtype), sin[:, None, None, :].to(x.dtype)
    return x * cos + rotated * sin


@dataclass
class KVCache:
    """Keys and values of past positions, per layer: ``[b, g/t, s_max, d]`` each."""

    keys: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)
    length: int = 0  # positions already cached


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh, tracker: RNGTracker, layer_number: int,
                 sequence_parallel: bool = False):
        super().__init__()
        t = mesh.tp_size
        a, g, d, h = cfg.num_attention_heads, cfg.num_kv_groups, cfg.head_dim, cfg.hidden_size
        self.cfg, self.tracker, self.layer_number = cfg, tracker, layer_number
        self.heads, self.groups, self.head_dim = a // t, g // t, d
        self.tp_size = t
        self.cp_group = mesh.groups["cp"]
        bias = not cfg.disable_bias_linear
        self.linear_qkv = ColumnParallelLinear(h, (a + 2 * g) * d, mesh, bias=bias,
                                               segments=(a * d, g * d, g * d),
                                               init_fn=normal_init(cfg.init_method_std),
                                               sequence_parallel=sequence_parallel)
        self.linear_proj = RowParallelLinear(a * d, h, mesh, bias=bias,
                                             init_fn=scaled_normal_init(cfg.init_method_std,
                                                                        cfg.num_layers),
                                             sequence_parallel=sequence_parallel)
        self.recompute_core = False  # selective recompute of the attention core (KOR sec. 5)

    def _core(self, q, k, v, causal: bool, mask: Optional[torch.Tensor] = None):
        p = self.cfg.attention_dropout if self.training else 0.0
        kw = dict(dropout_p=p, is_causal=causal and mask is None, attn_mask=mask,
                  enable_gqa=self.heads != self.groups)
        if p > 0 and self.tp_size > 1:  # partitioned heads: per-TP-rank dropout masks
            with self.tracker.fork():
                return F.scaled_dot_product_attention(q, k, v, **kw)
        return F.scaled_dot_product_attention(q, k, v, **kw)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None,
                cache: Optional[KVCache] = None,
                q_positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [s, b, h]`` -> ``[s, b, h]`` (replicated over TP; ``[s/t, b, h]`` in and out with
        sequence parallelism).

        With context parallelism ``s`` is this rank's ``s/c`` tokens at global ``q_positions``;
        keys and values are gathered over the CP group (:mod:`loom.parallel.context`).
        """
        d = self.head_dim
        qkv = self.linear_qkv(x)  # [s, b, (a + 2g) d / t]: the full sequence even under SP
        s, b = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.split([self.heads * d, self.groups * d, self.groups * d], dim=-1)
        q = q.view(s, b, self.heads, d)
        k = k.view(s, b, self.groups, d)
        v = v.view(s, b, self.groups, d)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (y.permute(1, 2, 0, 3) for y in (q, k, v))  # [b, heads, s, d]
        causal, mask = True, None
        if self.cp_group is not None and q_positions is not None:
            k, v = gather_sequence(k, self.cp_group, 2), gather_sequence(v, self.cp_group, 2)
            mask = causal_mask(q_positions, k.shape[2])
        if cache is not None:
            n = self.layer_number
            start = cache.length
            if n not in cache.keys:
                raise RuntimeError("KV cache not allocated for this layer")
            cache.keys[n][:, :, start:start + s] = k
            cache.values[n][:, :, start:start + s] = v
            k, v = cache.keys[n][:, :, :start + s], cache.values[n][:, :, :start + s]
            if start > 0:
                if s != 1:
                    raise ValueError("after the prompt, decode one token at a time")
                causal = False  # one new query attends to every cached position
        if self.recompute_core and self.training:
            out = checkpoint(self._core, q, k, v, causal, mask, use_reentrant=False)
        else:
            out = self._core(q, k, v, causal, mask)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.heads * d)
        return self.linear_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh, sequence_parallel: bool = False):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_size
        bias = not cfg.disable_bias_linear
        self.swiglu = cfg.swiglu
        self.gelu_approx = "tanh" if cfg.openai_gelu else "none"
        self.linear_fc1 = ColumnParallelLinear(h, 2 * f if cfg.swiglu else f, mesh, bias=bias,
                                               segments=(f, f) if cfg.swiglu else None,
                                               init_fn=normal_init(cfg.init_method_std),
                                               sequence_parallel=sequence_parallel)
        self.linear_fc2 = RowParallelLinear(f, h, mesh, bias=bias,
                                            init_fn=scaled_normal_init(cfg.init_method_std,
                                                                       cfg.num_layers),
                                            sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [s, b, h]`` -> ``[s, b, h]``; ``[s, b, f/t]`` in between."""
        y = self.linear_fc1(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate=self.gelu_approx)
        return self.linear_fc2(y)


class TransformerLayer(nn.Module):
    """``x + drop(attn(norm1(x)))``, then ``x + drop(mlp(norm2(x)))`` (pre-LN).

    ``x`` is ``[s, b, h]``, or ``[s/t, b, h]`` with ``sequence_parallel`` (norms, dropout and
    residuals then run on this rank's tokens only; KOR sec. 4.2.2).
    """

    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh, tracker: RNGTracker, layer_number: int,
                 sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel and mesh.tp_size > 1
        self.tracker = tracker
        self.input_norm = build_norm(cfg, mesh.device)
        self.self_attention = SelfAttention(cfg, mesh, tracker, layer_number, sequence_parallel)
        self.pre_mlp_norm = build_norm(cfg, mesh.device)
        self.mlp = MLP(cfg, mesh, sequence_parallel)
        self.hidden_dropout = cfg.hidden_dropout
        if self.sequence_parallel:
            mark_sequence_parallel(self.input_norm)
            mark_sequence_parallel(self.pre_mlp_norm)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        p = self.hidden_dropout if self.training else 0.0
        if p == 0.0:
            return x
        if self.sequence_parallel:  # partitioned tokens: per-TP-rank masks
            with self.tracker.fork():
                return F.dropout(x, p, True)
        return F.dropout(x, p, True)  # replicated: the default RNG, same on all TP ranks

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None,
                cache: Optional[KVCache] = None, q_positions: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        x = x + self._dropout(self.self_attention(self.input_norm(x), rope, cache, q_positions))
        return x + self._dropout(self.mlp(self.pre_mlp_norm(x)))


class CheckpointedLayer(nn.Module):
    """Full activation recompute of one layer (``--recompute-granularity full``): only the layer
    input ``[s, b, h]`` is kept; the TP-rank RNG state is replayed so dropout masks match."""

    def __init__(self, layer: TransformerLayer, tracker: RNGTracker):
        super().__init__()
        self.layer = layer
        self.tracker = tracker

    def forward(self, x, rope=None, cache=None, q_positions=None):
        if not self.training or cache is not None:
            return self.layer(x, rope, cache, q_positions)
        saved = None if self.tracker.state is None else self.tracker.state.clone()
        calls = [0]

        def run(inp):
            calls[0] += 1
            if calls[0] == 1 or saved is None:
                return self.layer(inp, rope, None, q_positions)
            current = self.tracker.state
            self.tracker.state = saved.clone()
            try:
                return self.layer(inp, rope, None, q_positions)
            finally:
                self.tracker.state = current
        return checkpoint(run, x, use_reentrant=False)
