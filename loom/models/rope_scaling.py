"""Llama 3.1's RoPE frequency scaling (``--use-rope-scaling``, ``--rope-scaling-factor``; Meta's
Llama 3.1 reference code, as Megatron-Core's ``RotaryEmbedding._apply_scaling`` and HF's
``rope_type: llama3`` compute it), used by :func:`loom.models.attention.rope_cos_sin`.

Each inverse frequency ``f`` (wavelength ``w = 2 pi / f`` positions) of plain RoPE is mapped by
its wavelength against the original context ``C`` (8192 in Llama 3.1 and 4; Megatron fixes it
and the factors, loom's ``--rope-scaling-low/high-freq-factor`` and
``--rope-scaling-original-max-position-embeddings`` give them: Llama 4's high factor is 1):

* ``w < C / high_freq_factor`` (short wavelengths, high frequencies): kept, ``f``;
* ``w > C / low_freq_factor`` (long wavelengths): interpolated, ``f / factor``;
* between: blended, ``(1 - a) f / factor + a f`` with
  ``a = (C / w - low_freq_factor) / (high_freq_factor - low_freq_factor)`` (1 at the short end,
  0 at the long end).
"""

from __future__ import annotations

import math

import torch

from loom.config.model_rope import LLAMA3_SCALING


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float,
                    low_freq_factor: float = LLAMA3_SCALING["low_freq_factor"],
                    high_freq_factor: float = LLAMA3_SCALING["high_freq_factor"],
                    original_max: int = LLAMA3_SCALING["original_max"]) -> torch.Tensor:
    """Llama 3.1's scaled inverse frequencies ``[d / 2]`` (fp32) of plain RoPE's ``inv_freq
    [d / 2]`` (module docstring): divided by ``factor`` above wavelength
    ``original_max / low_freq_factor``, kept below ``original_max / high_freq_factor``, blended
    between."""
    wavelength = 2 * math.pi / inv_freq
    long_end, short_end = original_max / low_freq_factor, original_max / high_freq_factor
    if high_freq_factor == low_freq_factor:  # Llama 4's: no band between (no blend to divide)
        return torch.where(wavelength > long_end, inv_freq / factor, inv_freq)
    blend = (original_max / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    return torch.where(wavelength > long_end, inv_freq / factor,
                       torch.where(wavelength < short_end, inv_freq, blended))
