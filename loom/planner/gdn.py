"""Qwen3-Next's attention in the cost model: Gated DeltaNet layers and the gated attention
output (``--experimental-attention-variant gdn``, ``--linear-attention-freq``,
``--attention-output-gate``; :mod:`loom.models.gpt.gdn`).

Per Gated DeltaNet layer, with ``nk`` key heads of ``dk``, ``nv`` value heads of ``dv`` and
convolution width ``K`` (``qk = nk dk``, ``v = nv dv``):

* parameters: ``in_proj`` ``h (2 qk + 2 v + 2 nv)``, the depthwise convolution ``K (2 qk + v)``,
  ``A_log`` and ``dt_bias`` ``2 nv`` (split over TP with their heads), ``out_proj`` ``v h``; the
  output norm's ``dv`` replicated;
* forward FLOPs per token: Megatron-LM's ``gdn_layer_flops`` (``training.py``, d98e8a6):
  ``2 (h (2 qk + 2 v + 2 nv) + K (2 qk + v) + 4 nv dv^2 + h v)``, the gated delta rule's
  ``4 nv dv^2`` (``K K^T``, ``V K^T``, the state update and ``S q``) token-linear, so counted
  with the projections' GEMMs here, not with the attention scores.

The output gate adds ``a d`` rows to the QKV projection (``h a d`` parameters, ``2 h a d``
FLOPs per token: Megatron's ``gate_projection_size``).

The planner prices every layer alike, so a model with both kinds gets the layer mean
(:func:`layer_mix`): totals are exact, a pipeline stage's share exact when it holds whole
periods of the pattern. Activation memory stays the attention layer's (named on stderr).
"""

from __future__ import annotations

from loom.config import ModelConfig


def gdn_share(model: ModelConfig) -> float:
    """The fraction of layers that are Gated DeltaNet layers (0 without any)."""
    if not getattr(model, "gated_delta_net", False):
        return 0.0
    L = model.num_layers
    return sum(model.is_gdn_layer(i) for i in range(L)) / L


def gdn_params(model: ModelConfig) -> tuple[int, int]:
    """``(tp_sharded, replicated)`` parameters of one Gated DeltaNet layer's mixer (count)."""
    h, K = model.hidden_size, model.linear_conv_kernel_dim
    nv, dv = model.linear_num_value_heads, model.linear_value_head_dim
    qk, v = model.linear_num_key_heads * model.linear_key_head_dim, nv * dv
    return h * (2 * qk + 2 * v + 2 * nv) + K * (2 * qk + v) + 2 * nv + v * h, dv


def gdn_flops_per_token(model: ModelConfig) -> float:
    """Forward FLOPs per token of one Gated DeltaNet layer's mixer (Megatron's
    ``gdn_layer_flops``), all token-linear."""
    h, K = model.hidden_size, model.linear_conv_kernel_dim
    nv, dv = model.linear_num_value_heads, model.linear_value_head_dim
    qk, v = model.linear_num_key_heads * model.linear_key_head_dim, nv * dv
    return float(2 * (h * (2 * qk + 2 * v + 2 * nv) + K * (2 * qk + v) + 4 * nv * dv * dv
                      + h * v))


def gate_params(model: ModelConfig) -> int:
    """Parameters of the attention output gate's projection rows (``h a d``; 0 without it)."""
    if not getattr(model, "attention_output_gate", False):
        return 0
    return model.hidden_size * model.num_attention_heads * model.head_dim


def layer_mix(standard: tuple, gdn: tuple, share: float) -> tuple:
    """Each term of ``standard`` and ``gdn`` (per-layer quantities) weighted by the Gated
    DeltaNet ``share`` of layers: the per-layer mean."""
    if not share:
        return standard
    return tuple((1 - share) * a + share * b for a, b in zip(standard, gdn))
