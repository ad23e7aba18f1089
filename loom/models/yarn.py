"""YaRN RoPE scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
Language Models", arXiv 2309.00071, sec. 3.2-3.4), as DeepSeek-V2/V3 and Megatron-Core's
``YarnRotaryEmbedding`` compute it; used by multi-latent attention (``--rope-type yarn``),
standard attention (``--position-embedding-type yarn``) and ``--enable-gpt-oss``.

Per frequency pair i of a ``d``-dimensional rotary embedding: the extrapolated frequency
``base^(-2i/d)`` and the interpolated one (divided by the scaling factor ``s``) are blended by a
linear ramp over the dimensions between the correction bounds of ``beta_fast`` and ``beta_slow``
rotations in the original context (eq. 18-20); cos and sin are multiplied by the attention
factor ``m(s, mscale) / m(s, mscale_all_dim)`` with ``m(s, x) = 0.1 x ln s + 1`` (1 for s <= 1),
and the softmax scale of multi-latent attention by ``m(s, mscale_all_dim)^2`` (DeepSeek-V2's
``mscale_all_dim``).
"""

from __future__ import annotations

import math

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """``0.1 mscale ln(scale) + 1`` for ``scale > 1``, else 1 (YaRN eq. 22's ``sqrt(1/t)``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def correction_range(beta_fast: float, beta_slow: float, dim: int, base: float,
                     original_max: int, round_to_int: bool = True) -> tuple[float, float]:
    """Dimension bounds ``(low, high)`` (clamped to ``[0, dim - 1]``) between which the
    frequencies are blended: the dimension whose wavelength fits ``beta`` rotations in the
    ``original_max`` positions (YaRN eq. 17 solved for the dimension); ``low`` floored and
    ``high`` ceiled to integers unless ``round_to_int`` is False (Megatron's
    ``--no-yarn-correction-range-round-to-int``, gpt-oss)."""
    def dim_of(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(dim: int, base: float, factor: float, original_max: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0,
                  device=None, round_to_int: bool = True) -> torch.Tensor:
    """Inverse frequencies ``[dim / 2]`` (fp32) of YaRN: extrapolated below ``low``,
    interpolated (``/ factor``) above ``high``, linearly blended between
    (:func:`correction_range`)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    extra = 1.0 / base ** exponents
    inter = 1.0 / (factor * base ** exponents)
    low, high = correction_range(beta_fast, beta_slow, dim, base, original_max, round_to_int)
    span = (high - low) if high != low else 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / span).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolated frequency kept
    return inter * (1 - keep) + extra * keep


def yarn_cos_sin(positions: torch.Tensor, dim: int, base: float, factor: float,
                 original_max: int, beta_fast: float = 32.0, beta_slow: float = 1.0,
                 mscale: float = 1.0, mscale_all_dim: float = 0.0, round_to_int: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[s, dim]`` (halves layout, like :func:`loom.models.attention.rope_cos_sin`)
    at ``positions [s]``, multiplied by the attention factor
    ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` (Megatron-Core's
    ``_yarn_get_concentration_factor``; it scales cos and sin in ``apply_rotary_pos_emb``).
    ``round_to_int``: see :func:`correction_range`."""
    inv_freq = yarn_inv_freq(dim, base, factor, original_max, beta_fast, beta_slow,
                             positions.device, round_to_int)
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    attn = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return emb.cos() * attn, emb.sin() * attn
