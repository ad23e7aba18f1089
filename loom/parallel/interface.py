"""What :mod:`loom.parallel` knows of a model family, and all it knows: the forward-step types the
schedules drive, the :class:`StageSpec` of a model chunk, the parts of a family that
:mod:`loom.parallel.parallelize` calls (:class:`FamilyParts`), and two marker classes that
activation recomputation looks for (and one, :class:`RecomputeReplay`, for state a recomputed
forward must replay). Model code imports these from here (or from
:mod:`loom.models.family`, which re-exports them); nothing here imports a family.

The forward step follows Megatron-LM's shape: ``forward_step(chunk, batch, hidden_states) ->
(output, loss_fn)``; on the last pipeline stage ``loss_fn(output) -> (loss, metrics)`` gives the
scalar to backpropagate and a dict of named, detached scalars (e.g. ``lm loss``, an auxiliary
loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

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


class FamilyParts(Protocol):
    """What building a parallel chunk needs of a family (a
    :class:`loom.models.family.ModelFamily` has it): ``build(model_cfg, stage) -> nn.Module``
    (plain math, called on the meta device), ``plan(model_cfg, stage, ctx) -> [(module-name
    pattern, ParallelStyle)]`` and ``init(model_cfg) -> (name -> InitFn)``."""

    build: Callable
    plan: Callable
    init: Callable


class SelectiveRecompute:
    """Marker base class: ``--recompute-granularity selective`` recomputes the forward of every
    module of this type (the attention core: softmax, dropout, the s^2 activations)."""


class NeverRecompute:
    """Marker base class: a call given an argument of this type (a generation KV cache) is never
    recomputed, whatever the granularity."""


class RecomputeReplay:
    """Base class of a module whose forward reads and updates state kept across calls (the MoE
    router's ``global_aux_loss`` running load over the step's micro-batches). A recomputed
    forward runs later, after other micro-batches have moved that state, so it must not update
    it again nor read it anew: around a checkpointed region holding such a module, activation
    recomputation (:func:`loom.parallel.recompute.checkpointed`) sets ``replay_mode`` to
    ``"record"`` for the first run, where the module appends what it derived from the state to
    ``replay_log``, and to ``"replay"`` for the recomputation, where it takes those values back
    in order; None otherwise (no recomputation: the module does its normal update)."""

    replay_mode: Optional[str] = None
    replay_log: Optional[list] = None

    def replayed(self, compute: Callable[[], object]) -> object:
        """``compute()`` (which may update the module's state) in a normal or recorded call; in
        a recomputation, the value the first run recorded at the same position."""
        if self.replay_mode == "replay":
            return self.replay_log.pop(0)
        value = compute()
        if self.replay_mode == "record":
            self.replay_log.append(value)
        return value
