"""Mamba-2 and hybrid Mamba / attention / MLP language models as plain math (Dao & Gu 2024,
"Transformers are SSMs", sec. 7 "the Mamba-2 architecture", fig. 6; Megatron-LM's MambaModel).

Layer i is chosen by character i of ``--hybrid-override-pattern`` (Megatron's string): ``M`` a
Mamba-2 layer ``x + drop(mixer(norm(x)))``, ``*`` an attention layer
``x + drop(attn(norm(x)))``, ``-`` an MLP layer ``x + drop(mlp(norm(x)))`` (attention and MLP
are the shared blocks of :mod:`loom.models.attention` and :mod:`loom.models.mlp`, as in the GPT
family). A pure Mamba model is all ``M`` (the default). Embedding, final norm, output layer, loss
and the forward step are the shared ones (:mod:`loom.models.chunk`,
:mod:`loom.models.language_model`); activations are ``[s, b, h]``.

The Mamba-2 mixer (fig. 6, right), ``d_inner = H P`` wide (``--mamba-num-heads H``, else
``--mamba-expand x h``: Nemotron-H's heads x head dim need not be a multiple of h): one
in-projection to ``z [d_inner]``, ``x [d_inner]``,
``B, C [G N]``, ``dt [H]``; causal depthwise conv1d + SiLU over ``(x, B, C)``;
``dt = softplus(dt + dt_bias)``, ``A = -exp(A_log)``; the SSD scan (:mod:`.ssd`) plus ``D x``;
gated RMSNorm ``rmsnorm(y * silu(z))`` normalized per group of ``d_inner / G`` channels
(Mamba-2's ``ngroups`` norm); out-projection. ``H = d_inner / P`` heads of ``P`` channels.

Nothing here knows about parallelism. Sizes that tensor parallelism changes (local heads,
groups, conv channels) are read from the parameters, and the gated norm's group size does not
change with t, so the same code runs on each rank's heads and groups
(:mod:`loom.models.mamba.parallelize`). The conv + scan part is a parameterless core
(:class:`MambaScan`, the parameters passed in) that the plan wraps for context parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ModelConfig
from loom.models.attention import KVCache, SelfAttention
from loom.models.chunk import Embedding, LanguageModelChunk, build_norm
from loom.models.family import StageSpec
from loom.models.mlp import MLP
from loom.models.mamba.config import layer_kinds as layer_pattern
from loom.models.mamba.ssd import ssd_chunked, ssd_step


def mamba_sizes(cfg: ModelConfig) -> dict:
    """Full (unsharded) sizes: ``d_inner`` (``--mamba-num-heads x P``, else ``expand h``:
    ``ModelConfig.mamba_d_inner``), heads ``H = d_inner / P``, groups ``G``, state ``N``, conv
    channels ``d_inner + 2 G N``, fused in-projection segments
    ``(z, x, B, C, dt) = (d_inner, d_inner, G N, G N, H)``."""
    d_inner = cfg.mamba_d_inner
    H, G, N = d_inner // cfg.mamba_head_dim, cfg.mamba_num_groups, cfg.mamba_state_dim
    return dict(d_inner=d_inner, heads=H, groups=G, state=N, conv_dim=d_inner + 2 * G * N,
                in_segments=(d_inner, d_inner, G * N, G * N, H),
                conv_segments=(d_inner, G * N, G * N))


@dataclass
class HybridCache(KVCache):
    """Generation state: the attention layers' keys/values (:class:`KVCache`) and, per Mamba
    layer, the conv state (the last ``k`` conv inputs ``[b, conv_dim/t, k]``) and the SSM state
    ``[b, H/t, P, N]`` (fp32), so a decoded token costs O(1) in the sequence length."""

    conv: dict = field(default_factory=dict)
    ssm: dict = field(default_factory=dict)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """:class:`CausalConv1d`'s math with the parameters passed in: ``x [b, s, c]``,
    ``weight [c, k]``, ``bias [c]`` -> ``[b, s, c]``."""
    c, k = weight.shape
    y = F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), weight[:, None, :], bias, groups=c)
    return y.transpose(1, 2)


class CausalConv1d(nn.Module):
    """Depthwise causal convolution over time: ``x [b, s, c] -> [b, s, c]``,
    ``out[t] = bias + sum_j weight[:, j] x[t - k + 1 + j]`` (zeros before position 0);
    ``weight [c, k]``, ``bias [c]``; c is read from the weight (split over TP by channel)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel))
        self.bias = nn.Parameter(torch.empty(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return causal_conv1d(x, self.weight, self.bias)

    def step(self, state: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One position: ``state [b, c, k]`` (last k inputs), ``x [b, c]`` -> (out, state)."""
        state = torch.cat([state[..., 1:], x[..., None]], dim=-1)
        return (state * self.weight).sum(-1) + self.bias, state


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm_g(y * silu(z))`` with the RMS taken over each group of ``group_size``
    consecutive channels (Mamba-2's norm with ``ngroups``, Dao & Gu 2024 sec. 7.2, as in
    ``mamba_ssm``'s ``RMSNormGated(group_size=d_inner/G, norm_before_gate=False)``).
    ``y, z [..., c]``, ``weight [c]``. Because a group never straddles two TP ranks when G is
    divisible by t, the norm of each rank's shard equals the unsharded norm exactly."""

    def __init__(self, channels: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        y = y.float() * F.silu(z.float())
        g = y.view(*y.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(y.shape).to(dtype)


class MambaScan(nn.Module):
    """The sequence part of the mixer, parameterless (the mixer's parameters passed in, so the
    plan can wrap it to run over context parallelism without moving them,
    :mod:`loom.parallel.context.mamba`): causal conv + SiLU over ``(x, B, C)``,
    ``dt = softplus(dt + dt_bias)``, ``A = -exp(A_log)``, the SSD scan and ``D x``.

    ``xbc [b, s, H P + 2 G N]`` and ``dt [b, s, H]`` (in-projection outputs), ``conv_weight
    [H P + 2 G N, k]``, ``conv_bias``, ``dt_bias``, ``A_log``, ``D [H]`` (H, G: the heads and
    groups given, read from the shapes) -> ``(y [b, s, H P], final state [b, H, P, N] or None
    unless need_state)``."""

    def __init__(self, head_dim: int, state_dim: int, chunk_size: int):
        super().__init__()
        self.head_dim, self.state_dim, self.chunk_size = head_dim, state_dim, chunk_size

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, state_dim={self.state_dim}, chunk={self.chunk_size}"

    def forward(self, xbc, dt, conv_weight, conv_bias, dt_bias, A_log, D, need_state=False):
        H, P = A_log.shape[0], self.head_dim
        d_inner = H * P
        gn = (xbc.shape[-1] - d_inner) // 2
        b, s, _ = xbc.shape
        dt = F.softplus(dt.float() + dt_bias.float())  # [b, s, H]
        A = -torch.exp(A_log.float())
        x, B, C = F.silu(causal_conv1d(xbc, conv_weight, conv_bias)).split([d_inner, gn, gn],
                                                                              dim=-1)
        x = x.reshape(b, s, H, P)
        B, C = B.reshape(b, s, -1, self.state_dim), C.reshape(b, s, -1, self.state_dim)
        xf = x.float()  # one fp32 copy for the scan and D x: two kept 4 s b H P bytes for backward
        y, final = ssd_chunked(xf, dt, A, B.float(), C.float(), self.chunk_size)
        y = (y + D.float()[:, None] * xf).to(x.dtype).reshape(b, s, d_inner)
        return y, final if need_state else None


class MambaMixer(nn.Module):
    """The Mamba-2 block (module docstring): ``x [s, b, h] -> [s, b, h]``. With a
    :class:`HybridCache`, the prompt fills the layer's conv and SSM state and a single token
    (s = 1) advances them by one step instead of rescanning."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        z = mamba_sizes(cfg)
        self.layer_number = layer_number
        self.head_dim, self.state_dim = cfg.mamba_head_dim, z["state"]
        bias = not cfg.disable_bias_linear
        self.in_proj = nn.Linear(cfg.hidden_size, sum(z["in_segments"]), bias=bias)
        self.conv1d = CausalConv1d(z["conv_dim"], cfg.mamba_d_conv)
        self.dt_bias = nn.Parameter(torch.empty(z["heads"]))
        self.A_log = nn.Parameter(torch.empty(z["heads"]))
        self.D = nn.Parameter(torch.empty(z["heads"]))
        self.norm = GatedRMSNorm(z["d_inner"], z["d_inner"] // z["groups"], cfg.norm_epsilon)
        self.scan = MambaScan(cfg.mamba_head_dim, z["state"], cfg.mamba_chunk_size)
        self.out_proj = nn.Linear(z["d_inner"], cfg.hidden_size, bias=bias)

    def forward(self, hidden: torch.Tensor, cache: Optional[HybridCache] = None) -> torch.Tensor:
        H, P = self.A_log.shape[0], self.head_dim  # local heads under TP
        d_inner, conv_dim = H * P, self.conv1d.weight.shape[0]
        zxbcdt = self.in_proj(hidden).transpose(0, 1)  # [b, s, W]
        b, s, _ = zxbcdt.shape
        z, xbc, dt = zxbcdt.split([d_inner, conv_dim, H], dim=-1)
        if cache is not None and cache.length > 0:
            if s != 1:
                raise ValueError("after the prompt, decode one token at a time")
            y = self._step(cache, xbc[:, 0], dt[:, 0])[:, None]
        else:
            if cache is not None:
                k = self.conv1d.weight.shape[1]
                last = F.pad(xbc.transpose(1, 2), (max(k - s, 0), 0))[..., -k:]
                cache.conv[self.layer_number] = last  # [b, conv_dim, k]: the last k inputs
            y, final = self.scan(xbc, dt, self.conv1d.weight, self.conv1d.bias, self.dt_bias,
                                 self.A_log, self.D, need_state=cache is not None)
            if cache is not None:
                cache.ssm[self.layer_number] = final
        return self.out_proj(self.norm(y, z).transpose(0, 1))

    def _step(self, cache: HybridCache, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """One decoded position: ``xbc [b, conv_dim]``, ``dt [b, H]`` (before softplus) ->
        ``y [b, d_inner]`` (``D x`` included), the layer's conv and SSM state advanced."""
        H, P = self.A_log.shape[0], self.head_dim
        d_inner = H * P
        gn = (xbc.shape[-1] - d_inner) // 2
        conv_out, cache.conv[self.layer_number] = self.conv1d.step(
            cache.conv[self.layer_number], xbc)
        x, B, C = F.silu(conv_out).split([d_inner, gn, gn], dim=-1)
        b = x.shape[0]
        x = x.reshape(b, H, P)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        A = -torch.exp(self.A_log.float())
        y, cache.ssm[self.layer_number] = ssd_step(
            cache.ssm[self.layer_number], x.float(), dt, A,
            B.reshape(b, -1, self.state_dim).float(), C.reshape(b, -1, self.state_dim).float())
        return (y + self.D.float()[:, None] * x.float()).to(x.dtype).reshape(b, d_inner)


class MambaLayer(nn.Module):
    """``x + drop(mixer(norm(x)))`` (Megatron's MambaLayer; the norm is named ``input_layernorm`` as
    in the attention layer, so the shared plan's sequence-parallel entry covers it)."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        self.input_layernorm = build_norm(cfg)
        self.mixer = MambaMixer(cfg, layer_number)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x, rope=None, positions=None, cache=None, moe=None):
        return x + self.hidden_dropout(self.mixer(self.input_layernorm(x), cache))


class AttentionLayer(nn.Module):
    """``x + drop(attn(norm(x)))``: the shared self-attention (``*`` in the pattern)."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        self.input_layernorm = build_norm(cfg)
        self.self_attention = SelfAttention(cfg, layer_number)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x, rope=None, positions=None, cache=None, moe=None):
        return x + self.hidden_dropout(self.self_attention(self.input_layernorm(x), rope, positions,
                                                           cache))


class MLPLayer(nn.Module):
    """``x + drop(mlp(norm(x)))``: the shared MLP (``-`` in the pattern)."""

    def __init__(self, cfg: ModelConfig, layer_number: int):
        super().__init__()
        self.pre_mlp_layernorm = build_norm(cfg)
        self.mlp = MLP(cfg)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x, rope=None, positions=None, cache=None, moe=None):
        return x + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(x)))


LAYER_TYPES = {"M": MambaLayer, "*": AttentionLayer, "-": MLPLayer}


class MambaModel(LanguageModelChunk):
    """A hybrid stack (or one pipeline chunk of it): the shared chunk skeleton
    (:class:`~loom.models.chunk.LanguageModelChunk`) with the shared embedding, output layer,
    loss and forward inputs (``moe``), and layer i of type ``layer_pattern(cfg)[i]``. Positions:
    learned absolute embeddings or RoPE in the attention layers, as
    ``--position-embedding-type`` says (Mamba layers need none)."""

    extra_inputs = ("moe",)

    def __init__(self, cfg: ModelConfig, stage: StageSpec):
        self.pattern = layer_pattern(cfg)  # a plain str: settable before nn.Module.__init__
        super().__init__(cfg, stage)

    def build_embedding(self, cfg: ModelConfig, padded_vocab: int) -> nn.Module:
        return Embedding(cfg, padded_vocab, with_positions=self.pre_process)

    def build_layer(self, cfg: ModelConfig, layer_number: int) -> nn.Module:
        return LAYER_TYPES[self.pattern[layer_number]](cfg, layer_number)

    def allocate_cache(self, batch: int, max_len: int, dtype=None) -> HybridCache:
        """An empty cache: KV buffers for the attention layers; the Mamba layers' states are
        set by the prompt's forward pass."""
        cache = HybridCache()
        for name, layer in self.layers.items():
            if isinstance(layer, AttentionLayer):
                attn = layer.self_attention
                cache.allocate(int(name), attn.cache_shapes(batch, max_len),
                               attn.linear_qkv.weight, dtype)
        return cache
