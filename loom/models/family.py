"""What a model family supplies to loom: the plain model, its parallel plan, its initializers
and its forward step. Schedules, the trainer, checkpoints and interop know only this interface.

A family is written once as plain math (``nn.Linear``, norms, an attention or mixer core) and
parallelized after construction by its plan (:mod:`loom.parallel.plan`). The forward step
follows Megatron-LM's shape: ``forward_step(chunk, batch, hidden_states) -> (output, loss_fn)``;
on the last pipeline stage ``loss_fn(output) -> (loss, metrics)`` gives the scalar to
backpropagate and a dict of named, detached scalars (e.g. ``lm loss``, an auxiliary loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

LossFn = Callable[[torch.Tensor], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
ForwardStep = Callable[[nn.Module, dict, Optional[torch.Tensor]], "tuple[torch.Tensor, LossFn]"]


@dataclass(frozen=True)
class StageSpec:
    """What one model chunk holds: its global layer indices, whether it is the first virtual
    stage (``pre_process``: embedding) and the last (``post_process``: final norm, output layer,
    loss), and the padded vocabulary Vp of this layout (Megatron pads V to a multiple of
    ``make_vocab_size_divisible_by x t``)."""

    layer_numbers: Sequence[int]
    pre_process: bool = True
    post_process: bool = True
    padded_vocab: Optional[int] = None


@dataclass(frozen=True)
class ModelFamily:
    """``build(model_cfg, stage) -> nn.Module`` (plain math, built on the meta device by loom);
    ``plan(model_cfg, stage, ctx) -> {module-name pattern: ParallelStyle}``;
    ``init(model_cfg) -> (name -> InitFn)``; ``forward_step`` as in the module docstring."""

    name: str
    build: Callable
    plan: Callable
    init: Callable
    forward_step: ForwardStep
