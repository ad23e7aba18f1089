"""Mamba-2 and hybrid Mamba / attention / MLP terms of the planner: parameters, FLOPs,
activations and TP communication per layer kind, and the kinds each pipeline stage holds.

The planner prices layers by kind, as the model's family declares them
(``ModelFamily.layer_kinds``, looked up by ``--model-type``: :func:`declared_kinds`): None for a
stack of transformer layers (attention or MLA + MLP or MoE: :mod:`loom.planner.memory`,
:mod:`loom.planner.moe`, :mod:`loom.planner.mla`), else one character per layer of three kinds
(the Mamba family: ``--hybrid-override-pattern``, all ``M`` by default): ``M`` a Mamba-2 layer
``x + mixer(norm(x))``, ``*`` an attention layer ``x + attn(norm(x))``, ``-`` an MLP layer
``x + mlp(norm(x))``. No planner code names a family. The attention and MLP kinds are the two halves of the
planner's transformer layer (:func:`loom.planner.memory.layer_params`,
:func:`loom.planner.memory.activation_bytes_per_layer`, :mod:`loom.planner.timing`): each holds
its own norm, half of the replicated activations and one TP all-reduce forward and one backward;
an attention layer plus an MLP layer equal one transformer layer term by term
(``tests/planner/test_planner_mamba.py``).

Symbols of the Mamba-2 layer (Dao & Gu 2024, "Transformers are SSMs", sec. 6-7): ``h`` hidden,
``d_i`` inner width (``H P`` with ``--mamba-num-heads H``, else ``expand h``), ``P`` head dim,
``H = d_i / P`` heads, ``G`` groups of B/C,
``N`` state size, ``k`` conv kernel, ``Q`` chunk length, ``S = s b`` tokens per micro-batch,
``t`` TP. Per layer:

* parameters: in-projection ``h (2 d_i + 2 G N + H)`` (z, x, B, C, dt), depthwise conv
  ``(d_i + 2 G N) (k + 1)`` (weight + bias), ``A_log, D, dt_bias`` ``3 H``, gated-norm weight
  ``d_i``, out-projection ``d_i h``: all split over t (Megatron / ``parallelize.py``); the
  layer's input norm ``h`` (RMSNorm, ``2h`` LayerNorm) replicated; linear biases if the model
  has them (in-projection's split, out-projection's ``h`` replicated).
* forward FLOPs per token (multiply-add = 2): projections ``2 h (2 d_i + 2 G N + H) + 2 d_i h``
  (2 x their weights, as any GEMM); conv ``2 k (d_i + 2 G N)``; the chunked SSD scan of sec. 6
  (Listing 1), per head: the intra-chunk quadratic form ``C B^T`` (``2 Q N``) and its product
  with X (``2 Q P``), the chunk-end states ``B^T X`` (``2 N P``), the outputs from the entering
  states ``C h`` (``2 N P``) and the state recurrence over chunks (``2 N P / Q``):
  ``H (2 Q (N + P) + 4 N P + 2 N P / Q)``. The ``Q x Q`` block is counted whole (no causal
  discount), as attention scores are. Megatron-LM's hybrid FLOP count
  (``num_floating_point_operations``) uses ``7 d_i N`` for the scan (Mamba-1's selective scan)
  and omits the conv; for mamba2-1.3b (Q 256) the SSD count is 8.4M vs 3.7M per token and
  layer, 14% vs 7% of the layer. Backward = 2 x forward.
* activations per token (bytes, 16-bit, fp32 where the kernels keep fp32), what the fused
  ``mamba_ssm`` / ``causal_conv1d`` path saves (``fused``; Megatron's Mamba layers): replicated
  unless SP: norm input ``2 h``, in-projection input ``2 h``, dropout mask ``h`` (with
  ``hidden_dropout > 0``); split over t: in-projection output ``2 (2 d_i + 2 G N + H)`` (conv
  input, z, dt), conv output (scan inputs x, B, C) ``2 (d_i + 2 G N)``, fp32 ``dt`` ``4 H``,
  fp32 chunk states ``4 H P N / Q``, scan output ``2 d_i``, gated-norm output (out-projection
  input) ``2 d_i``, fp32 norm statistics ``4 G``. Without fused kernels (``fused=False``, loom's
  plain-PyTorch ``ssd.py``) autograd also keeps fp32 copies of x, B, C ``4 (d_i + 2 G N)`` and
  three fp32 ``[Q, Q]`` per-head chunk intermediates (``exp(segsum)``, ``C B^T``, their
  product, ``docs/mamba.md``) ``12 Q H``: a sketch; what loom's scan saves, measured term by
  term, is :func:`loom.planner.layer_bytes.mamba_layer_terms` (``--layer-memory loom``; 2.0x
  this ``fused=False`` count for mamba2-1.3b). Full recompute keeps the layer input ``2 h``
  (``/t`` with SP); selective recompute drops nothing from a Mamba layer.
* TP: one all-reduce of ``[s, b, h]`` forward (out-projection) and one backward
  (in-projection), exactly as an MLP (``docs/mamba.md``); with SP an all-gather + a
  reduce-scatter of the same volume. CP: refused for Mamba layers, as ``loom train`` refuses it.

Timing of a Mamba layer: the projections at the GEMM efficiency of width ``h/t`` and ``S``
tokens; the scan's batched ``Q x Q`` matmuls at that of width ``min(N, P)`` and ``Q`` tokens
(like attention's per-head matmuls); elementwise time from the activations it writes.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from loom.config import ConfigError, ModelConfig
from loom.models import FamilyRegistry
from loom.planner.moe import mlp_params, stage_flag_layers
from loom.planner.primitives import (all_reduce_time, attention_efficiency, gemm_efficiency, link,
                                     p2p_time)
from loom.planner.layer_shape import gated_mlp

KINDS = ("M", "*", "-")  # Mamba-2, attention, MLP (Megatron's hybrid pattern characters)


def declared_kinds(model: ModelConfig) -> Optional[str]:
    """The layer kinds ``model``'s family declares (``ModelFamily.layer_kinds`` of the family
    ``--model-type`` names among the built-in ones, ``loom.models.FAMILY_MODULES``): one of
    ``M``, ``*``, ``-`` per layer, or None for transformer layers. A family registered only on
    a registry value (``register_family``) is not among them: priced as transformer layers
    (e.g. the trainer's logged MFU). Reads the family's torch-free config module: pricing
    imports no torch."""
    kinds = FamilyRegistry().layer_kinds(model.model_type)
    return kinds(model) if kinds is not None else None


def is_hybrid(model: ModelConfig) -> bool:
    """Whether the family declares per-layer kinds (Mamba / attention / MLP layers) rather than
    transformer layers (:func:`declared_kinds`)."""
    return declared_kinds(model) is not None


def layer_pattern(model: ModelConfig) -> str:
    """The declared kinds, one character per layer ("" for transformer layers)."""
    return declared_kinds(model) or ""


def kind_counts(model: ModelConfig) -> dict:
    """Layers of each kind ``{"M": n, "*": n, "-": n}`` (count)."""
    pat = layer_pattern(model)
    return {k: pat.count(k) for k in KINDS}


def mamba_dims(model: ModelConfig) -> tuple:
    """``(d_inner, H, G, N, P, k, Q)`` of the Mamba-2 layer (module docstring)."""
    d_i = model.mamba_d_inner
    P = model.mamba_head_dim
    return (d_i, d_i // P, model.mamba_num_groups, model.mamba_state_dim, P,
            model.mamba_d_conv, model.mamba_chunk_size)


def _norm_params(model: ModelConfig) -> int:
    return (2 if model.normalization == "LayerNorm" else 1) * model.hidden_size


def kind_params(model: ModelConfig) -> dict:
    """``{kind: (tp_sharded, replicated)}`` parameters (count) of one layer of each kind."""
    h, a, g, d = (model.hidden_size, model.num_attention_heads, model.num_kv_groups,
                  model.head_dim)
    d_i, H, G, N, _, k, _ = mamba_dims(model)
    bias = not model.disable_bias_linear
    in_w = 2 * d_i + 2 * G * N + H
    m_sh = h * in_w + (d_i + 2 * G * N) * (k + 1) + 3 * H + d_i + d_i * h + (in_w if bias else 0)
    m_rep = _norm_params(model) + (h if bias else 0)
    a_sh = h * (a * d + 2 * g * d) + a * d * h + ((a * d + 2 * g * d) if bias else 0)
    a_rep = _norm_params(model) + (h if bias else 0)
    f_sh, f_rep = mlp_params(model, model.ffn_size)
    return {"M": (m_sh, m_rep), "*": (a_sh, a_rep), "-": (f_sh, f_rep + _norm_params(model))}


def scan_flops_per_token(model: ModelConfig) -> float:
    """Forward FLOPs per token of the chunked SSD scan: ``H (2 Q (N + P) + 4 N P + 2 N P / Q)``
    (Dao & Gu 2024 sec. 6, module docstring)."""
    _, H, _, N, P, _, Q = mamba_dims(model)
    return float(H * (2 * Q * (N + P) + 4 * N * P + 2 * N * P / Q))


def kind_flops_per_token(model: ModelConfig, seq_length: int) -> dict:
    """Forward FLOPs per token of one layer of each kind: ``{kind: (gemm, other)}``, ``gemm`` the
    weight GEMMs, ``other`` the attention scores (``4 s a d``) or the Mamba conv + scan."""
    h, a, g, d, f = (model.hidden_size, model.num_attention_heads, model.num_kv_groups,
                     model.head_dim, model.ffn_size)
    d_i, H, G, N, _, k, _ = mamba_dims(model)
    proj = 2 * h * (2 * d_i + 2 * G * N + H) + 2 * d_i * h
    conv = 2 * k * (d_i + 2 * G * N)
    return {"M": (float(proj), conv + scan_flops_per_token(model)),
            "*": (float(2 * h * (a * d + 2 * g * d) + 2 * a * d * h),
                  float(4 * seq_length * a * d)),
            "-": (float((6 if gated_mlp(model) else 4) * h * f), 0.0)}


def layers_forward_flops_per_token(model: ModelConfig, seq_length: int) -> float:
    """Forward FLOPs per token of all layers of the pattern (the output layer excluded)."""
    per = kind_flops_per_token(model, seq_length)
    return float(sum(n * sum(per[kind]) for kind, n in kind_counts(model).items()))


def kind_activation_bytes(model: ModelConfig, seq_length: int, L: dict, kind: str,
                          fused: bool = True) -> dict:
    """Activation bytes of one layer of ``kind`` for one micro-batch on one GPU, as
    :func:`loom.planner.memory.activation_bytes_per_layer` returns them (``none, selective,
    full, scores``): the attention / MLP halves of the transformer layer's terms, or the Mamba
    layer's (module docstring; ``fused`` = the ``mamba_ssm`` path, also fused attention)."""
    from loom.planner.activations import layer_dims
    s = seq_length
    h, a, g, d, f, t, c, sp, S, drop = layer_dims(model, s, L)
    repl = S * h * (2 + 2 + drop)  # norm input, block input, dropout mask
    scores = 0.0 * t
    if kind == "*":
        split = S * (2 * a * d + 4 * g * d + 2 * a * d)
        if fused:
            scores = 4.0 * a * S / t
        else:
            per_score = 2 + (3 if model.attention_dropout > 0 else 0)
            scores = per_score * a * S * s / t
    elif kind == "-":
        split = S * f * (6 if gated_mlp(model) else 4)
    else:
        d_i, H, G, N, P, _, Q = mamba_dims(model)
        split = S * (2 * (2 * d_i + 2 * G * N + H) + 2 * (d_i + 2 * G * N) + 4 * H
                     + 4 * H * P * N / Q + 2 * d_i + 2 * d_i + 4 * G)
        if not fused:
            split = split + S * (4 * (d_i + 2 * G * N) + 12 * Q * H)
    repl_t = np.where(sp > 0, repl / t, repl)
    none = repl_t + split / t + scores
    selective = repl_t + split / t + (scores if fused else 0.0)
    full = np.where(sp > 0, 2 * S * h / t, 2 * S * h)
    return {"none": none, "selective": selective, "full": full, "scores": scores}


def kind_layer_times(model: ModelConfig, seq_length: int, L: dict, cluster, fused: bool,
                     mem_traffic: float, overlap_tp_comm: bool) -> dict:
    """Per layer kind, micro-batch and GPU, the terms of
    :func:`loom.planner.timing.layer_times` (seconds): ``gemm`` (the Mamba scan and conv
    included, so selective recompute does not repeat them), ``attn`` (attention scores),
    ``elem``, ``scores_elem``, ``tp_fwd``/``tp_bwd`` (ONE all-reduce of ``2 S h`` bytes each way
    per layer of any kind), ``tp_ar``, ``cp_fwd``/``cp_bwd`` (attention only), ``a2a`` (0)."""
    s = seq_length
    h, a, g, d = (model.hidden_size, model.num_attention_heads, model.num_kv_groups,
                  model.head_dim)
    _, _, _, N, P, _, Q = mamba_dims(model)
    t, c, b = L["tp"], L["cp"], L["mbs"]
    S = s * b / c
    peak = cluster.peak_flops
    fl = kind_flops_per_token(model, s)
    tp_bw, tp_alpha = link(t > cluster.gpus_per_node, cluster)
    ar = all_reduce_time(t, 2 * S * h, tp_bw, tp_alpha)
    cp_link, cp_alpha = link(t * c > cluster.gpus_per_node, cluster)
    out = {}
    for kind in KINDS:
        gemm = fl[kind][0] * S / t / (peak * gemm_efficiency(h / t, S, cluster))
        attn = cp_fwd = cp_bwd = 0.0 * t
        if kind == "M":
            gemm = gemm + fl["M"][1] * S / t / (peak * gemm_efficiency(min(N, P), Q, cluster))
        elif kind == "*":
            attn = fl["*"][1] * S / t / (peak * attention_efficiency(d, s / c, fused, cluster))
            ring = (c - 1) * p2p_time(4 * S * g * d / t, cp_link, cp_alpha)
            cp_fwd, cp_bwd = np.maximum(0.0, ring - attn), np.maximum(0.0, 2 * ring - 2 * attn)
        act = kind_activation_bytes(model, s, L, kind, fused)
        out[kind] = {"gemm": gemm, "attn": attn,
                     "elem": mem_traffic * act["none"] / cluster.hbm_bw,
                     "scores_elem": mem_traffic * act["scores"] / cluster.hbm_bw,
                     "tp_fwd": ar, "tp_ar": ar,
                     "tp_bwd": np.maximum(0.0, ar - gemm) if overlap_tp_comm else ar,
                     "cp_fwd": cp_fwd, "cp_bwd": cp_bwd, "a2a": 0.0 * t}
    return out


def stage_kind_layers(model: ModelConfig, L: dict, lf, lm, ll) -> dict:
    """``{kind: (first, middle, last)}`` layers of each kind on the pipeline stages holding
    ``lf, lm, ll`` layers: each stage holds its own slice of the pattern
    (:func:`loom.planner.moe.stage_flag_layers`, the rule MoE layers follow)."""
    pat = layer_pattern(model)
    return {kind: stage_flag_layers([ch == kind for ch in pat], L, lf, lm, ll) for kind in KINDS}


def tp_divides(model: ModelConfig, t: int) -> bool:
    """Whether TP ``t`` splits every layer kind present: attention heads and query groups
    (``*``), the FFN (``-``), Mamba heads H and groups G (``M``; loom's validate rules). For a
    non-hybrid model the dense rule (heads, groups, FFN)."""
    a, g, f = model.num_attention_heads, model.num_kv_groups, model.ffn_size
    if not is_hybrid(model):
        return not (a % t or g % t or f % t)
    n = kind_counts(model)
    _, H, G, *_ = mamba_dims(model)
    return not ((n["*"] and (a % t or g % t)) or (n["-"] and f % t)
                or (n["M"] and (H % t or G % t)))


def cp_refusal(model: ModelConfig) -> str | None:
    """What in ``model`` ``loom train`` refuses context parallelism for (its validation's rules:
    Mamba layers, the family's own ``cp_refusal`` (BERT), Gated DeltaNet and DSA layers,
    gpt-oss's ``--window-size`` / ``--softmax-type``), or None."""
    window = getattr(model, "window_size", None) is not None or \
        getattr(model, "softmax_type", "vanilla") != "vanilla"
    family = FamilyRegistry().cp_refusal(model)  # the family's own rule (BERT's)
    for why, on in (("Mamba layers", is_hybrid(model) and kind_counts(model)["M"]),
                    (family, bool(family)),
                    ("Gated DeltaNet layers", getattr(model, "gated_delta_net", False)),
                    ("--experimental-attention-variant dsa",
                     getattr(model, "experimental_attention_variant", None) == "dsa"),
                    ("--window-size / --softmax-type", window)):
        if on:
            return why
    return None


def refuses_cp(model: ModelConfig, cp) -> bool:
    """Whether CP ``cp`` > 1 is refused for ``model`` (:func:`cp_refusal`, as ``loom train``)."""
    return bool(cp and cp > 1 and cp_refusal(model))


def check_supported(model: ModelConfig, cp) -> None:
    """Raise :class:`ConfigError` when a given CP size is refused for a model with Mamba
    layers, or for a Mamba / hybrid model with experts (the planner models no MoE layers in a
    hybrid stack)."""
    if is_hybrid(model) and model.num_experts:
        raise ConfigError(f"--num-experts with --model-type {model.model_type}: the planner "
                          f"does not model mixture-of-experts layers in a Mamba / hybrid stack")
    if refuses_cp(model, cp):
        why = cp_refusal(model)
        raise ConfigError(f"--context-parallel-size {cp}: context parallelism is not supported "
                          f"for {why} (loom train refuses it)"
                          + ("; patterns of only '*' and '-' accept it" if why == "Mamba layers"
                             else ": use --context-parallel-size 1"))
