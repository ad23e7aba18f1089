"""Gated MLP activations chosen by config, shared by the dense MLP and the experts.

Megatron-Core's gated linear unit (``megatron/core/transformer/mlp.py``, unfused path): FC1's
output ``[..., 2f]`` is split in halves, the gate ``x_glu`` and the linear part ``x_linear``;
with ``--activation-func-clamp-value c`` the gate is clamped to ``<= c`` and the linear part to
``[-c, c]``; the result is ``act(x_glu) * (x_linear + --glu-linear-offset)``. ``act`` is SiLU
(``--swiglu``) or quick GeLU ``x sigmoid(1.702 x)`` (``--quick-geglu``; Hendrycks & Gimpel
2016, sec. 2's sigmoid approximation; gpt-oss: offset 1, clamp 7).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)^2`` (So et al. 2021, "Primer", arXiv 2109.08668, sec. 4; Megatron's
    ``squared_relu``, ``--squared-relu``)."""
    return F.relu(x).pow(2)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of ``y [..., 2f] = [gate; up]`` that saves only ``y`` for backward
    and recomputes ``silu(gate)`` there (autograd's own graph also keeps the SiLU output
    ``[..., f]``: 1/3 more; Megatron-Core's fused ``bias_swiglu`` saves its input alone). The
    backward runs the same kernels autograd would (``silu_backward`` of ``grad * up``, and
    ``grad * silu(gate)``), so the gradients are the unfused path's, bit for bit."""

    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        gate, up = y.chunk(2, dim=-1)
        return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)],
                         dim=-1)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``silu(gate) * up`` of ``y [..., 2f] = [gate; up]`` -> ``[..., f]``, saving only
    ``y`` for backward (:class:`_SwiGLU`)."""
    return _SwiGLU.apply(y)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x sigmoid(1.702 x)`` (Megatron's ``quick_gelu``)."""
    return x * torch.sigmoid(1.702 * x)


def glu(y: torch.Tensor, act: Callable = F.silu, linear_offset: float = 0.0,
        clamp: Optional[float] = None) -> torch.Tensor:
    """``act(gate) * (linear + linear_offset)`` of ``y [..., 2f] = [gate; linear]`` -> ``[..., f]``,
    the halves clamped first when ``clamp`` is given (gate ``<= clamp``, linear in
    ``[-clamp, clamp]``)."""
    gate, linear = y.chunk(2, dim=-1)
    if clamp is not None:
        gate, linear = gate.clamp(max=clamp), linear.clamp(-clamp, clamp)
    return act(gate) * (linear + linear_offset)


def expert_activation(cfg: Any) -> Optional[Callable]:
    """The experts' (and shared expert's) activation other than plain SwiGLU / GeLU: the
    gated one (:func:`gated_activation`), or :func:`squared_relu` with ``--squared-relu`` (an
    ungated FC1, as Megatron's experts take ``config.activation_func``); None otherwise."""
    return gated_activation(cfg) or (squared_relu if cfg.squared_relu else None)


def gated_activation(cfg: Any) -> Optional[Callable]:
    """The gated activation ``y [..., 2f] -> [..., f]`` of a model config with
    ``--quick-geglu``, a ``--glu-linear-offset`` or a clamp; None for plain SwiGLU / GeLU (the
    callers' own fast paths)."""
    if not (cfg.quick_geglu or cfg.glu_linear_offset or cfg.activation_func_clamp_value):
        return None
    return functools.partial(glu, act=quick_gelu if cfg.quick_geglu else F.silu,
                             linear_offset=cfg.glu_linear_offset,
                             clamp=cfg.activation_func_clamp_value)
