"""The dense MLP block the families build from, as plain math (Megatron-Core's
``transformer/mlp.py``): ``x [s, b, h] -> fc2(act(fc1(x))) [s, b, h]``. Nothing here knows
about parallelism: the plan splits ``linear_fc1`` by columns (both halves of a gated unit
alike) and ``linear_fc2`` by rows.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ModelConfig
from loom.models.activation import gated_activation, squared_relu, swiglu
from loom.models.moe import MoEContext


class MLP(nn.Module):
    """``x [s, b, h] -> [s, b, h]`` through ``f`` = ``--ffn-hidden-size`` features: GeLU,
    SwiGLU (``silu(gate) * up``, gate and up fused in one projection), or ``--squared-relu``
    (``relu(y)^2``, So et al. 2021 "Primer"; Megatron's ``squared_relu``), or the gated
    activation of :func:`~loom.models.activation.gated_activation` (``--quick-geglu``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_size
        bias = not cfg.disable_bias_linear
        self.swiglu, self.act = cfg.swiglu, gated_activation(cfg)
        self.gelu_approx = "tanh" if cfg.openai_gelu else "none"
        self.squared_relu = cfg.squared_relu
        self.linear_fc1 = nn.Linear(h, 2 * f if cfg.gated_linear_unit else f, bias=bias)
        self.linear_fc2 = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor, moe: Optional[MoEContext] = None) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.act is not None:
            y = self.act(y)
        elif self.swiglu:
            y = swiglu(y)  # saves y only: silu(gate) is recomputed in backward
        elif self.squared_relu:
            y = squared_relu(y)
        else:
            y = F.gelu(y, approximate=self.gelu_approx)
        return self.linear_fc2(y)
