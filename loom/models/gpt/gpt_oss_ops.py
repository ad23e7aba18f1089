"""gpt-oss's RoPE (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card"): the YaRN RoPE of
``--enable-gpt-oss`` (:func:`gpt_oss_rope`), :mod:`loom.models.yarn` with the correction range
left unrounded (Megatron's ``yarn_correction_range_round_to_int=False``). gpt-oss's attention
core (sinks, sliding window) is shared: :class:`loom.models.attention.SinkWindowAttention`.
"""

from __future__ import annotations

import torch

from loom.config.model_gptoss import GPT_OSS_YARN
from loom.models.yarn import yarn_cos_sin


def gpt_oss_rope(positions: torch.Tensor, dim: int, base: float) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """cos, sin ``[s, dim]`` (halves layout) of ``--enable-gpt-oss``'s YaRN RoPE:
    :func:`loom.models.yarn.yarn_cos_sin` with :data:`~loom.config.model_gptoss.GPT_OSS_YARN`
    and real-valued correction bounds (clamped to ``[0, dim - 1]``; attention factor
    ``m(factor, mscale) / m(factor, mscale_all_dim)``)."""
    return yarn_cos_sin(positions, dim, base, **GPT_OSS_YARN, round_to_int=False)
