"""Mixed precision as Megatron-LM does it (Micikevicius et al. 2018, "Mixed precision training";
Megatron-LM's ``Float16Module``, ``MixedPrecisionOptimizer`` and ``DynamicGradScaler``).

``--bf16`` / ``--fp16``: the parameters are cast to 16 bits once, after initialization (the
initial values are the fp32 ones rounded, so every precision starts from the same weights); the
model then runs in 16 bits without autocast, and computes in fp32 where the model code says so
(the vocab-parallel / plain cross-entropy casts the logits to fp32, the MoE router runs in fp32,
LayerNorm / RMSNorm and the attention softmax accumulate in fp32 inside PyTorch's kernels).
Activations between pipeline stages are cast to the parameters' dtype on arrival (kept in fp32
under ``--fp32-residual-connection``: the residual stream itself, which then also travels in
fp32). Gradients accumulate in fp32 main-gradient buffers (:mod:`loom.parallel.grad_buffer`)
and the optimizer keeps fp32 master weights (:mod:`loom.training.distributed_optimizer`).

``--fp16`` multiplies the loss by a scale before backward (the forward value is unchanged:
:class:`_ScaleGrad` scales only the gradient) and the optimizer divides it out; a step whose
gradients hold inf/NaN is skipped and the :class:`LossScaler` backs off.
"""

from __future__ import annotations

from typing import Optional

import torch


def param_dtype(training) -> torch.dtype:
    """The parameters' dtype: bf16 for ``--bf16``, fp16 for ``--fp16``, else fp32. Under ZeRO-3
    fp32: FSDP2 keeps fp32 shards and casts the gathered layer for compute
    (``MixedPrecisionPolicy``, :mod:`loom.parallel.fsdp`)."""
    if getattr(training, "zero_stage", 0) == 3:
        return torch.float32
    return torch.bfloat16 if training.bf16 else torch.float16 if training.fp16 else torch.float32


@torch.no_grad()
def cast_parameters(model_chunks, dtype: torch.dtype) -> torch.dtype:
    """Cast every parameter of ``model_chunks`` to ``dtype`` in place (buffers stay as they
    are); returns ``dtype``."""
    if dtype != torch.float32:
        for chunk in model_chunks:
            for p in chunk.parameters():
                p.data = p.data.to(dtype)
    return dtype


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def precision_forward_step(forward_step, dtype: torch.dtype, scaler: Optional["LossScaler"],
                           fp32_residual: bool = False):
    """``forward_step`` for 16-bit parameters: received activations cast to ``dtype`` (left in
    fp32 with ``fp32_residual``, ``--fp32-residual-connection``); with a loss scaler, the
    loss's gradient multiplied by the current scale. Unchanged in fp32."""
    if dtype == torch.float32 and scaler is None:
        return forward_step
    arrival = torch.float32 if fp32_residual else dtype

    def step(chunk, batch, hidden_states=None):
        if hidden_states is not None and hidden_states.dtype != arrival:
            hidden_states = hidden_states.to(arrival)
        out, loss_fn = forward_step(chunk, batch, hidden_states)
        if scaler is None or loss_fn is None:
            return out, loss_fn

        def scaled(output):
            loss, metrics = loss_fn(output)
            return _ScaleGrad.apply(loss, scaler.scale), metrics
        return out, scaled
    return step


class LossScaler:
    """fp16 loss scale (Megatron's ``DynamicGradScaler`` / ``ConstantGradScaler``).

    Dynamic (``static`` None): starts at ``initial``; after an overflow (inf/NaN gradients) the
    step is skipped and, once ``hysteresis`` overflows have accumulated, the scale halves (not
    below ``min_scale``); after ``window`` steps in a row without overflow it doubles and the
    hysteresis budget refills. Static: ``scale`` never changes (overflowing steps are still
    skipped)."""

    def __init__(self, initial: float = 2.0 ** 32, window: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, static: Optional[float] = None):
        self.dynamic = static is None
        self.scale = float(initial if static is None else static)
        self.window, self.hysteresis, self.min_scale = window, hysteresis, min_scale
        self._growth, self._hysteresis_left = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self._growth = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self._growth += 1
        if self._growth == self.window:
            self._growth, self._hysteresis_left = 0, self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth": self._growth, "hysteresis": self._hysteresis_left}


def loss_scaler(training) -> Optional[LossScaler]:
    """The scaler of ``--fp16`` (None otherwise)."""
    if not training.fp16:
        return None
    return LossScaler(training.initial_loss_scale, training.loss_scale_window,
                      training.hysteresis, training.min_loss_scale, training.loss_scale)
